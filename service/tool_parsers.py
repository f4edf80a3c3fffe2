"""Tool-call parsers: each model family's way of writing tool calls in its text.

`--tool-call-parser` picks one (`TOOL_PARSERS`); without it, `default_parser` picks from
the chat template. The chat API (`pagedinfer.service.openai.tools`) runs them over a
choice's text, whole or as it streams: a parser's `scanner` reads its calls as they are
written, each call's name as soon as it is complete, then its arguments piece by piece.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


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

    def scanner(self) -> CallScanner | None:
        """Reads the calls as they stream, from where they open; None: the calls are
        read whole at the end."""
        return None


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
        return _LLAMA3_OPEN.match(held) is not None

    def scanner(self) -> CallScanner:
        return JsonCallScanner(" \t\r\n;", ("<|python_tag|>",))

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

    def scanner(self) -> CallScanner:
        return JsonCallScanner(" \t\r\n,[]", (self.start,))

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
        return _PHI4_OPEN.match(held) is not None

    def scanner(self) -> CallScanner:
        return JsonCallScanner(" \t\r\n,[]", (self.start, "<|/tool_call|>"))

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
        return _PYTHONIC_OPEN.match(held) is not None

    def scanner(self) -> CallScanner:
        return PythonicCallScanner()

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


# Text that surely opens the calls of a format without a marker of its own (or with one
# that may be a skipped special token): a call's name, then its arguments' key.
_JSON_NAME_FIRST = r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:'
_LLAMA3_OPEN = re.compile(rf"\s*(?:<\|python_tag\|>|{_JSON_NAME_FIRST})")
_PHI4_OPEN = re.compile(rf"\s*(?:<\|tool_call\|>|\[\s*{_JSON_NAME_FIRST})")
_PYTHONIC_OPEN = re.compile(
    r"\s*(?:```(?:tool_code)?\s*)?\[\s*[A-Za-z_]\w*\s*\(\s*(?:\)|[A-Za-z_]\w*\s*=(?!=))"
)

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


# ---------------------------------------------------------------------- streaming


# What a scanner reads in a stream: a call's name (its arguments follow in pieces), a
# piece of the current call's arguments, or a whole call (written in another order).
CallEvent = tuple[Literal["name", "arguments", "call"], Any]


class CallScanner:
    """Reads a format's calls from the text that opened them, as it streams in. `broken`
    once the text stops looking like calls: nothing more is read."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # what was read so far
        self.broken = False

    def feed(self, text: str) -> list[CallEvent]:
        self.text += text
        events: list[CallEvent] = []
        while not self.broken and self._step(events):
            pass
        return events

    def _step(self, events: list[CallEvent]) -> bool:
        """Read what the text allows next into `events`; False to wait for more."""
        raise NotImplementedError

    def _skip(self, chars: str, markers: Sequence[str]) -> bool:
        """Move over whole `markers` and `chars`; False while the text ends there or in
        what may still grow into a marker."""
        text = self.text
        while self.pos < len(text):
            rest = text[self.pos : self.pos + max(map(len, markers), default=0)]
            marker = next((m for m in markers if rest.startswith(m)), None)
            if marker is not None:
                self.pos += len(marker)
            elif any(m.startswith(rest) for m in markers):
                return False  # the text ends in part of a marker
            elif text[self.pos] in chars:
                self.pos += 1
            else:
                return True
        return False


# A JSON call whose name comes first and whose arguments are an object: streamed as it is
# written. Any other order waits for the call's end.
JSON_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class JsonCallScanner(CallScanner):
    """JSON call objects (`{"name": ..., "arguments" or "parameters": {...}}`) between
    `separators` and wrapping `markers`: a list, or objects separated by `;`."""

    def __init__(self, separators: str, markers: Sequence[str] = ()) -> None:
        super().__init__()
        self.separators = separators
        self.markers = markers
        self.state: Literal["between", "object", "arguments", "tail"] = "between"
        self.start = 0  # where the call object being read starts
        self.braces = JsonScan(0)  # of the call object, or of its streamed arguments

    def _step(self, events: list[CallEvent]) -> bool:
        text = self.text
        if self.state == "between":
            if not self._skip(self.separators, self.markers):
                return False
            if text[self.pos] != "{":
                self.broken = True
                return False
            self.state, self.start, self.braces = "object", self.pos, JsonScan(self.pos)
        if self.state == "object":
            head = JSON_CALL_HEAD.match(text, self.start)
            if head is None:  # another order (or the head is not written yet)
                end = self.braces.scan(text)
                if end is None:
                    return False
                call = call_of(text[self.start : end])
                if call is None:
                    self.broken = True
                    return False
                events.append(("call", call))
                self.state, self.pos = "between", end
                return True
            events.append(("name", json.loads(head.group(1))))
            self.state, self.pos, self.braces = "arguments", head.end(), JsonScan(head.end())
        if self.state == "arguments":
            end = self.braces.scan(text)
            if self.braces.pos > self.pos:
                events.append(("arguments", text[self.pos : self.braces.pos]))
                self.pos = self.braces.pos
            if end is None:
                return False
            self.state, self.braces = "tail", JsonScan(end, depth=1)  # in the call object
        end = self.braces.scan(text)
        if end is None:
            return False
        self.state, self.pos = "between", end
        return True


