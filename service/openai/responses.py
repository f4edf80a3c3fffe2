"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat machinery.

A Responses request is translated into a chat completion request (input items into
messages, `instructions` into a system message, function tools and `text.format` into
their chat forms), served by `chat`, and its answer turned back into Response output
items: a `reasoning` item when a reasoning parser split the thinking, a `message` with
`output_text`, and one `function_call` item per tool call. Streams send the Responses
event types (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`) with a sequence number each.

Nothing is stored: `store: true` and `previous_response_id` are refused with a 400 that
says so; a client replays the conversation as input items instead.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, RootModel, ValidationError

from pagedinfer.service.openai import chat
from pagedinfer.service.openai.errors import APIError, bad_request, from_validation_error
from pagedinfer.service.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Strict,
)
from pagedinfer.service.openai.serving import ServingState

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# reasoning.effort values that turn a thinking template's thinking off.
NO_THINKING = ("none", "minimal")
# include values served: reasoning is returned as plain text, never encrypted, so a
# stateless client's request for encrypted reasoning needs nothing more.
INCLUDABLE = ("reasoning.encrypted_content",)
# Chat fields whose Responses names differ, for errors the chat machinery raises.
RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(Strict):
    """POST /v1/responses (the stateless subset)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None


@dataclass
class ResponsesJob:
    """A Responses request, queued as a chat job."""

    id: str
    created: int
    request: ResponsesRequest
    chat_job: chat.ChatJob
    sequence: int = 0
    usage: dict[str, Any] | None = None
    items: list[dict[str, Any]] = field(default_factory=list)


def start_response(state: ServingState, request: ResponsesRequest) -> ResponsesJob:
    """Checks a Responses request and queues it; APIError if it is refused."""
    if request.store:
        raise bad_request(
            "store: this server keeps no responses; send store: false and replay the "
            "conversation as input items",
            "store",
        )
    if request.previous_response_id is not None:
        raise bad_request(
            "previous_response_id: this server keeps no responses; replay the conversation "
            "as input items",
            "previous_response_id",
        )
    unknown = sorted(set(request.include or ()) - set(INCLUDABLE))
    if unknown:
        raise bad_request(f"include: {', '.join(unknown)} cannot be included here", "include")
    chat_request = to_chat_request(request)
    try:
        chat_job = chat.start_chat(state, chat_request)
    except APIError as exc:
        raise renamed(exc) from None
    return ResponsesJob(
        id=item_id("resp"), created=int(time.time()), request=request, chat_job=chat_job
    )


def renamed(error: APIError) -> APIError:
    """A chat error with the field named as the Responses API names it."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    base = head.split("[", 1)[0]
    if base not in RESPONSES_NAMES:
        return error
    param = RESPONSES_NAMES[base] + (head[len(base) :] if base != "messages" else "") + dot + rest
    message = error.message
    if message.startswith(base):
        message = RESPONSES_NAMES[base] + message[len(base) :]
    return APIError(error.status, message, param=param.rstrip("."), code=error.code)


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `request`; 400 naming the Responses field."""
    body: dict[str, Any] = {"messages": input_messages(request), "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "metadata", "user"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    if isinstance(request.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type != "text":
        response_format: dict[str, Any] = {"type": text_format.type}
        if text_format.type == "json_schema":
            if text_format.name is None or text_format.json_schema is None:
                raise bad_request(
                    "text.format: a json_schema format needs a name and a schema", "text.format"
                )
            response_format["json_schema"] = {
                "name": text_format.name,
                "schema": text_format.json_schema,
                **({"strict": text_format.strict} if text_format.strict is not None else {}),
            }
        body["response_format"] = response_format
    if request.reasoning is not None and request.reasoning.effort in NO_THINKING:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise renamed(from_validation_error(exc)) from None


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """Chat messages of `instructions` and `input`: message items as they are,
    function_call items as assistant tool calls, function_call_output items as tool
    messages; replayed reasoning items are dropped (templates drop past thinking)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        if not request.input:
            raise bad_request("input must not be empty", "input")
        messages.append({"role": "user", "content": request.input})
        return messages
    if not request.input:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(request.input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i),
                             "arguments": _string(item, "arguments", i)},
            }  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_request(f"input[{i}].output must be a string", f"input[{i}].output")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output}
            )
        elif kind != "reasoning":
            raise bad_request(
                f"input[{i}].type {kind!r} is not served; use message, function_call, "
                "function_call_output or reasoning items",
                f"input[{i}].type",
            )
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("input holds no message", "input")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise bad_request(
            f"input[{i}].role must be one of {', '.join(INPUT_ROLES)}, got {role!r}",
            f"input[{i}].role",
        )
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise bad_request(f"unknown field: input[{i}].{sorted(unknown)[0]}", f"input[{i}]")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"input[{i}].content must be a string or a list of text parts", f"input[{i}].content"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"input[{i}].content[{j}] is {kind!r}: only text parts are served",
                f"input[{i}].content[{j}]",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}].content[{j}].text must be a string", f"input[{i}].content[{j}].text"
            )
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


def _string(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and name != "arguments"):
        raise bad_request(f"input[{i}].{name} must be a non-empty string", f"input[{i}].{name}")
    return value


# ------------------------------------------------------------------------- output


def item_id(prefix: str) -> str:
    """An id as OpenAI writes them in this API: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_items(message: Any, finished: bool = True) -> list[dict[str, Any]]:
    """The output items of a chat completion's assistant message."""
    status = "completed" if finished else "incomplete"
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(item_id("rs"), reasoning))
    if message.get("content"):
        items.append(output_message(item_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or ():
        items.append(
            function_call_item(
                item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]
            )
        )
    return items


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def output_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_body(
    job: ResponsesJob,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object: the request's settings echoed, its output and usage."""
    request = job.request
    text_format = request.text.format if request.text and request.text.format else None
    return {
        "id": job.id,
        "object": "response",
        "created_at": job.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": job.chat_job.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "store": False,
        "temperature": request.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": _tool_choice(request),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": response_usage(usage),
        "user": request.user,
        "metadata": request.metadata or {},
    }


def _tool_choice(request: ResponsesRequest) -> Any:
    if request.tool_choice is None:
        return "auto"
    if isinstance(request.tool_choice, NamedFunction):
        return request.tool_choice.model_dump()
    return request.tool_choice


async def complete(job: ResponsesJob) -> RootModel[dict[str, Any]]:
    """The whole Response, once the chat job has finished."""
    completion: ChatCompletion = await chat.complete(job.chat_job)
    choice = completion.choices[0]
    finished = choice.finish_reason != "length"
    message = choice.message.model_dump()
    return RootModel[dict[str, Any]](
        response_body(
            job,
            "completed" if finished else "incomplete",
            message_items(message, finished),
            completion.usage.model_dump(),
        )
    )


# ------------------------------------------------------------------------- stream


@dataclass
class _Open:
    """An output item a stream is writing: its kind, index, id and text so far."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""


class _EventWriter:
    """Turns chat stream chunks into Responses events, item by item."""

    def __init__(self, job: ResponsesJob) -> None:
        self.job = job
        self.output: list[dict[str, Any]] = []
        self.current: _Open | None = None
        self.calls: dict[int, _Open] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.job.sequence, **body}
        self.job.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self) -> list[bytes]:
        body = response_body(self.job, "in_progress", [], None)
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def chunk(self, payload: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk."""
        if payload.get("usage") and not payload.get("choices"):
            self.usage = payload["usage"]
            return []
        events: list[bytes] = []
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            events += self._text("reasoning", delta.get("reasoning_content"))
            events += self._text("message", delta.get("content"))
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[bytes]:
        """The last items' done events and the final response."""
        finished = self.finish_reason != "length"
        events = self._switch(None, finished)
        status = "completed" if finished else "incomplete"
        body = response_body(self.job, status, self.output, self.usage)
        return [*events, self.event(f"response.{status}", response=body)]

    def _switch(self, item: _Open | None, finished: bool = True) -> list[bytes]:
        """Closes the item being written (unless it is `item`) and makes `item` current."""
        events = []
        if self.current is not None and self.current is not item:
            events = self._close(self.current, finished)
        self.current = item
        return events

    def _text(self, kind: str, text: str | None) -> list[bytes]:
        if not text:
            return []
        events = []
        if self.current is None or self.current.kind != kind:
            prefix = "rs" if kind == "reasoning" else "msg"
            item = _Open(kind, 0, item_id(prefix))
            events += self._switch(item)
            item.index = len(self.output)
            if kind == "reasoning":
                added = {"type": "reasoning", "id": item.id, "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                added = {"type": "message", "id": item.id, "status": "in_progress",
                         "role": "assistant", "content": []}  # fmt: skip
                part = output_text("")
            events.append(
                self.event("response.output_item.added", output_index=item.index, item=added)
            )
            events.append(self.event("response.content_part.added", item_id=item.id,
                                     output_index=item.index, content_index=0, part=part))  # fmt: skip
        item = self.current
        assert item is not None
        item.text += text
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", item_id=item.id,
                                     output_index=item.index, content_index=0, delta=text))  # fmt: skip
        else:
            events.append(self.event("response.output_text.delta", item_id=item.id,
                                     output_index=item.index, content_index=0, delta=text,
                                     logprobs=[]))  # fmt: skip
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events = []
        item = self.calls.get(index)
        if item is None:
            item = _Open("function_call", 0, item_id("fc"), call_id=call.get("id") or item_id("call"),
                         name=function.get("name") or "")  # fmt: skip
            self.calls[index] = item
            events += self._switch(item)
            item.index = len(self.output)
            added = function_call_item(item.id, item.call_id, item.name, "", "in_progress")
            events.append(
                self.event("response.output_item.added", output_index=item.index, item=added)
            )
        else:
            events += self._switch(item)
        fragment = function.get("arguments") or ""
        if fragment:
            item.text += fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=item.index, delta=fragment))  # fmt: skip
        return events

    def _close(self, item: _Open, finished: bool) -> list[bytes]:
        events = []
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            done = reasoning_item(item.id, item.text)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item.text))  # fmt: skip
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part={"type": "reasoning_text", "text": item.text}))  # fmt: skip
        elif item.kind == "message":
            done = output_message(item.id, item.text, "completed" if finished else "incomplete")
            events.append(self.event("response.output_text.done", **where, content_index=0,
                                     text=item.text, logprobs=[]))  # fmt: skip
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=output_text(item.text)))  # fmt: skip
        else:
            done = function_call_item(item.id, item.call_id, item.name, item.text)
            events.append(
                self.event("response.function_call_arguments.done", **where, arguments=item.text)
            )
        self.output.append(done)
        events.append(self.event("response.output_item.done", output_index=item.index, item=done))
        return events


async def stream(job: ResponsesJob) -> AsyncIterator[bytes]:
    """The Responses events of the chat job's stream, ending with response.completed
    (or response.incomplete when max_output_tokens cut it short)."""
    writer = _EventWriter(job)
    for event in writer.start():
        yield event
    payloads = _chat_payloads(job)
    try:
        async for payload in payloads:
            if "error" in payload:
                error = payload["error"]
                yield writer.event("error", code=error.get("code"), message=error.get("message"),
                                   param=error.get("param"))  # fmt: skip
                return
            for event in writer.chunk(payload):
                yield event
    finally:
        await payloads.aclose()
    for event in writer.finish():
        yield event


async def _chat_payloads(job: ResponsesJob) -> AsyncIterator[dict[str, Any]]:
    """The JSON bodies of the chat job's server-sent events, up to `[DONE]`."""
    events = chat.stream(job.chat_job)
    try:
        async for raw in events:
            for line in raw.decode().split("\n"):
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return
                yield json.loads(data)
    finally:
        await events.aclose()  # closes the chat job's runs: aborts them unless finished
