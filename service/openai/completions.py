"""POST /v1/completions: prompts in OpenAI's four forms, `echo` with prompt logprobs,
responses whole or as server-sent events."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedinfer.service.openai.errors import bad_request
from pagedinfer.service.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from pagedinfer.service.openai.serving import (
    AbortedError,
    PromptRun,
    ServingState,
    TokenText,
    check_stop_token_ids,
    check_token_ids,
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
    top_dict,
    usage,
)
from pagedinfer.service.openai.structured import constrained

log = logging.getLogger("pagedinfer.http")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # what echo returns: the prompt as given, or its token ids decoded


@dataclass
class _Choice:
    text: str = ""
    entries: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class CompletionJob:
    """A checked completion request, queued on the engine."""

    id: str
    created: int
    model: str
    request: CompletionRequest
    prompts: list[Prompt]
    runs: list[PromptRun]
    token_text: TokenText
    hidden_tokens: int  # 1 when echo with max_tokens 0 runs one token it does not return

    @property
    def logprobs(self) -> int | None:
        return self.request.logprobs


def start_completion(state: ServingState, request: CompletionRequest) -> CompletionJob:
    """Checks a completion request and queues its prompts; APIError if it is refused."""
    engine = state.ready_engine()
    state.check_model(request.model)
    if request.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    prompts = parse_prompts(engine, request.prompt)
    requested = request.max_tokens
    if requested is None:
        requested = request.max_completion_tokens
    hidden = 0
    if requested == 0:
        if not request.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        requested, hidden = 1, 1
    check_stop_token_ids(request, engine.vocab_size)
    prompt_logprobs = request.logprobs if request.echo else None
    if request.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, request.prompt_logprobs)
    base = constrained(
        engine, request, sampling_params(request, 1, request.logprobs, prompt_logprobs)
    )
    params = [
        dataclasses.replace(
            base,
            max_tokens=resolve_max_tokens(
                engine, len(p.token_ids), requested, DEFAULT_MAX_TOKENS, "prompt"
            ),
        )
        for p in prompts
    ]
    state.check_queue(engine, len(prompts))
    runs = start_runs(
        state,
        engine,
        [(p.token_ids, sp) for p, sp in zip(prompts, params, strict=True)],
        "text_completion",
        request.cache_salt,
    )
    return CompletionJob(
        id=new_id("cmpl"),
        created=int(time.time()),
        model=state.model_name,
        request=request,
        prompts=prompts,
        runs=runs,
        token_text=TokenText(engine.tokenizer),
        hidden_tokens=hidden,
    )


def parse_prompts(engine, prompt: str | list) -> list[Prompt]:
    """Token ids and echo text of every prompt; 400 naming the prompt at fault."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items, single = [prompt], True
    else:
        items, single = list(prompt), False
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if single else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{param} must not be empty", param)
            prompts.append(Prompt(encode(engine, param, prompt=item), item))
        else:
            check_token_ids(item, engine.vocab_size, param)
            ids = encode(engine, param, prompt_token_ids=item)
            prompts.append(Prompt(ids, engine.tokenizer.decode(ids, skip_special_tokens=False)))
    return prompts