class PythonicCallScanner(CallScanner):
    """A Python list of calls with keyword arguments, `[f(a=1, b="x"), g()]`, maybe in a
    ```tool_code block: a call's name once its first argument (or its end) shows it is a
    call, then each argument as JSON once its value is complete."""

    def __init__(self) -> None:
        super().__init__()
        self.state: Literal["open", "between", "arguments", "done"] = "open"
        self.first = True  # no argument of the current call sent yet
        self.keyword = ""  # the argument being read, and its value
        self.value: PythonScan | None = None

    def _step(self, events: list[CallEvent]) -> bool:
        text = self.text
        if self.state == "open":
            if not self._skip(" \t\r\n", ("```tool_code", "```")):
                return False
            if text[self.pos] != "[":
                self.broken = True
                return False
            self.state, self.pos = "between", self.pos + 1
        if self.state == "between":
            if not self._skip(" \t\r\n,", ()):
                return False
            if text[self.pos] == "]":
                self.state = "done"
                return False
            head = _PY_CALL_HEAD.match(text, self.pos)
            if head is None:
                self.broken = _PY_CALL_PARTIAL.fullmatch(text, self.pos) is None
                return False
            events.append(("name", head.group(1)))
            self.state, self.pos, self.first = "arguments", head.end(), True
        if self.state != "arguments" or not self._skip(" \t\r\n,", ()):
            return False
        if text[self.pos] == ")":
            events.append(("arguments", "{}" if self.first else "}"))
            self.state, self.pos = "between", self.pos + 1
            return True
        if self.value is None:
            keyword = _PY_KEYWORD.match(text, self.pos)
            if keyword is None:
                self.broken = _PY_KEYWORD_PARTIAL.fullmatch(text, self.pos) is None
                return False
            self.keyword, self.value = keyword.group(1), PythonScan(keyword.end())
        start = self.value.start
        end = self.value.scan(text)
        if end is None:
            return False
        try:
            value = ast.literal_eval(text[start:end].strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.broken = True
            return False
        piece = f"{json.dumps(self.keyword)}: {json.dumps(value, ensure_ascii=False)}"
        events.append(("arguments", ("{" if self.first else ", ") + piece))
        self.pos, self.first, self.value = end, False, None
        return True


@dataclass
class JsonScan:
    """Reads JSON text from `pos` for the bracket that brings `depth` back to 0, minding
    strings and escapes; resumable as the text grows."""

    pos: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """Read on; the index just after that bracket, or None before it is written."""
        i = self.pos
        while i < len(text):
            c = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


@dataclass
class PythonScan:
    """Reads a Python literal from `start` for its end: the `,` or closing bracket at
    depth 0 after it, minding strings and escapes; resumable as the text grows."""

    start: int
    pos: int = -1
    depth: int = 0
    quote: str = ""
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """Read on; the index of the literal's end, or None before it is written."""
        i = self.start if self.pos < 0 else self.pos
        while i < len(text):
            c = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}" and self.depth:
                self.depth -= 1
            elif c in ",)]}":
                self.pos = i
                return i
            i += 1
        self.pos = i
        return None


# A pythonic call's name, once an argument (or the call's end) follows it; what may still
# grow into one; a keyword argument's name.
_PY_CALL_HEAD = re.compile(r"([A-Za-z_]\w*)\s*\(\s*(?=\)|[A-Za-z_]\w*\s*=(?!=))")
_PY_CALL_PARTIAL = re.compile(r"[A-Za-z_]\w*\s*(?:\(\s*(?:[A-Za-z_]\w*\s*)?)?")
_PY_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)")
_PY_KEYWORD_PARTIAL = re.compile(r"[A-Za-z_]\w*\s*")
