"""Tool calling on /v1/chat/completions (docs/architecture.md section 8): tools to the
model, its calls back as tool_calls.

Tools reach the model through its chat template (`tools`), or, where the template has
no place for them, through `FALLBACK_PROMPT` in the system message, which asks for
Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks; earlier
tool calls and tool results in the history are rendered the same way for such a
template.

`tool_choice`:
- "none": the model writes text (the tools are still shown, as OpenAI does, unless
  the server runs with `--exclude-tools-when-tool-choice-none`, as vLLM's flag).
- "auto" (the default with tools): the model's text is parsed by the family's parser
  (`--tool-call-parser`: hermes for Qwen2.5/Qwen3/SmolLM3 and the fallback prompt,
  llama3_json, mistral); text before the first call stays content.
- "required" and a named function: the output is constrained by a grammar built from
  the tools' parameter schemas, so the arguments always validate: a JSON array of
  `{"name", "arguments"}` objects for "required" (one, unless parallel_tool_calls), the
  arguments object itself for a named function.

Streaming sends each call as OpenAI does: a first delta with its index, id, type and
name (arguments ""), then its arguments in fragments as the model writes them: in every
format, once the call's name is written (JSON calls whose arguments come before their
name are sent once complete; pythonic calls send each argument, as JSON, once its value
is complete), and in "required" and named calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.service.openai.errors import bad_request
from pagedinfer.service.openai.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from pagedinfer.service.structured_output import GrammarError, StructuredOutput
from pagedinfer.service.tool_parsers import (
    TOOL_PARSERS,
    CallScanner,
    HermesParser,
    JsonCallScanner,
    JsonScan,
    ParsedCall,
    ToolParser,
    call_of,
    default_parser,
)

FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions "
    "are given as JSON schemas within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


# -------------------------------------------------------------------- the request


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # OpenAI's form, for the chat template
    parser: ToolParser | None = None  # auto: reads the model's calls
    output: StructuredOutput | None = None  # required / named: the grammar
    named: str | None = None

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a choice's whole text."""
        if self.mode == "named":
            return None, [ParsedCall(self.named or "", _normalised(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short by max_tokens
            if not isinstance(items, list):
                return text, []
            calls = [c for item in items if (c := call_of(item)) is not None]
            return None, calls
        if self.parser is None:
            return text, []
        return self.parser.parse(text)

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _normalised(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text  # cut short by max_tokens: as written


def plan_tools(request: ChatCompletionRequest, parser_name: str, grammars: Any) -> ToolPlan | None:
    """The request's tool plan; None without tools. 400 naming the field for a tool
    whose parameters is not a JSON schema the engine can enforce, an unknown function
    in tool_choice, or a tool_choice that needs tools."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    schemas = {}
    for i, tool in enumerate(tools):
        schemas[tool.function.name] = _parameters(tool, i, grammars)
    if len(schemas) != len(tools):
        raise bad_request("tools must have distinct function names", "tools")
    openai_tools = [tool.model_dump(by_alias=True, exclude_none=True) for tool in tools]
    for tool in openai_tools:
        tool["function"].setdefault("parameters", EMPTY_PARAMETERS)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(schemas)})",
                "tool_choice",
            )
        return ToolPlan(
            "named", openai_tools, output=StructuredOutput.json_schema(schemas[name]), named=name
        )
    if choice == "required":
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan("required", openai_tools, output=StructuredOutput.json_schema(array))
    if choice == "none":
        return ToolPlan("none", openai_tools)
    return ToolPlan("auto", openai_tools, parser=TOOL_PARSERS[parser_name]())


def _parameters(tool: Tool, index: int, grammars: Any) -> dict[str, Any]:
    param = f"tools[{index}].function.parameters"
    schema = tool.function.parameters
    if schema is None:
        return EMPTY_PARAMETERS
    if not isinstance(schema, dict):
        raise bad_request(
            f"{param} must be a JSON schema object, got {type(schema).__name__}", param
        )
    if schema.get("type", "object") != "object":
        raise bad_request(
            f"{param} must be a JSON schema of type object, got type {schema['type']!r}", param
        )
    try:
        grammars.check(StructuredOutput.json_schema(schema))
    except GrammarError as err:
        raise bad_request(f"{param}: {err}", param) from None
    return schema


def template_supports_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def render_history(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool
) -> list[dict[str, Any]]:
    """The messages for the chat template: with a template that takes tools (`native`),
    assistant tool calls with their arguments as objects, as templates expect; without,
    the fallback prompt in the system message and calls and results as Hermes text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls and native:
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _loaded(c)}} for c in calls
            ]
        elif calls:
            blocks = [
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _loaded(c)})
                + "\n</tool_call>"
                for c in calls
            ]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message["role"] == "tool" and not native:
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    if plan is not None and not native:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loaded(call: dict[str, Any]) -> Any:
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


# ---------------------------------------------------------------------- streaming


# A Hermes call whose name comes first and whose arguments are an object: streamed as it
# is written. Any other order waits for the call's end.
_HERMES_HEAD = re.compile(
    r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)'
)
_HERMES_END = "</tool_call>"


