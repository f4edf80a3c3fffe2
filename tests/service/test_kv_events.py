"""KV-cache events (service/kv_events.py) as a router reads them: decoded with structs
declared from vLLM's format (kv_event_router.py), over real ZeroMQ sockets, from an
engine serving a tiny model. Every stream is checked as it is applied: a removed block
was stored before, a stored block's parent is held, and the router's view ends equal
to the engine's prefix cache."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from kv_event_router import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PodIndex,
    Subscriber,
    block_keys,
    decode_all,
)

from pagedinfer.service import kv_events
from pagedinfer.service.block_manager import KVCacheManager, hash_block
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.kv_events import KVEventsConfig, parse_kv_events_config, wire_hash
from pagedinfer.service.request import Request
from pagedinfer.service.sampling_params import SamplingParams

BLOCK = 16
EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "topic": "kv@pod-a@tiny",
}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events do not depend on the CPU backend: skip compiling its kernels."""
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model) -> str:
    return str(make_tiny_model("llama"))


def make_llm(model: str, **kwargs):
    from pagedinfer.service import LLM

    events = kwargs.pop("events", EVENTS)
    settings = {"max_model_len": 256, "max_num_batched_tokens": 128, "num_gpu_blocks": 64}
    return LLM(model, **{**settings, **kwargs}, kv_events_config=events)


def history(engine) -> tuple[PodIndex, list]:
    """Every batch the engine's publisher sent, by replay, applied to a fresh index."""
    publisher = engine.kv_events
    assert publisher.flush()
    subscriber = Subscriber(publisher.endpoint, publisher.replay_address)
    try:
        batches = decode_all(subscriber.replay(0))
    finally:
        subscriber.close()
    assert len(batches) == publisher.published
    index = PodIndex()
    for batch in batches:
        index.apply(batch)
    return index, batches


def engine_cache_keys(engine) -> set[int]:
    return {wire_hash(h) for h in engine.scheduler.kv_cache.pool.cached}


def prompt(prefix: int, length: int, tail: int = 0, tail_length: int = 20) -> list[int]:
    """`length` token ids shared by every prompt of the same `prefix`, then, for a
    nonzero `tail`, `tail_length` ids of its own."""
    shared = [(prefix * 997 + i * 31) % 40000 + 100 for i in range(length)]
    own = [(tail * 7919 + i * 13) % 40000 + 50 for i in range(tail_length)] if tail else []
    return shared + own


# -- configuration ------------------------------------------------------------------------


