"""Soak: 10,000 random add / step / finish / abort / fork / preempt operations on one
scheduler, with the block-accounting invariants checked after every one.

The hypothesis properties in tests/service/test_properties.py run many short histories
(at most 80 operations); this runs long ones, so that the prefix cache, the eviction
queue and the free list go through thousands of reuse cycles. The harness and its
invariant checker are theirs: a shadow KV cache verifies that every context a request
attends to holds exactly its own tokens and salt, and ref counts, the free list, the
eviction queue and the hash map must agree with the block tables of the live requests.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from test_properties import MAX_MODEL_LEN, PREFIXES, VOCAB, Harness

from pagedinfer.service.request import RequestStatus

NUM_OPERATIONS = 10_000
# Weights: steps dominate so that requests finish and the pool turns over.
OPERATIONS = {"add": 6, "step": 14, "finish": 1, "abort": 2, "fork": 1, "preempt": 1}


def random_operation(rng: random.Random, harness: Harness) -> str:
    name = rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
    if name == "add":
        prefix = rng.randrange(len(PREFIXES))
        prefix_len = rng.randint(0, 28)
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(0 if prefix_len else 1, 8))]
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        harness.add(prefix, prefix_len, tail, salt, rng.randint(1, 12))
    elif name == "step":
        harness.step()
    elif name in ("finish", "abort"):
        status = (
            RequestStatus.FINISHED_STOPPED if name == "finish" else RequestStatus.FINISHED_ABORTED
        )
        # Recent requests mostly, and now and then one long gone (must be harmless).
        index = len(harness.requests) - 1 - min(int(rng.expovariate(0.2)), 10**6)
        harness.finish(index, status)
    elif name == "fork":
        harness.fork(rng.randrange(1000))
    else:
        harness.preempt()
    return name


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "policy, block_size, blocks_per_request, seqs, budget",
    [("paged", 16, 2, 6, 32), ("paged", 7, 3, 8, 24), ("contiguous", 16, 3, 4, 40)],
    ids=["paged-16", "paged-7", "contiguous-16"],
)
def test_ten_thousand_random_operations_keep_every_block_accounted_for(
    policy: str, block_size: int, blocks_per_request: int, seqs: int, budget: int
) -> None:
    per_request = -(-MAX_MODEL_LEN // block_size)
    harness = Harness(policy, block_size, blocks_per_request * per_request, seqs, budget)
    rng = random.Random(f"soak-{policy}-{block_size}")
    counts = dict.fromkeys(OPERATIONS, 0)
    started = time.perf_counter()
    for i in range(NUM_OPERATIONS):
        counts[random_operation(rng, harness)] += 1
        try:
            harness.check()
        except AssertionError as exc:
            raise AssertionError(f"invariant broken after operation {i} ({counts})") from exc

    # Nothing is stuck: what is left runs to completion, then every block is free again.
    for _ in range(20_000):
        if not harness.scheduler.has_unfinished():
            break
        harness.step()
        harness.check()
    assert not harness.scheduler.has_unfinished()
    harness.scheduler.schedule()  # collects the finished requests
    harness.check()
    harness.assert_all_free()

    stats = harness.scheduler.stats()
    summary = {
        "policy": policy,
        "block_size": block_size,
        "blocks": harness.kv.num_blocks,
        "operations": counts,
        "requests": len(harness.requests),
        "preemptions": stats.num_preemptions,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "copy_on_write_copies": harness.copies,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print("\nscheduler soak:", json.dumps(summary))
    # The run exercised what it claims to: pressure, reuse and sharing all happened.
    assert stats.num_preemptions > 0
    assert sum(counts.values()) == NUM_OPERATIONS
    if policy == "paged":
        assert stats.prefix_cache_hits > 0
        assert harness.copies > 0
