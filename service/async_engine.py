"""The asyncio front of the engine: one background loop, one async stream per request.

`AsyncLLMEngine` steps `LLMEngine` in a worker thread, so the event loop stays free
for the servers; adds and aborts queue up and are applied by the worker between steps.
A CPU backend still compiling when the loop starts takes over as soon as it is ready,
at the next step, even when no request is running (`ModelRunner.take_over`).
A request is checked (`LLMEngine.make_request`) when it is added, on the caller's
side, so that bad input fails at once and never reaches the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.engine import EngineStats, LLMEngine
from pagedinfer.service.outputs import CompletionDelta
from pagedinfer.service.sampling_params import SamplingParams

log = logging.getLogger(__name__)


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
        # Guards _pending; the engine itself is stepped only by the worker.
        self._lock = threading.Lock()
        self._pending: deque[tuple[str, tuple]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopped = threading.Event()  # ends the watch on the CPU backend's warm-up
        self._ids = itertools.count()
        self._stats = self.engine.stats()

    def encode_prompt(self, **kwargs) -> list[int]:
        """`LLMEngine.encode_prompt`: it reads only the tokenizer, safe beside a step."""
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
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="engine-loop")
        executor = self.engine.runner.pending_executor
        if executor is not None:
            threading.Thread(
                target=self._take_over_when_ready,
                args=(executor, loop),
                name="pagedinfer-take-over",
                daemon=True,
            ).start()

    async def shutdown(self) -> None:
        self._stopped.set()
        for request_id in list(self._streams):
            self.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)
        self.engine.close()

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
        """Check and queue a request; ValueError naming the problem if it could never run."""
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
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

    def _take_over_when_ready(self, executor: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for the CPU backend's warm-up, then wake the loop to switch to it between
        steps (a warm-up that failed never becomes ready: the torch forward serves on)."""
        while not executor.wait_ready(1.0):
            if self._stopped.is_set() or executor.error is not None:
                return
        if not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._submit, "take_over", ())

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
                except ValueError as exc:  # its id clashes with a sample of a live request
                    request = args[0]
                    log.warning("request %s refused: %s", request.request_id, exc)
                    deltas.extend(
                        CompletionDelta.aborted(request.request_id, i)
                        for i in range(request.sampling_params.n)
                    )
            elif op == "take_over":
                self.engine.runner.take_over()
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
                self._deliver(CompletionDelta.aborted(request_id, index))
        self._submit("abort", (request_id,))