def test_config_takes_vllms_json_with_its_defaults():
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config == KVEventsConfig(enable_kv_cache_events=True)
    assert config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    assert config.hwm == 100_000 and config.max_queue_size == 100_000 and config.topic == ""
    assert config.active
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).active
    assert not parse_kv_events_config({"publisher": "zmq"}).active
    engine_config = EngineConfig(kv_events_config='{"enable_kv_cache_events": true}')
    assert engine_config.kv_events_config == config


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"enable_kv_cache_event": true}', "'enable_kv_cache_event'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint"),
        ('{"max_queue_size": 0}', "max_queue_size"),
        ('{"buffer_steps": -1}', "buffer_steps"),
        ('{"hwm": true}', "hwm"),
    ],
)
def test_bad_config_is_refused_naming_the_field(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(kv_events_config=value)


def test_cli_refuses_a_bad_config_with_exit_2(capsys):
    from pagedinfer.service.cli import main

    code = main(["generate", "--kv-events-config", '{"hwm": 0}', "hello"])
    assert code == 2
    assert "hwm must be a positive integer" in capsys.readouterr().err


# -- hashes -------------------------------------------------------------------------------


def test_block_hashes_are_the_documented_chain_in_every_process():
    tokens = list(range(1000, 1000 + 3 * BLOCK + 5))
    ours, prev = [], None
    for start in range(0, 3 * BLOCK, BLOCK):
        prev = hash_block(prev, tokens[start : start + BLOCK], "tenant")
        ours.append(wire_hash(prev))
    assert ours == block_keys(tokens, BLOCK, "tenant")
    assert ours != block_keys(tokens, BLOCK) != block_keys(tokens, BLOCK, "other")
    code = (
        "from pagedinfer.service.block_manager import hash_block;"
        f"print(hash_block(hash_block(None, {tokens[:BLOCK]}, 'tenant'), "
        f"{tokens[BLOCK : 2 * BLOCK]}, 'tenant').hex())"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert wire_hash(bytes.fromhex(out.stdout.strip())) == ours[1]


# -- the block manager's records ----------------------------------------------------------


def test_block_manager_records_stores_evictions_and_resets():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.enable_events()
    a = Request("a", list(range(10)), cache_salt="t")
    assert kv.allocate_slots(a, 10, kv.get_computed_blocks(a))
    (stored,) = kv.take_events()
    assert stored[0] == "stored" and stored[2] is None
    assert stored[1] == [
        hash_block(None, range(4), "t"),
        hash_block(stored[1][0], range(4, 8), "t"),
    ]
    assert stored[3] == list(range(8)) and stored[4] == [("t",), None]
    assert kv.take_events() == []
    kv.free(a)
    # A 4-block request needs every block: both cached blocks are evicted, LRU first.
    b = Request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16, kv.get_computed_blocks(b))
    events = kv.take_events()
    assert [e[0] for e in events] == ["removed", "removed", "stored"]
    assert {e[1][0] for e in events[:2]} == set(stored[1])
    assert kv.reset_prefix_cache() is False  # b holds blocks
    assert kv.take_events() == []
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [("cleared",)] and not kv.pool.cached
    assert kv.stats().free == 4


# -- an engine's events over ZeroMQ -------------------------------------------------------


def test_shared_prefixes_store_each_block_once_in_a_chain(tiny_model):
    llm = make_llm(tiny_model)
    # Two shared blocks, then each prompt's own third block.
    prompts = [prompt(1, 2 * BLOCK, tail) for tail in (1, 2, 3)] + [prompt(2, 2 * BLOCK + 3)]
    llm.generate(prompts, GREEDY)
    index, batches = history(llm.engine)
    assert isinstance(batches[0].events[0], AllBlocksCleared)  # a new process holds nothing
    assert all(b.data_parallel_rank == 0 for b in batches)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert all(e.block_size == BLOCK and e.medium == "CPU" and e.lora_id is None for e in stored)
    for p in prompts:
        keys = block_keys(p, BLOCK)
        assert index.prefix_length(keys) == len(keys)  # every full prompt block is held
        for parent, key in zip([None, *keys], keys, strict=False):
            assert index.blocks[key] == parent
        for i, key in enumerate(keys):
            assert index.tokens[key] == p[i * BLOCK : (i + 1) * BLOCK]
    # The shared blocks were stored once, by the first prompt.
    all_keys = [k for e in stored for k in e.block_hashes]
    assert len(all_keys) == len(set(all_keys))
    assert set(index.blocks) == engine_cache_keys(llm.engine)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 2 * 2 * BLOCK and stats.kv_events_dropped == 0
    llm.engine.close()


def test_salted_prompts_carry_the_salt_in_their_first_blocks_extra_keys(tiny_model):
    llm = make_llm(tiny_model)
    p = prompt(3, 2 * BLOCK + 1)
    request = llm.engine.make_request(p, GREEDY, cache_salt="tenant-a")
    llm.engine.add_request(request)
    while llm.engine.has_unfinished():
        llm.engine.step()
    _, batches = history(llm.engine)
    (event,) = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert event.block_hashes == block_keys(p, BLOCK, "tenant-a")
    assert event.extra_keys == [("tenant-a",), None]
    llm.engine.close()


def test_eviction_in_a_small_cache_removes_only_stored_blocks(tiny_model):
    llm = make_llm(tiny_model, num_gpu_blocks=10)
    prompts = [prompt(10 + i, 2 * BLOCK + 4) for i in range(8)]
    for p in prompts:  # one at a time: each evicts what the earlier ones left
        llm.generate([p], GREEDY)
    index, batches = history(llm.engine)  # PodIndex.apply checks each removal was stored
    removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "CPU" and e.group_idx == 0 for e in removed)
    assert index.removed > 0 and index.stored == index.removed + len(index.blocks)
    assert set(index.blocks) == engine_cache_keys(llm.engine)
    assert index.prefix_length(block_keys(prompts[-1], BLOCK)) == 2
    assert index.prefix_length(block_keys(prompts[0], BLOCK)) == 0
    llm.engine.close()


def test_preemption_keeps_the_stream_consistent(tiny_model):
    llm = make_llm(tiny_model, num_gpu_blocks=12, max_num_batched_tokens=64)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(20 + i, 2 * BLOCK + 5) for i in range(4)], long)
    assert llm.engine.stats().num_preemptions > 0
    index, _ = history(llm.engine)
    assert index.stored > 0
    assert set(index.blocks) == engine_cache_keys(llm.engine)
    llm.engine.close()


def test_cancelled_streams_keep_their_blocks_cached_and_announced(tiny_model):
    from pagedinfer.service.async_engine import AsyncLLMEngine

    config = EngineConfig(
        model=tiny_model, max_model_len=256, num_gpu_blocks=32, kv_events_config=EVENTS
    )
    p = prompt(30, 2 * BLOCK + 2)

    async def run(engine: AsyncLLMEngine) -> None:
        await engine.start()
        stream = engine.add_request(p, SamplingParams(max_tokens=100, ignore_eos=True))
        async for delta in stream:
            if delta.token_ids:
                break
        await stream.aclose()  # what a dropped connection does: abort, free the blocks
        await engine.add_request(p, GREEDY).__anext__()  # the next step has run
        engine.engine.kv_events.flush()

    engine = AsyncLLMEngine(config)
    asyncio.run(run(engine))
    index, _ = history(engine.engine)
    assert engine.engine.stats().kv.used <= 3  # only the second request's blocks
    assert index.prefix_length(block_keys(p, BLOCK)) == 2
    assert set(index.blocks) == engine_cache_keys(engine.engine)
    asyncio.run(engine.shutdown())
    assert engine.engine.kv_events is None