class ToolStream:
    """One choice's stream: content as it comes until calls may start, then each call's
    deltas, its arguments as they are written: a Hermes call (the default parser's) read
    here, the other formats' and "required" calls by their `CallScanner`."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text that may be (part of) tool calls
        self.sent_calls = 0
        self.in_content = plan.mode == "auto"
        self.content_sent = False
        # The Hermes call being streamed: where its arguments start in `held`, how far
        # they were read and sent, and `args_end` once the arguments' object closed.
        self.args_at: int | None = None
        self.arguments = JsonScan(0)
        self.args_end: int | None = None
        self.scanner: CallScanner | None = None  # the other formats', once calls opened
        self.scanned_to = 0  # of `held`, fed to the scanner

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool call deltas to send now) for new text."""
        mode, parser = self.plan.mode, self.plan.parser
        if mode == "none":
            return text, []
        if mode == "named":
            return "", self._named(text)
        self.held += text
        content = ""
        if self.in_content and parser is not None:
            at = parser.calls_start(self.held, self.content_sent)
            if at is None:
                at = len(self.held)
            content, self.held = self.held[:at], self.held[at:]
            self.content_sent = self.content_sent or bool(content.strip())
            if not parser.opened(self.held):
                return content, []
            self.in_content = False
        if parser is not None and parser.name == "hermes":
            return content, self._hermes()
        return content, self._scanned()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: content, or the remaining calls."""
        if self.plan.mode in ("none", "named"):
            return "", []
        if self.args_at is not None or (self.scanner is not None and self.sent_calls):
            self.held = ""  # streamed calls, the last maybe without its end: sent as written
        content, calls = self.plan.parse(self.held)
        if not calls:
            if self.sent_calls:
                return "", []
            return (self.held if self.plan.mode == "auto" else (content or "")), []
        return "", self._send(calls)

    def _hermes(self) -> list[dict[str, Any]]:
        """The deltas the held Hermes text allows now: each call's head once its name is
        written, its arguments as they come, and whole calls written in another order."""
        deltas: list[dict[str, Any]] = []
        while True:
            if self.args_at is None:
                head = _HERMES_HEAD.match(self.held)
                if head is None:
                    end = self.held.find(_HERMES_END)
                    if end < 0:
                        return deltas
                    _, calls = HermesParser().parse(self.held[: end + len(_HERMES_END)])
                    deltas += self._send(calls)
                    self.held = self.held[end + len(_HERMES_END) :].lstrip()
                    continue
                name = json.loads(head.group(1))
                deltas += self._head(name)
                self.args_at, self.arguments, self.args_end = head.end(), JsonScan(head.end()), None
            if self.args_end is None:
                start = self.arguments.pos
                self.args_end = self.arguments.scan(self.held)
                if self.arguments.pos > start:
                    fragment = self.held[start : self.arguments.pos]
                    deltas.append(
                        {"index": self.sent_calls - 1, "function": {"arguments": fragment}}
                    )
                if self.args_end is None:
                    return deltas
            end = self.held.find(_HERMES_END, self.args_end)
            if end < 0:
                return deltas
            self.held = self.held[end + len(_HERMES_END) :].lstrip()
            self.args_at = self.args_end = None

    def _scanned(self) -> list[dict[str, Any]]:
        """The deltas of what the format's scanner reads in the new held text."""
        if self.scanner is None:
            parser = self.plan.parser
            if self.plan.mode == "required":  # the grammar's JSON list, name first
                self.scanner = JsonCallScanner(" \t\r\n,[]")
            elif parser is not None:
                self.scanner = parser.scanner()
            if self.scanner is None:
                return []
        new, self.scanned_to = self.held[self.scanned_to :], len(self.held)
        deltas: list[dict[str, Any]] = []
        for kind, value in self.scanner.feed(new):
            if kind == "name":
                deltas += self._head(value)
            elif kind == "arguments":
                deltas.append({"index": self.sent_calls - 1, "function": {"arguments": value}})
            else:
                deltas += self._send([value])
        return deltas

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = self._head(self.plan.named or "") if self.sent_calls == 0 else []
        if text:
            deltas.append({"index": 0, "function": {"arguments": text}})
        return deltas

    def _head(self, name: str) -> list[dict[str, Any]]:
        """A new call's first delta: its index, id, type and name."""
        call = ParsedCall(name, "")
        self.sent_calls += 1
        return [
            {
                "index": self.sent_calls - 1,
                "id": call.id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ]

    def _send(self, calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
        """Whole calls not sent before: each one's head, then its arguments."""
        deltas = []
        for call in calls:
            deltas += self._head(call.name)
            deltas.append({"index": self.sent_calls - 1, "function": {"arguments": call.arguments}})
        return deltas


def prepare_tools(
    request: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    options: Any,
    engine: Any,
    parser_name: str | None,
    exclude_when_none: bool = False,
) -> tuple[ToolPlan | None, list[dict[str, Any]], Any]:
    """(the request's tool plan, the messages for the template, the chat options with
    the tools where the template renders them). `messages` are `chat_messages`'s, in
    the order of `request.messages`; their tool calls and tool call ids are added here.
    exclude_when_none: tool_choice "none" shows the model no tools."""
    template = getattr(engine.tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None
    name = parser_name or default_parser(template)
    plan = plan_tools(request, name, engine.engine.grammars)
    history = []
    for message, given in zip(messages, request.messages, strict=True):
        message = dict(message)
        if given.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in given.tool_calls]
        if given.tool_call_id is not None:
            message["tool_call_id"] = given.tool_call_id
        if given.name is not None and given.role == "tool":
            message["name"] = given.name
        history.append(message)
    shown = None if plan is None or (exclude_when_none and plan.mode == "none") else plan
    uses_tools = shown is not None or any("tool_calls" in m for m in history)
    if not uses_tools and all(m["role"] != "tool" for m in history):
        return plan, messages, options
    native = template_supports_tools(template)
    history = render_history(history, shown, native)
    if shown is not None and native:
        options = dataclasses.replace(options, tools=shown.tools)
    return plan, history, options
