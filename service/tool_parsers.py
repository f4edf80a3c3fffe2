"""Tool-call parsers: each model family's way of writing tool calls in its text.

`--tool-call-parser` picks one (`TOOL_PARSERS`); without it, `default_parser` picks from
the chat template. The chat API (`pagedinfer.service.openai.tools`) runs them over a
choice's text, whole or as it streams.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_tool_call(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ------------------------------------------------------------------------ parsers


class ToolParser:
    """Finds a model family's tool calls in its text."""

    name = ""
    start = ""  # the text that opens the calls: what a stream holds back

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content before the calls or None, the calls); no calls: (text, [])."""
        raise NotImplementedError

    def calls_start(self, text: str, content_sent: bool) -> int | None:
        """Where calls may start in a stream's text: the marker, or a tail that may grow
        into it (None: nothing to hold back)."""
        at = text.find(self.start)
        return at if at >= 0 else len(text) - partial_suffix(text, self.start)

    def opened(self, held: str) -> bool:
        """Whether the held text surely begins the calls (not a partial marker)."""
        return held.startswith(self.start)


class HermesParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more."""

    name = "hermes"
    start = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        head, marker, _ = text.partition(self.start)
        if not marker:
            return text, []
        calls = [c for body in self._call.findall(text) if (c := call_of(body)) is not None]
        if not calls:
            return text, []
        return head.strip() or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), optionally after `<|python_tag|>`."""

    name = "llama3_json"
    start = "{"

    def calls_start(self, text: str, content_sent: bool) -> int | None:
        # Calls are the whole answer: hold it while it may be one, until the end.
        head = text.lstrip()
        return 0 if not content_sent and (not head or head[0] in "{<") else None

    def opened(self, held: str) -> bool:
        return False  # sent whole at the end

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_objects(body):
            call = call_of(part)
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        head, marker, rest = text.partition(self.start)
        if not marker:
            return text, []
        try:
            items = json.loads(rest.strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for item in items if (c := call_of(item)) is not None]
        if len(calls) != len(items) or not calls:
            return text, []
        return head.strip() or None, calls


class Phi4MiniJsonParser(ToolParser):
    """Phi-4-mini: `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`; the
    markers are special tokens, so the text may hold the JSON list alone."""

    name = "phi4_mini_json"
    start = "<|tool_call|>"

    def calls_start(self, text: str, content_sent: bool) -> int | None:
        head = text.lstrip()
        return 0 if not content_sent and (not head or head[0] in "[<") else None

    def opened(self, held: str) -> bool:
        return False  # sent whole at the end

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.replace(self.start, "").replace("<|/tool_call|>", "").strip()
        if not body.startswith("["):
            return text, []
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        calls = [c for item in items if (c := call_of(item)) is not None]
        if not calls or len(calls) != len(items):
            return text, []
        return None, calls


class PythonicParser(ToolParser):
    """Gemma 3 and Llama 4 style: a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time(zone="CET")]`, optionally in a ```tool_code
    block. Arguments must be literals."""

    name = "pythonic"
    start = "["

    def calls_start(self, text: str, content_sent: bool) -> int | None:
        head = text.lstrip()
        return 0 if not content_sent and (not head or head[0] in "[`") else None

    def opened(self, held: str) -> bool:
        return False  # sent whole at the end

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix("```tool_code").removeprefix("```").strip()
        body = body.removesuffix("```").strip()
        try:
            tree = ast.parse(body, mode="eval")
        except SyntaxError:
            return text, []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return text, []
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return text, []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return text, []
            if None in arguments:  # **kwargs
                return text, []
            calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesParser, Llama3JsonParser, MistralParser, Phi4MiniJsonParser, PythonicParser)
}


def default_parser(chat_template: str | None) -> str:
    """The parser for a model, from its chat template; hermes (the fallback prompt's
    format) where the template says nothing."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|tool_call|>" in template:
        return "phi4_mini_json"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def call_of(body: str | dict) -> ParsedCall | None:
    try:
        item = json.loads(body) if isinstance(body, str) else body
    except json.JSONDecodeError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _split_objects(text: str) -> list[str]:
    """`{...}; {...}` -> the JSON objects' texts (a decoder pass, not a split on ';')."""
    decoder = json.JSONDecoder()
    parts, i = [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \n\t;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[i:end])
        i = end
    return parts


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that starts `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
