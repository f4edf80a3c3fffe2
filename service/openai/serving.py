"""What completions and chat share: the serving state, request checks, engine runs
and the formatting of tokens and logprobs.

The HTTP API runs over the same `AsyncLLMEngine` as the gRPC server, in the same event
loop; `ServingState` is what the two share (the engine once loaded, the telemetry, the
queue limit, whether the server is draining).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from pagedinfer.service.openai.errors import APIError, bad_request
from pagedinfer.service.openai.protocol import (
    ChatCompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    TopLogprob,
    Usage,
)
from pagedinfer.service.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.service.async_engine import AsyncLLMEngine
    from pagedinfer.service.metrics import RequestTelemetry, Telemetry
    from pagedinfer.service.outputs import CompletionDelta
    from pagedinfer.service.reasoning import ReasoningParser

log = logging.getLogger("pagedinfer.http")


@dataclass
class ServingState:
    """The server's state as the HTTP API sees it.

    `engine` is None until the model is loaded and warmed up; `draining` turns True on
    SIGTERM. Each generation request still answering is registered with a callback that
    cuts it short, so that a drain can wait for them and, at its deadline, end them.
    """

    max_queue: int
    telemetry: Telemetry | None = None
    engine: AsyncLLMEngine | None = None
    served_model_names: list[str] = field(default_factory=list)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # --tool-call-parser; None: from the chat template
    exclude_tools_when_none: bool = False  # --exclude-tools-when-tool-choice-none
    _answering: set[Callable[[], None]] = field(default_factory=set)
    _idle: asyncio.Event | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else ""

    def ready_engine(self) -> AsyncLLMEngine:
        """The engine, or a 503 while the model loads or the server drains."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="unavailable")
        if self.engine is None:
            raise APIError(
                503, "the model is still loading", code="unavailable", headers={"Retry-After": "5"}
            )
        return self.engine

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve; no name means the default one."""
        if name is not None and name not in self.served_model_names:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves "
                + ", ".join(f"'{n}'" for n in self.served_model_names),
                param="model",
                code="model_not_found",
            )

    def check_queue(self, engine: AsyncLLMEngine, count: int) -> None:
        """429 when `count` more requests would overfill the waiting queue."""
        if count > self.max_queue > 0:
            raise bad_request(
                f"prompt holds {count} prompts, more than the server queues at once "
                f"({self.max_queue})",
                param="prompt",
            )
        if engine.num_waiting + count > self.max_queue:
            raise APIError(
                429,
                f"the waiting queue is full ({self.max_queue} requests); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    @property
    def in_flight(self) -> int:
        return len(self._answering)

    def enter(self, cut: Callable[[], None]) -> None:
        """A generation request starts answering; `cut` ends it early."""
        self._answering.add(cut)
        if self._idle is not None:
            self._idle.clear()

    def leave(self, cut: Callable[[], None]) -> None:
        self._answering.discard(cut)
        if not self._answering and self._idle is not None:
            self._idle.set()

    def cut_all(self) -> None:
        """Ends every answer still running (each with a 503 error): the drain's deadline."""
        for cut in list(self._answering):
            cut()

    async def wait_idle(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for in-flight requests; True if none is left."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------- request checks


def sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's SamplingParams of a request whose fields pydantic has checked."""
    refuse_unsupported(request)
    kwargs: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = value
    if request.use_beam_search:
        kwargs.setdefault("temperature", 0.0)  # deterministic; vLLM's default too
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=request.stop or [],
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            n=request.n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=request.logit_bias or {},
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            use_beam_search=request.use_beam_search,
            best_of=request.best_of,
            length_penalty=request.length_penalty,
            early_stopping=request.early_stopping,
            **kwargs,
        )
    except ValueError as exc:  # the messages start with the field's name
        message = str(exc)
        raise bad_request(message, param=message.split(" ", 1)[0]) from None


