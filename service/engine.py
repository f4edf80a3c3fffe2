"""The engine: scheduler -> model runner -> sampler -> stop checks -> streamed deltas.

`LLMEngine` is synchronous (add_request, step, abort). `AsyncLLMEngine` runs it in one
background loop, stepping in a worker thread so the event loop stays responsive, and
hands each request an async stream. `LLM` is the offline API of DESIGN.md section 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagedinfer.kernels import torch_ops
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.detokenizer import IncrementalDetokenizer
from pagedinfer.service.loader import load_model
from pagedinfer.service.model_runner import ModelOutput, ModelRunner
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    is_greedy,
    make_generator,
)
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler, SchedulerStats
from pagedinfer.service.stop_checker import StopChecker
from pagedinfer.service.threads import configure_cpu_threads

log = logging.getLogger(__name__)

EngineStats = SchedulerStats
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class CompletionDelta:
    """One streamed piece of one sample of a request."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class _Sample:
    """Per-sample state the scheduler does not need: RNG, text, stop tracking."""

    request: Request
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    text: str = ""  # everything detokenized so far
    emitted: int = 0  # characters of `text` already streamed


@dataclass
class _Group:
    """One user request: its n samples share the prompt (and its blocks, after forking)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    cache_salt: str | None
    samples: dict[int, _Sample] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if device.type != "cpu":
        return torch.bfloat16 if config.dtype == "auto" else getattr(torch, config.dtype)
    # bf16 matmuls are hundreds of times slower than fp32 on CPUs without native bf16,
    # and several times faster on those with AMX: fp32 stays the default (exact against
    # the fp32 reference), with a hint where bf16 would pay.
    native = torch_ops.native_bf16()
    if config.dtype == "auto":
        if native:
            log.info("this CPU has native bf16 matmul: --dtype bfloat16 serves faster than fp32")
        return torch.float32
    if config.dtype == "bfloat16" and not native:
        log.warning("this CPU has no native bf16 matmul: bfloat16 runs far slower than float32")
    return getattr(torch, config.dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config)
        if self.device.type == "cpu":
            configure_cpu_threads(config.num_threads)
        dtype = resolve_dtype(config, self.device)
        loaded = load_model(config.model, self.device, dtype, max_model_len=config.max_model_len)
        self.config = config
        self.model_config = loaded.config
        self.model_name = loaded.config.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        self.runner = ModelRunner(config, loaded, self.device)
        self.scheduler = Scheduler(config, self.runner.num_blocks)
        self.sampler = Sampler()
        self._groups: dict[str, _Group] = {}
        self._owner: dict[str, str] = {}  # sample request id -> group id

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    # -- input ---------------------------------------------------------------------------

    def encode_prompt(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
    ) -> list[int]:
        """Token ids for exactly one of: text, token ids, or chat messages."""
        given = [
            n
            for n, v in (
                ("prompt", prompt),
                ("prompt_token_ids", prompt_token_ids),
                ("messages", messages),
            )
            if v
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt, prompt_token_ids, messages"
                + (f" (got {', '.join(given)})" if given else " (all are empty)")
            )
        if prompt:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if messages:
            return self._encode_chat(messages)
        ids = list(prompt_token_ids)
        self._check_vocabulary(ids)
        return ids

    def _check_vocabulary(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids holds ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]}"
            )

    def _encode_chat(self, messages: Sequence[dict]) -> list[int]:
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                    f"got {m.get('role')!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """A validated request: ValueError naming the problem if it could never run."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        max_len = self.config.max_model_len
        if params.max_tokens > max_len:
            raise ValueError(f"max_tokens ({params.max_tokens}) exceeds max_model_len ({max_len})")
        self._check_vocabulary(prompt_token_ids)
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
        )
        self.scheduler.check_fits(request)
        return request

    def add_request(
        self,
        prompt_token_ids: list[int] | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (token ids and params, or one made by `make_request`)."""
        if isinstance(prompt_token_ids, Request):
            request = prompt_token_ids
        else:
            request = self.make_request(
                prompt_token_ids, params, request_id, cache_salt, arrival_time
            )
        request_id, params = request.request_id, request.sampling_params
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = _Group(request_id, params, request.prompt_token_ids, request.cache_salt)
        self.scheduler.add_request(request)
        group.samples[0] = self._new_sample(request, group, 0)
        self._groups[request_id] = group
        self._owner[request_id] = request_id
        return request_id

    def _new_sample(self, request: Request, group: _Group, index: int) -> _Sample:
        return _Sample(
            request=request,
            generator=make_generator(group.params.seed, index),
            detokenizer=IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids),
            stop=StopChecker(group.params, self.eos_token_ids),
        )

    def abort(self, request_id: str) -> list[CompletionDelta]:
        """Abort every unfinished sample of a request; idempotent."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        deltas = []
        for index, sample in group.samples.items():
            if index not in group.finished:
                self.scheduler.finish_request(
                    sample.request.request_id, RequestStatus.FINISHED_ABORTED
                )
                deltas.append(self._finish(group, index, "abort", [], None))
        # Samples not forked yet never will be: report them aborted too.
        for index in range(len(group.samples), group.params.n):
            deltas.append(
                CompletionDelta(
                    request_id, index, [], "", None, "abort", len(group.prompt_token_ids), 0, 0
                )
            )
        self._forget_if_done(group, force=True)
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        model_out = self.runner.execute(out)
        drafts = {s.request.request_id: s.draft_token_ids for s in out.scheduled}
        rows, owners = [], []  # owners: (logits row, request, group, sample index)
        first_row = 0
        for req, num_rows in zip(model_out.requests, model_out.num_rows, strict=True):
            group = self._groups[self._owner[req.request_id]]
            first_of_forking = group.params.n > 1 and req.num_output_tokens == 0
            indices = range(group.params.n) if first_of_forking else [req.index]
            draft = drafts[req.request_id]
            for index in indices:
                sample = group.samples.get(index)
                generator = sample.generator if sample else make_generator(group.params.seed, index)
                # Row j of a draft's rows follows draft[:j]: the penalties see it.
                for j in range(num_rows):
                    outputs = req.output_token_ids + draft[:j] if j else req.output_token_ids
                    rows.append(
                        SamplingRow(group.params, group.prompt_token_ids, outputs, generator)
                    )
                    owners.append((first_row + j, req, group, index))
            first_row += num_rows
        logits, tokens = model_out.logits, model_out.tokens
        if len(owners) != logits.shape[0]:  # forking rows are sampled n times
            index = [i for i, *_ in owners]
            logits = logits[index]
            tokens = None if tokens is None else tokens[index]
        states = self._generator_states(model_out)
        results = self.sampler(logits, rows, tokens)

        # Per sample: its tokens (a draft's kept tokens and one more) and their results.
        picked: dict[tuple[str, int], tuple[Request, _Group, list[SampleResult]]] = {}
        for (_, req, group, index), result in zip(owners, results, strict=True):
            picked.setdefault((req.request_id, index), (req, group, []))[2].append(result)
        sampled: dict[str, list[int]] = {}
        children: list[tuple[Request, _Group, int, int]] = []
        emitted = []
        for (request_id, index), (req, group, kept) in picked.items():
            draft = drafts[request_id]
            n = 0
            while n < len(draft) and kept[n].token_id == draft[n]:
                n += 1
            del kept[n + 1 :]
            if request_id in states:  # one draw per kept token, as without a draft
                self._replay_draws(states[request_id], len(kept))
            if index == req.index:
                sampled[request_id] = [r.token_id for r in kept]
                emitted.append((group, index, kept))
            else:
                children.append((req, group, index, kept))
        self.scheduler.update_from_output(out, sampled)
        for parent, group, index, kept in children:
            self._fork(parent, group, index, kept[0].token_id)
            emitted.append((group, index, kept))
        return [self._emit(group, index, kept) for group, index, kept in emitted]

    def _generator_states(
        self, model_out: ModelOutput
    ) -> dict[str, tuple[torch.Generator, torch.Tensor]]:
        """The state of each seeded generator that draws for a draft's rows: the rows
        past the first rejected one drew too, and the stream is rewound to skip them."""
        states = {}
        for req, num_rows in zip(model_out.requests, model_out.num_rows, strict=True):
            if num_rows == 1:
                continue
            group = self._groups[self._owner[req.request_id]]
            sample = group.samples.get(req.index)
            if sample and sample.generator and not is_greedy(group.params):
                states[req.request_id] = (sample.generator, sample.generator.get_state())
        return states

    @staticmethod
    def _replay_draws(state: tuple[torch.Generator, torch.Tensor], draws: int) -> None:
        generator, saved = state
        generator.set_state(saved)
        for _ in range(draws):  # as the sampler draws: one number per row
            torch.rand(1, generator=generator, device=generator.device)

    def _fork(self, parent: Request, group: _Group, index: int, token: int) -> None:
        child = Request(
            request_id=f"{group.request_id}#{index}",
            prompt_token_ids=group.prompt_token_ids,
            sampling_params=group.params,
            arrival_time=parent.arrival_time,
            cache_salt=group.cache_salt,
        )
        child.parent_id, child.index = parent.request_id, index
        child.append_output_token(token)
        # The scheduler copies the parent's progress, or finishes a child already at
        # max_tokens.
        self.scheduler.fork_request(parent, child)
        group.samples[index] = self._new_sample(child, group, index)
        self._owner[child.request_id] = group.request_id

    def _emit(self, group: _Group, index: int, kept: list[SampleResult]) -> CompletionDelta:
        """Detokenize and stop-check a sample's new tokens (already appended to its
        request), in order; tokens past a stop are dropped from the request."""
        sample = group.samples[index]
        req, params = sample.request, group.params
        tokens = [r.token_id for r in kept]
        logprobs = [] if params.logprobs is not None else None
        reason = None
        for n, result in enumerate(kept):
            last = n == len(kept) - 1
            new_text = sample.detokenizer.add_token(result.token_id)
            if last and req.status.is_finished:  # release any held partial character
                new_text += sample.detokenizer.flush()
            sample.text += new_text
            reason, sample.text = sample.stop.check(result.token_id, sample.text, len(new_text))
            if logprobs is not None:
                logprobs.append(
                    {
                        "token_id": result.token_id,
                        "logprob": result.logprob,
                        "top": result.top_logprobs or [],
                    }
                )
            if reason is not None:
                req.truncate_output(req.num_output_tokens - (len(kept) - 1 - n))
                tokens = tokens[: n + 1]
                break
        if reason is None and req.status.is_finished:
            reason = req.status.finish_reason
        elif reason == "stop" and req.status is RequestStatus.FINISHED_LENGTH:
            req.status = RequestStatus.FINISHED_STOPPED  # the stop came first: it is the reason
        if reason is None:
            # Hold back a tail that may still grow into a stop string.
            ready = len(sample.text) - sample.stop.hold_back
            text = sample.text[sample.emitted : max(ready, sample.emitted)]
            sample.emitted += len(text)
            return self._delta(group, index, tokens, text, logprobs, None)
        status = (
            RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
        )
        self.scheduler.finish_request(req.request_id, status)
        delta = self._finish(group, index, reason, tokens, logprobs)
        self._forget_if_done(group)
        return delta

    def _finish(self, group, index, reason, token_ids, logprobs) -> CompletionDelta:
        sample = group.samples[index]
        text = sample.text[sample.emitted :]
        sample.emitted = len(sample.text)
        group.finished.add(index)
        return self._delta(group, index, token_ids, text, logprobs, reason)

    def _delta(self, group, index, token_ids, text, logprobs, reason) -> CompletionDelta:
        req = group.samples[index].request
        return CompletionDelta(
            request_id=group.request_id,
            index=index,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=reason,
            prompt_tokens=len(group.prompt_token_ids),
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens,
        )

    def _forget_if_done(self, group: _Group, force: bool = False) -> None:
        if force or len(group.finished) == group.params.n:
            for sample in group.samples.values():
                self._owner.pop(sample.request.request_id, None)
            self._groups.pop(group.request_id, None)


class RequestStream:
    """Async iterator over the deltas of one request; closing or cancelling aborts it."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, n: int):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[CompletionDelta] = asyncio.Queue()
        self._open = n  # samples the consumer has not seen finish
        self._unfinished = set(range(n))  # samples the engine has not finished (loop side)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> CompletionDelta:
        if self._open == 0:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            self._engine.abort(self.request_id)
            raise
        if delta.finish_reason is not None:
            self._open -= 1
        return delta

    async def aclose(self) -> None:
        if self._open:
            self._engine.abort(self.request_id)
            self._open = 0


class AsyncLLMEngine:
    """One background loop over `LLMEngine`; every request gets an async stream."""

    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.model_name = self.engine.model_name
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.num_blocks = self.engine.num_blocks
        self.vocab_size = self.engine.vocab_size
        self._streams: dict[str, RequestStream] = {}
        self._pending: deque[tuple[str, tuple]] = deque()
        self._lock = (
            threading.Lock()
        )  # guards _pending; the engine itself is stepped only by the worker
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._stats = self.engine.stats()

    def encode_prompt(self, **kwargs) -> list[int]:
        return self.engine.encode_prompt(**kwargs)

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + sum(
            1 for op, _ in list(self._pending) if op == "add"
        )

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def shutdown(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def warmup(self) -> None:
        stream = self.add_request([0, 1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        async for delta in stream:
            if delta.finish_reason == "abort":
                raise RuntimeError("warmup request was aborted: the engine cannot step")

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Validation reads only immutable engine state: safe beside a running step.
        request = self.engine.make_request(prompt_token_ids, params, request_id, cache_salt)
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = stream
        self._submit("add", (request,))
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._submit("abort", (request_id,))

    def _submit(self, op: str, args: tuple) -> None:
        with self._lock:
            self._pending.append((op, args))
        if self._wake is not None:
            self._wake.set()

    def _step(self) -> list[CompletionDelta]:
        """Runs in the worker thread: apply queued adds and aborts, then one step."""
        with self._lock:
            ops = list(self._pending)
            self._pending.clear()
        deltas: list[CompletionDelta] = []
        for op, args in ops:
            if op == "add":
                try:
                    self.engine.add_request(*args)
                except ValueError as exc:  # validated already; a race is reported, not raised
                    request = args[0]
                    log.warning("request %s refused: %s", request.request_id, exc)
                    deltas.extend(
                        CompletionDelta(request.request_id, i, [], "", None, "abort", 0, 0, 0)
                        for i in range(request.sampling_params.n)
                    )
            else:
                deltas.extend(self.engine.abort(*args))
        if self.engine.has_unfinished():
            deltas.extend(self.engine.step())
        self._stats = self.engine.stats()
        return deltas

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            try:
                deltas = await loop.run_in_executor(self._executor, self._step)
            except Exception:
                log.exception("engine step failed; aborting all requests")
                for request_id in list(self._streams):
                    self._engine_abort_now(request_id)
                continue
            for delta in deltas:
                self._deliver(delta)

    def _deliver(self, delta: CompletionDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        stream._queue.put_nowait(delta)
        if delta.finish_reason is not None:
            stream._unfinished.discard(delta.index)
            if not stream._unfinished:
                self._streams.pop(delta.request_id, None)

    def _engine_abort_now(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            for index in sorted(stream._unfinished):
                self._deliver(CompletionDelta(request_id, index, [], "", None, "abort", 0, 0, 0))
        self._submit("abort", (request_id,))


class LLM:
    """Offline batch generation: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        outputs: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = (
                self.engine.encode_prompt(prompt=prompt)
                if isinstance(prompt, str)
                else self.engine.encode_prompt(prompt_token_ids=prompt)
            )
            request_id = self.engine.add_request(ids, p)
            outputs[request_id] = RequestOutput(
                request_id, ids, [CompletionOutput(i) for i in range(p.n)]
            )
            order.append(request_id)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = outputs[delta.request_id]
                sample = out.outputs[delta.index]
                sample.token_ids.extend(delta.token_ids)
                sample.text += delta.text
                if delta.logprobs is not None:
                    sample.logprobs = (sample.logprobs or []) + delta.logprobs
                if delta.finish_reason is not None:
                    sample.finish_reason = delta.finish_reason
                out.cached_tokens = max(out.cached_tokens, delta.cached_tokens)
        return [outputs[r] for r in order]