def completion_logprobs(
    job: CompletionJob,
    entries: list[dict],
    offset: int,
    prompt: Prompt | None = None,
    prompt_entries: list[dict] | None = None,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of `entries` (and of the prompt's tokens when echoed:
    the first has no logprob, nothing predicts it); offsets start at `offset`."""
    out = CompletionLogprobs()
    if prompt is not None:
        by_position = [None, *(prompt_entries or [])]
        for token_id, entry in zip(prompt.token_ids, by_position, strict=False):
            out.tokens.append(job.token_text(token_id))
            out.token_logprobs.append(None if entry is None else entry["logprob"])
            out.top_logprobs.append(None if entry is None else top_dict(entry, job.token_text))
    for entry in entries:
        out.tokens.append(job.token_text(entry["token_id"]))
        out.token_logprobs.append(entry["logprob"])
        out.top_logprobs.append(top_dict(entry, job.token_text))
    for token in out.tokens:
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def complete(job: CompletionJob) -> Completion:
    """The whole response, once every sample of every prompt has finished."""
    n = job.request.n
    choices = [_Choice() for _ in range(len(job.prompts) * n)]
    prompt_entries: dict[int, list[dict]] = {}
    error = None
    try:
        async for p, delta in merged(job.runs):
            if delta.finish_reason == "abort":
                raise AbortedError("the server aborted the request")
            choice = choices[p * n + delta.index]
            choice.text += delta.text
            choice.entries.extend(delta.logprobs or ())
            if delta.prompt_logprobs is not None:
                prompt_entries[p] = delta.prompt_logprobs
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
    except BaseException as exc:
        error = "cancelled" if not isinstance(exc, Exception) else type(exc).__name__
        raise
    finally:
        await close_runs(job.runs, error)
    out = []
    for i, choice in enumerate(choices):
        prompt = job.prompts[i // n]
        text = choice.text if not job.hidden_tokens else ""
        entries = choice.entries if not job.hidden_tokens else []
        logprobs = None
        if job.logprobs is not None:
            echoed = prompt if job.request.echo else None
            logprobs = completion_logprobs(job, entries, 0, echoed, prompt_entries.get(i // n))
        if job.request.echo:
            text = prompt.text + text
        scored = None
        if job.request.prompt_logprobs is not None:
            scored = prompt_logprobs_body(
                prompt_entries.get(i // n, []), job.request.prompt_logprobs, job.token_text
            )
        out.append(
            CompletionChoice(
                index=i,
                text=text,
                logprobs=logprobs,
                finish_reason=choice.finish_reason,
                prompt_logprobs=scored,
            )
        )
    return Completion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=out,
        usage=usage(job.runs, job.hidden_tokens),
    )


async def stream(job: CompletionJob) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per piece of text, the usage chunk when asked for,
    then `data: [DONE]`. With prompt_logprobs, each choice's first chunk carries its
    prompt's."""
    n = job.request.n
    options = job.request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    started: set[int] = set()
    offsets: dict[int, int] = {}
    prompt_entries: dict[int, list[dict]] = {}  # by prompt, once the engine scored it
    scored: set[int] = set()  # choices whose chunk carried them
    error = None
    try:
        async for p, delta in merged(job.runs):
            if delta.finish_reason == "abort":
                error = "aborted"
                yield sse_error(503, "the server aborted the request")
                return
            index = p * n + delta.index
            if delta.prompt_logprobs is not None:
                prompt_entries[p] = delta.prompt_logprobs
            text, entries = delta.text, delta.logprobs or []
            if job.hidden_tokens:
                text, entries = "", []
            prompt = None
            if job.request.echo and index not in started:
                prompt = job.prompts[p]
                text = prompt.text + text
            started.add(index)
            if not text and not entries and prompt is None and delta.finish_reason is None:
                continue  # the engine holds these characters back for now
            logprobs = None
            if job.logprobs is not None:
                offset = offsets.get(index, 0)
                logprobs = completion_logprobs(job, entries, offset, prompt, delta.prompt_logprobs)
                offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
            prompt_logprobs = None
            k = job.request.prompt_logprobs
            if k is not None and index not in scored and p in prompt_entries:
                prompt_logprobs = prompt_logprobs_body(prompt_entries[p], k, job.token_text)
                scored.add(index)
            chunk = Completion(
                id=job.id,
                created=job.created,
                model=job.model,
                choices=[
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                ],
                usage=usage(job.runs, job.hidden_tokens) if continuous else None,
            )
            yield sse(chunk)
        if include_usage:
            yield sse(
                Completion(
                    id=job.id,
                    created=job.created,
                    model=job.model,
                    choices=[],
                    usage=usage(job.runs, job.hidden_tokens),
                )
            )
        yield b"data: [DONE]\n\n"
    except BaseException as exc:
        error = "cancelled" if not isinstance(exc, Exception) else type(exc).__name__
        if isinstance(exc, Exception):
            log.exception("streamed completion failed", extra={"id": job.id})
        raise
    finally:
        await close_runs(job.runs, error)
