"""Two replicas behind a tiny prefix-aware router that reads their KV-cache events,
against round robin: the events let the router send each request to the replica that
holds its prefix, so the fleet's prefix cache hits far more often.

The router keeps one index per replica from the replicas' event batches (read in order
from their replay sockets after each request, so the run is deterministic), computes
each prompt's block keys from its token ids (kv_event_router.block_keys), and picks the
replica holding the longest prefix, the less loaded one on a tie.
"""

from __future__ import annotations

import random

import pytest
from kv_event_router import DECODER, PodIndex, Subscriber, block_keys

from pagedinfer.service.sampling_params import SamplingParams

BLOCK = 16
NUM_PREFIXES = 6
REQUESTS_PER_PREFIX = 6
PREFIX_BLOCKS = 4  # a system prompt of 64 tokens, then 20 of the user's own
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")


def workload() -> list[list[int]]:
    """Requests sharing NUM_PREFIXES system prompts, interleaved in a seeded order."""
    rng = random.Random(57)
    prefixes = [
        [rng.randrange(100, 40000) for _ in range(PREFIX_BLOCKS * BLOCK)]
        for _ in range(NUM_PREFIXES)
    ]
    requests = [
        prefixes[p] + [rng.randrange(100, 40000) for _ in range(20)]
        for p in range(NUM_PREFIXES)
        for _ in range(REQUESTS_PER_PREFIX)
    ]
    rng.shuffle(requests)
    return requests


class Replica:
    """One engine with its events, and the router's view of it."""

    def __init__(self, model: str) -> None:
        from pagedinfer.service import LLM

        events = {
            "enable_kv_cache_events": True,
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
        }
        # 24 blocks: room for about half of the system prompts with their users' blocks.
        self.llm = LLM(model, max_model_len=256, num_gpu_blocks=24, kv_events_config=events)
        publisher = self.llm.engine.kv_events
        self.subscriber = Subscriber(publisher.endpoint, publisher.replay_address)
        self.index = PodIndex()
        self.next_seq = 0
        self.requests = 0

    def sync(self) -> None:
        """Apply the batches published since the last sync, in order."""
        assert self.llm.engine.kv_events.flush()
        for seq, payload in self.subscriber.replay(self.next_seq):
            assert seq == self.next_seq
            self.index.apply(DECODER.decode(payload))
            self.next_seq += 1

    def run(self, prompt: list[int]) -> None:
        self.llm.generate([prompt], PARAMS)
        self.requests += 1
        self.sync()

    def reset(self) -> None:
        assert self.llm.engine.reset_prefix_cache()
        self.sync()
        assert not self.index.blocks
        self.requests = 0

    def close(self) -> None:
        self.subscriber.close()
        self.llm.engine.close()


def hit_rate(replicas: list[Replica], policy: str) -> float:
    """Share of prompt tokens served from the prefix cache over the whole workload."""
    before = [r.llm.engine.stats() for r in replicas]
    for i, prompt in enumerate(workload()):
        if policy == "round_robin":
            target = replicas[i % len(replicas)]
        else:
            keys = block_keys(prompt, BLOCK)
            target = max(replicas, key=lambda r: (r.index.prefix_length(keys), -r.requests))
        target.run(prompt)
    after = [r.llm.engine.stats() for r in replicas]
    pairs = list(zip(after, before, strict=True))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs)
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs)
    return hits / queries


def test_prefix_aware_routing_on_events_beats_round_robin(make_tiny_model, capsys):
    model = str(make_tiny_model("llama"))
    replicas = [Replica(model), Replica(model)]
    try:
        for r in replicas:
            r.sync()
        round_robin = hit_rate(replicas, "round_robin")
        for r in replicas:
            r.reset()
        prefix_aware = hit_rate(replicas, "prefix_aware")
        # The router's view is each replica's cache, block for block.
        for r in replicas:
            cached = r.llm.engine.scheduler.kv_cache.pool.cached
            assert set(r.index.blocks) == {int.from_bytes(h[-8:], "big") for h in cached}
        loads = [r.requests for r in replicas]
    finally:
        for r in replicas:
            r.close()
    with capsys.disabled():
        print(
            f"\nprefix-cache hit rate over {NUM_PREFIXES * REQUESTS_PER_PREFIX} requests on "
            f"2 replicas: round robin {round_robin:.1%}, prefix-aware {prefix_aware:.1%} "
            f"(requests per replica {loads})"
        )
    # Each system prompt is computed once fleet-wide instead of once per replica, and
    # no replica thrashes: every later request of a prefix hits its 64 tokens.
    best = (REQUESTS_PER_PREFIX - 1) * PREFIX_BLOCKS * BLOCK / (REQUESTS_PER_PREFIX * 84)
    assert prefix_aware == pytest.approx(best, abs=0.02)
    assert prefix_aware > round_robin + 0.15
    assert min(loads) >= len(workload()) // 4  # routing by prefix still spreads the load
