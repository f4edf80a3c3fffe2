"""POST /v1/chat/completions: messages through the model's chat template, responses
whole or as server-sent events (the first chunk of each choice carries the role).

With a reasoning parser (`--reasoning-parser`), each choice's thinking goes to
`reasoning_content` (and `reasoning`) and only the answer to `content`, in the message
and in stream deltas (`pagedinfer.service.reasoning`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedinfer.service import prompts
from pagedinfer.service.openai.errors import bad_request
from pagedinfer.service.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    PromptLogprobs,
    TokenLogprob,
    ToolCall,
)
from pagedinfer.service.openai.serving import (
    AbortedError,
    PromptRun,
    ServingState,
    TokenText,
    chat_messages,
    chat_top,
    check_stop_token_ids,
    close_runs,
    encode,
    merged,
    new_id,
    prompt_logprobs_body,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_error,
    start_runs,
    usage,
)
from pagedinfer.service.openai.structured import constrained
from pagedinfer.service.openai.tools import ToolPlan, ToolStream, prepare_tools
from pagedinfer.service.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser, ReasoningStream
from pagedinfer.service.structured_output import Thinking

log = logging.getLogger("pagedinfer.http")


@dataclass
class ChatJob:
    """A checked chat request, queued on the engine."""

    id: str
    created: int
    model: str
    request: ChatCompletionRequest
    runs: list[PromptRun]
    token_text: TokenText
    reasoning: ReasoningParser | None = None
    prompt_tail: str = ""  # the prompt's last characters: does it open a thinking block?
    tools: ToolPlan | None = None

    def answer(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        """A choice's message, with its tool calls, and its finish reason."""
        reasoning, content = self.split(text)
        calls = []
        if self.tools is not None and self.tools.parses_calls:
            content, calls = self.tools.parse(content or "")
        message = assistant_message(reasoning, content)
        if calls:
            message.tool_calls = [ToolCall.model_validate(c.as_tool_call()) for c in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a choice's whole text."""
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, self.prompt_tail)

    def reasoning_streams(self) -> list[ReasoningStream] | None:
        if self.reasoning is None:
            return None
        return [self.reasoning.stream(self.prompt_tail) for _ in range(self.request.n)]

    def logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        content = []
        for entry in entries:
            token = self.token_text(entry["token_id"])
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=entry["logprob"],
                    bytes=list(token.encode()),
                    top_logprobs=chat_top(entry, self.token_text),
                )
            )
        return ChatLogprobs(content=content)


@dataclass
class _Choice:
    text: str = ""
    entries: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


def chat_prompt(
    state: ServingState, request: ChatCompletionRequest
) -> tuple[ToolPlan | None, list[int]]:
    """The request's tool plan and prompt token ids: its messages and tools through the
    chat template with its options; APIError naming the field the template refuses."""
    engine = state.ready_engine()
    options = chat_options(request)
    tools, messages, options = prepare_tools(
        request,
        chat_messages(request),
        options,
        engine,
        state.tool_call_parser,
        exclude_when_none=state.exclude_tools_when_none,
    )
    try:
        prompts.check_chat_options(options, messages)
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, message.split(":", 1)[0]) from None
    return tools, encode(engine, "messages", messages=messages, chat_options=options)


def start_chat(state: ServingState, request: ChatCompletionRequest) -> ChatJob:
    """Checks a chat request and queues it; APIError if it is refused."""
    engine = state.ready_engine()
    state.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    tools, prompt = chat_prompt(state, request)
    requested = request.max_completion_tokens
    field_name = "max_completion_tokens"
    if requested is None:
        requested, field_name = request.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(engine, len(prompt), requested, None, "messages", field_name)
    check_stop_token_ids(request, engine.vocab_size)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = constrained(
        engine, request, sampling_params(request, max_tokens, logprobs, request.prompt_logprobs)
    )
    if tools is not None and tools.output is not None:
        if params.use_beam_search:
            raise bad_request(
                "tool_choice required or a named function is not supported with use_beam_search",
                "tool_choice",
            )
        if params.structured_output is not None:
            raise bad_request(
                "tool_choice required or a named function cannot be combined with a "
                "structured output",
                "tool_choice",
            )
        params = dataclasses.replace(params, structured_output=tools.output)
    parser = state.reasoning_parser
    prompt_tail = ""
    if parser is not None:
        prompt_tail = engine.tokenizer.decode(
            prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False
        )
        where = parser.prompt_state(prompt_tail)
        if params.structured_output is not None and where != "closed":
            # The grammar constrains the answer; the thinking before it stays free.
            thinking = Thinking(parser.start, parser.end, open=where == "inside")
            output = dataclasses.replace(params.structured_output, thinking=thinking)
            params = dataclasses.replace(params, structured_output=output)
    state.check_queue(engine, 1)
    runs = start_runs(state, engine, [(prompt, params)], "chat", request.cache_salt)
    return ChatJob(
        id=new_id("chatcmpl"),
        created=int(time.time()),
        model=state.model_name,
        request=request,
        runs=runs,
        token_text=TokenText(engine.tokenizer),
        reasoning=parser,
        prompt_tail=prompt_tail,
        tools=tools,
    )


def chat_options(request: ChatCompletionRequest) -> prompts.ChatOptions:
    """How the request's messages are rendered by the chat template."""
    return prompts.ChatOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        template_kwargs=request.chat_template_kwargs or {},
    )


