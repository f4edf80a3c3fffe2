"""AsyncLLMEngine: streams, cancellation, and failure of a step."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from pagedinfer.service import LLM
from pagedinfer.service.async_engine import AsyncLLMEngine
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.outputs import CompletionDelta
from pagedinfer.service.sampling_params import SamplingParams

CONFIG = dict(max_model_len=256, kv_cache_memory=64 * 2**20, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def engine() -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(**CONFIG))


def run(engine: AsyncLLMEngine, coro_fn):
    async def main():
        await engine.start()
        try:
            return await coro_fn()
        finally:
            # Stop the loop task only; the module fixture is reused by the next test.
            engine._task.cancel()
            await asyncio.gather(engine._task, return_exceptions=True)

    return asyncio.run(main())


def test_stream_matches_offline_generation(engine):
    prompt = engine.encode_prompt(prompt="The capital of France is")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def consume():
        deltas = [d async for d in engine.add_request(prompt, params)]
        return deltas

    deltas = run(engine, consume)
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.token_ids]
    offline = LLM(**CONFIG).generate([prompt], params)[0].outputs[0]
    assert tokens == offline.token_ids
    assert "".join(d.text for d in deltas) == offline.text
    assert engine.stats().kv.used == 0


def test_cancelling_the_consumer_aborts_and_frees_blocks(engine):
    prompt = engine.encode_prompt(prompt="Count slowly: one, two, three,")
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def cancel_midway():
        stream = engine.add_request(prompt, params)

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        while engine.stats().kv.used == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(500):
            if not engine.engine.has_unfinished() and engine.stats().kv.used == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(engine, cancel_midway)


def test_a_failed_step_aborts_in_flight_requests_and_the_engine_recovers(engine, monkeypatch):
    prompt = engine.encode_prompt(prompt="Hello there")
    real_step = engine.engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", failing_once)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2)

    async def scenario():
        first = [d async for d in engine.add_request(prompt, params)]
        second = [d async for d in engine.add_request(prompt, params)]
        return first, second

    first, second = run(engine, scenario)
    finals = [d for d in first if d.finish_reason is not None]
    assert sorted(d.index for d in finals) == [0, 1]
    assert {d.finish_reason for d in finals} == {"abort"}
    assert sorted(d.index for d in second if d.finish_reason == "length") == [0, 1]
    assert engine.stats().kv.used == 0


def test_engine_abort_reports_only_the_samples_still_running(engine):
    async def scenario():
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, n=3))
        # Sample 1 finished; the engine then fails: samples 0 and 2 are reported aborted.
        engine._deliver(CompletionDelta(stream.request_id, 1, [5], "x", None, "length", 3, 4, 0))
        engine._engine_abort_now(stream.request_id)
        return [d async for d in stream]

    deltas = run(engine, scenario)
    assert [(d.index, d.finish_reason) for d in deltas] == [
        (1, "length"),
        (0, "abort"),
        (2, "abort"),
    ]


class WarmingUp:
    """Stands in for a CPU executor whose background warm-up ends when the test says."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.active = False
        self.error: BaseException | None = None
        self.activated_on: str | None = None  # the thread that switched to it

    @property
    def ready(self) -> bool:
        return self.finished.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def activate(self, released=None) -> None:
        self.active = True
        self.activated_on = threading.current_thread().name


def test_a_cpu_backend_ready_while_idle_takes_over_without_waiting_for_a_request(
    engine, monkeypatch, caplog
):
    warming = WarmingUp()
    monkeypatch.setattr(engine.engine.runner, "executor", warming)

    async def scenario():
        await asyncio.sleep(0)  # the loop now waits for requests
        warming.finished.set()
        while not warming.active:  # no request comes: the loop wakes by itself
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO, logger="pagedinfer.service.model_runner"):
        run(engine, lambda: asyncio.wait_for(scenario(), timeout=60))
    assert warming.activated_on.startswith("engine-step")  # between steps, on their thread
    assert "the compiled path serves from this step on" in caplog.text
    assert not engine.engine.has_unfinished()