def test_live_subscriber_reads_what_replay_keeps(tiny_model):
    llm = make_llm(tiny_model)
    publisher = llm.engine.kv_events
    subscriber = Subscriber(publisher.endpoint, publisher.replay_address)
    # A SUB socket hears only what is sent after its subscription arrives: reset the
    # (empty) cache until it hears one batch, then it hears everything.
    first = None
    for _ in range(100):
        assert llm.engine.reset_prefix_cache()
        first = subscriber.receive(timeout_ms=100)
        if first is not None:
            break
    assert first is not None and first[0] == b"kv@pod-a@tiny"
    llm.generate([prompt(40, 3 * BLOCK), prompt(40, 2 * BLOCK, tail=5)], GREEDY)
    assert publisher.flush()
    live = [first[1:]]
    while live[-1][0] < publisher.published - 1:
        message = subscriber.receive()
        assert message is not None and message[0] == b"kv@pod-a@tiny"
        live.append(message[1:])
    assert [seq for seq, _ in live] == list(range(first[1], publisher.published))
    assert live == subscriber.replay(first[1])
    assert subscriber.replay(publisher.published) == []
    decoded = [DECODER.decode(payload) for _, payload in live]
    assert any(isinstance(e, BlockStored) for b in decoded for e in b.events)
    subscriber.close()
    llm.engine.close()


def test_a_full_queue_drops_counted_then_resends_the_whole_cache(tiny_model, monkeypatch):
    # The publisher thread stalls on its first batch, as on a socket nobody drains.
    release = threading.Event()
    to_wire = kv_events.to_wire

    def stalled(raw, block_size, medium):
        release.wait(600)  # released below, once the queue has overflowed
        return to_wire(raw, block_size, medium)

    monkeypatch.setattr(kv_events, "to_wire", stalled)
    llm = make_llm(tiny_model, num_gpu_blocks=10, events={**EVENTS, "max_queue_size": 2})
    for i in range(6):
        llm.generate([prompt(50 + i, 2 * BLOCK + 4)], GREEDY)
    dropped = llm.engine.kv_events.dropped
    assert dropped > 0 and llm.engine.stats().kv_events_dropped == dropped
    release.set()
    llm.generate([prompt(60, 2 * BLOCK + 4)], GREEDY)  # the first batch to fit resyncs
    index, batches = history(llm.engine)
    resync = next(b for b in batches[1:] if isinstance(b.events[0], AllBlocksCleared))
    assert any(isinstance(e, BlockStored) for e in resync.events)
    assert set(index.blocks) == engine_cache_keys(llm.engine)
    llm.engine.close()


RESTART_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["PAGEDINFER_CPU_KERNELS"] = "torch"
    from pagedinfer.service import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_model_len=256, num_gpu_blocks=32,
              kv_events_config=json.loads(sys.argv[2]))
    llm.generate([json.loads(sys.argv[3])], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.kv_events.flush()
    print(llm.engine.kv_events.endpoint, llm.engine.kv_events.replay_address, flush=True)
    sys.stdin.read()  # serve replay until the test is done
    llm.engine.close()
    """
)


def test_a_restarted_server_starts_over_and_names_blocks_the_same(tiny_model):
    """Two processes in turn on the same ports, with different hash seeds: each starts
    at sequence 0 with AllBlocksCleared, and stores the same prompt under the same keys."""
    import json
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{ports[0]}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
    }
    # A host name connects instead of binding: give the wildcard form the rule binds on.
    config["endpoint"] = config["endpoint"].replace("127.0.0.1", "*")
    p = prompt(70, 3 * BLOCK + 1)
    runs = []
    for seed in ("11", "12"):
        process = subprocess.Popen(
            [sys.executable, "-c", RESTART_SCRIPT, tiny_model, json.dumps(config), json.dumps(p)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"},
        )
        try:
            endpoint, replay = process.stdout.readline().split()
            assert endpoint.endswith(f":{ports[0]}") and replay.endswith(f":{ports[1]}")
            subscriber = Subscriber(f"tcp://127.0.0.1:{ports[0]}", replay)
            runs.append(decode_all(subscriber.replay(0)))
            subscriber.close()
        finally:
            process.communicate("", timeout=60)
        assert process.returncode == 0
    for batches in runs:
        assert isinstance(batches[0].events[0], AllBlocksCleared)
    stored = [
        [k for b in batches for e in b.events if isinstance(e, BlockStored) for k in e.block_hashes]
        for batches in runs
    ]
    assert stored[0] == stored[1] == block_keys(p, BLOCK)