async def complete(job: ChatJob) -> ChatCompletion:
    """The whole response, once every choice has finished."""
    choices = [_Choice() for _ in range(job.request.n)]
    prompt_entries: list[dict] = []
    error = None
    try:
        async for _, delta in merged(job.runs):
            if delta.finish_reason == "abort":
                raise AbortedError("the server aborted the request")
            choice = choices[delta.index]
            choice.text += delta.text
            choice.entries.extend(delta.logprobs or ())
            if delta.prompt_logprobs is not None:
                prompt_entries = delta.prompt_logprobs
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
    except BaseException as exc:
        error = "cancelled" if not isinstance(exc, Exception) else type(exc).__name__
        raise
    finally:
        await close_runs(job.runs, error)
    answers = [job.answer(c.text, c.finish_reason) for c in choices]
    return ChatCompletion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=[
            ChatChoice(
                index=i,
                message=message,
                logprobs=job.logprobs(c.entries),
                finish_reason=finish_reason,
            )
            for i, (c, (message, finish_reason)) in enumerate(zip(choices, answers, strict=True))
        ],
        usage=usage(job.runs),
        prompt_logprobs=None
        if job.request.prompt_logprobs is None
        else prompt_logprobs_body(prompt_entries, job.request.prompt_logprobs, job.token_text),
    )


def assistant_message(reasoning: str | None, content: str | None) -> AssistantMessage:
    return AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)


def delta_of(reasoning: str, content: str) -> ChatDelta:
    """A stream delta with the new thinking and answer text (empty ones left out)."""
    return ChatDelta(
        content=content or None, reasoning_content=reasoning or None, reasoning=reasoning or None
    )


async def stream(job: ChatJob) -> AsyncIterator[bytes]:
    """Server-sent events: the role of each choice, its content piece by piece with the
    finish reason on the last, the usage chunk when asked for, then `data: [DONE]`. With
    prompt_logprobs, the roles wait for the engine's first output, and the first chunk
    carries the prompt's logprobs."""
    options = job.request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats

    def chunk(choice: ChatChunkChoice, prompt_logprobs: PromptLogprobs | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=job.id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=usage(job.runs) if continuous else None,
                prompt_logprobs=prompt_logprobs,
            )
        )

    def roles(prompt_logprobs: PromptLogprobs | None = None) -> list[bytes]:
        return [
            chunk(
                ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")),
                prompt_logprobs if i == 0 else None,
            )
            for i in range(job.request.n)
        ]

    error = None
    splitters = job.reasoning_streams()
    tool_streams: list[ToolStream] | None = None
    if job.tools is not None:
        tool_streams = [job.tools.stream() for _ in range(job.request.n)]
    # The prompt's logprobs come with the engine's first output (its prefill's).
    scoring = job.request.prompt_logprobs
    try:
        for role in roles() if scoring is None else ():
            yield role
        async for _, delta in merged(job.runs):
            if delta.finish_reason == "abort":
                error = "aborted"
                yield sse_error(503, "the server aborted the request")
                return
            if scoring is not None:
                entries = delta.prompt_logprobs or []
                for role in roles(prompt_logprobs_body(entries, scoring, job.token_text)):
                    yield role
                scoring = None
            entries = delta.logprobs or []
            if splitters is None:
                new = ChatDelta(content=delta.text or None)
            else:
                splitter = splitters[delta.index]
                reasoning, content = splitter.feed(delta.text)
                if delta.finish_reason is not None:
                    rest = splitter.finish()
                    reasoning, content = reasoning + rest[0], content + rest[1]
                new = delta_of(reasoning, content)
            finish_reason = delta.finish_reason
            if tool_streams is not None:
                calls = tool_streams[delta.index]
                content, tool_deltas = calls.feed(new.content or "")
                if finish_reason is not None:
                    rest, more = calls.finish()
                    content, tool_deltas = content + rest, tool_deltas + more
                    if calls.sent_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
                new.content, new.tool_calls = content or None, tool_deltas or None
            if (new.content, new.reasoning, new.tool_calls, entries, finish_reason) == (
                None,
                None,
                None,
                [],
                None,
            ):
                continue  # held back for now: a stop string or a tag may be forming
            # One tool-call delta per chunk, after any text, as OpenAI streams them.
            parts = [new]
            if new.tool_calls and len(new.tool_calls) + bool(new.content or new.reasoning) > 1:
                calls, new.tool_calls = new.tool_calls, None
                parts = [new] if new.content or new.reasoning else []
                parts += [ChatDelta(tool_calls=[call]) for call in calls]
            for part in parts[:-1]:
                yield chunk(ChatChunkChoice(index=delta.index, delta=part))
            yield chunk(
                ChatChunkChoice(
                    index=delta.index,
                    delta=parts[-1],
                    logprobs=job.logprobs(entries) if entries else None,
                    finish_reason=finish_reason,
                )
            )
        if include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=job.id,
                    created=job.created,
                    model=job.model,
                    choices=[],
                    usage=usage(job.runs),
                )
            )
        yield b"data: [DONE]\n\n"
    except BaseException as exc:
        error = "cancelled" if not isinstance(exc, Exception) else type(exc).__name__
        if isinstance(exc, Exception):
            log.exception("streamed chat completion failed", extra={"id": job.id})
        raise
    finally:
        await close_runs(job.runs, error)