def refuse_unsupported(request: SamplingFields) -> None:
    """400 for fields accepted for compatibility whose value asks for what is not served."""
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if request.use_beam_search and request.stream:
        # The beams that lead change until the search ends: there is nothing to stream.
        raise bad_request("stream is not supported with use_beam_search", "stream")


def check_stop_token_ids(request: SamplingFields, vocab_size: int) -> None:
    """400 for stop_token_ids or logit_bias keys outside the vocabulary."""
    for name, ids in (
        ("stop_token_ids", request.stop_token_ids or ()),
        ("logit_bias", sorted(request.logit_bias or ())),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise bad_request(
                f"{name} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", name
            )


def context_capacity(engine: AsyncLLMEngine) -> int:
    """The longest prompt plus output one request can have: max_model_len, or less when
    the whole KV cache holds fewer tokens (the last token needs no slot)."""
    return min(engine.max_model_len, engine.num_blocks * engine.block_size + 1)


def resolve_max_tokens(
    engine: AsyncLLMEngine,
    prompt_tokens: int,
    requested: int | None,
    default: int | None,
    prompt_field: str,
    max_field: str = "max_tokens",
) -> int:
    """The max_tokens to run with; 400 naming the field when prompt and output cannot fit.

    requested: what the client asked for (None: not given). default: the value when
    not given; None means as many as fit.
    """
    max_len = engine.max_model_len
    room = context_capacity(engine) - prompt_tokens
    if prompt_tokens >= max_len or room < 1:
        raise bad_request(
            f"the prompt is {prompt_tokens} tokens: with at least one output token that "
            f"exceeds this server's context of {min(max_len, context_capacity(engine))} tokens "
            f"(max_model_len {max_len})",
            prompt_field,
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > max_len:
        raise bad_request(f"{max_field} ({requested}) exceeds max_model_len ({max_len})", max_field)
    if prompt_tokens + requested > max_len:
        raise bad_request(
            f"prompt ({prompt_tokens} tokens) + {max_field} ({requested}) = "
            f"{prompt_tokens + requested} exceeds max_model_len ({max_len}); lower {max_field} "
            "or shorten the prompt",
            max_field,
        )
    return requested


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param
        )


def encode(engine: AsyncLLMEngine, param: str, **prompt: Any) -> list[int]:
    try:
        ids = engine.encode_prompt(**prompt)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
    if not ids:
        raise bad_request(f"{param} encodes to no tokens", param)
    return ids


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text content, OpenAI's `developer`
    role as `system`."""
    messages = []
    for m in request.messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


# -------------------------------------------------------------------- engine runs


@dataclass
class PromptRun:
    """One engine request of an HTTP request (one per prompt): its stream, telemetry
    and usage."""

    stream: Any
    trace: RequestTelemetry | None
    prompt_token_ids: list[int]
    n: int
    cached_tokens: int = 0
    completion_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    async def deltas(self) -> AsyncIterator[CompletionDelta]:
        async for delta in self.stream:
            if self.trace is not None:
                self.trace.on_delta(
                    delta.index,
                    len(delta.token_ids),
                    delta.completion_tokens,
                    delta.cached_tokens,
                    delta.finish_reason,
                    queue_time=delta.queue_time,
                )
            self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
            self.completion_tokens[delta.index] = delta.completion_tokens
            if delta.finish_reason is not None:
                self.finish_reasons[delta.index] = delta.finish_reason
            yield delta

    async def close(self, error: str | None) -> None:
        await self.stream.aclose()  # aborts the request (frees its blocks) unless finished
        if self.trace is not None:
            self.trace.end(error)
        log.info(
            "request done",
            extra={
                "request_id": self.stream.request_id,
                "api": "http",
                "prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": sum(self.completion_tokens.values()),
                "finish_reasons": [self.finish_reasons.get(i) for i in range(self.n)],
                "error": error,
            },
        )


def start_runs(
    state: ServingState,
    engine: AsyncLLMEngine,
    prompts: Sequence[tuple[list[int], SamplingParams]],
    operation: str,
    cache_salt: str | None,
) -> list[PromptRun]:
    """Queues one engine request per prompt; 400 (and nothing queued) if one is refused."""
    runs: list[PromptRun] = []
    try:
        for ids, params in prompts:
            stream = engine.add_request(ids, params, cache_salt=cache_salt)
            trace = None
            if state.telemetry is not None:
                trace = state.telemetry.start_request(
                    request_id=stream.request_id, operation=operation, model=state.model_name
                )
                trace.queued(len(ids), params.n)
            runs.append(PromptRun(stream, trace, ids, params.n))
    except ValueError as exc:
        for run in runs:
            engine.abort(run.stream.request_id)
            if run.trace is not None:
                run.trace.end("refused")
        raise bad_request(_engine_message(str(exc))) from None
    return runs


def _engine_message(message: str) -> str:
    """The engine prefixes its refusals with the request id, which the client never saw."""
    if message.startswith("request ") and ": " in message:
        return message.split(": ", 1)[1]
    return message


async def merged(runs: Sequence[PromptRun]) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """(prompt index, delta) from every run, as they arrive."""
    if len(runs) == 1:
        async for delta in runs[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, run: PromptRun) -> None:
        try:
            async for delta in run.deltas():
                queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_runs(runs: Sequence[PromptRun], error: str | None) -> None:
    for run in runs:
        await run.close(error)


def usage(runs: Sequence[PromptRun], hidden_tokens: int = 0) -> Usage:
    """Usage over all prompts: each prompt counted once, every sample's output.

    hidden_tokens: output tokens per sample the client does not see (echo with
    max_tokens 0 runs one token and drops it).
    """
    prompt_tokens = sum(len(r.prompt_token_ids) for r in runs)
    completion_tokens = sum(
        max(c - hidden_tokens, 0) for r in runs for c in r.completion_tokens.values()
    )
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": sum(r.cached_tokens for r in runs)},
    )


def sse(body: BaseModel) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def sse_error(status: int, message: str) -> bytes:
    """An error inside a stream that has already answered 200 (as vLLM sends it)."""
    return b"data: " + json.dumps(APIError(status, message).body()).encode() + b"\n\n"


class AbortedError(Exception):
    """The engine aborted a request the client did not cancel (an engine failure)."""


# ------------------------------------------------------------ tokens and logprobs


class TokenText:
    """Each token's own text, as logprobs show it (special tokens by name), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def top_dict(entry: dict, token_text: TokenText) -> dict[str, float]:
    """Completions' top_logprobs entry: the k most likely tokens and the chosen one."""
    top = {token_text(entry["token_id"]): entry["logprob"]}
    for token_id, logprob in entry.get("top") or ():
        text = token_text(token_id)
        if text not in top or logprob > top[text]:
            top[text] = logprob
    return top


def prompt_logprobs_body(entries: list[dict], k: int, token_text: TokenText) -> PromptLogprobs:
    """vLLM's prompt_logprobs of a prompt: None for its first token, then each token's
    entry (logprob, rank, text) and its k likeliest, keyed by token id."""
    out: PromptLogprobs = [None]
    for entry in entries:
        token_id = entry["token_id"]
        tokens = {
            str(token_id): PromptLogprob(
                logprob=entry["logprob"], rank=entry.get("rank"), decoded_token=token_text(token_id)
            )
        }
        for rank, (top_id, logprob) in enumerate((entry.get("top") or ())[:k], 1):
            tokens.setdefault(
                str(top_id),
                PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_text(top_id)),
            )
        out.append(tokens)
    return out


def chat_top(entry: dict, token_text: TokenText) -> list[TopLogprob]:
    return [
        TopLogprob(token=(t := token_text(token_id)), logprob=lp, bytes=list(t.encode()))
        for token_id, lp in entry.get("top") or ()
    ]
