"""Freeing the KV blocks behind a sliding window: a request's leading blocks that no
layer can read again are released as its window slides, their table entries become
FREED, and nothing else changes: no block leaks or is freed twice, the prefix cache stays
correct, forks and preemption still work, and what is generated is the same with and
without freeing and under memory pressure.

The property tests play the model with a shadow KV cache (as `test_properties.py` does):
each computed position's slot holds a key naming the token prefix it was computed over,
and a sampled token is a hash of the keys the last position's window reads through the
block table, so a block freed too early, reused while visible, or read through a wrong
entry changes the output.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kv_invariants import assert_all_free, assert_finished_hold_nothing, assert_pool_consistent

from pagedinfer.service.block_manager import FREED, KVCacheManager, hash_block
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler


def make_request(rid: str, num_tokens: int, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + num_tokens)))


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> int:
    """One step of num_tokens tokens and its update; returns the blocks freed."""
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    return kv.free_outside_window(request)


# -- the KV cache manager ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "16"])
def test_bad_window_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=8, block_size=4, sliding_window=bad)  # type: ignore[arg-type]


def test_blocks_wholly_before_the_next_tokens_window_are_freed() -> None:
    # W = 10, B = 4: after n computed tokens the next token sees positions n - 9 on.
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=10)
    request = make_request("a", 40)
    assert compute(kv, request, 12) == 0  # sees 3.. : block 0 (0..3) is still visible
    assert compute(kv, request, 1) == 1  # n = 13 sees 4..: block 0 goes
    assert request.block_table[0] == FREED and FREED not in request.block_table[1:]
    assert kv.free_outside_window(request) == 0  # idempotent
    assert compute(kv, request, 20) == 5  # n = 33 sees 24..: blocks 1..5 go
    assert request.block_table[:6] == [FREED] * 6
    assert len(request.block_table) == 9  # logical block i is still entry i
    assert kv.stats().used == 3  # 24..35: the window and the next token's block
    kv.free(request)
    assert kv.stats().used == 0 and kv.stats().free == 16
    assert kv.pool.num_free == 16  # nothing released twice


def test_nothing_is_freed_without_a_window_or_under_the_contiguous_policy() -> None:
    for kv in (
        KVCacheManager(num_blocks=16, block_size=4),
        KVCacheManager(
            num_blocks=16, block_size=4, policy="contiguous", max_model_len=40, sliding_window=5
        ),
    ):
        request = make_request("a", 40)
        assert compute(kv, request, 39) == 0
        assert FREED not in request.block_table


def test_freed_blocks_stay_in_the_prefix_cache_for_other_requests() -> None:
    """A block freed behind the window holds the KV of its token prefix, which its hash
    names: a later request with that prefix reuses it (and frees it once it is behind
    its own window)."""
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=5)
    first = make_request("a", 17)
    assert compute(kv, first, 16) == 3  # blocks 0..2 freed, still cached
    freed_ids = [b for b in range(8) if kv.pool.blocks[b].ref_count == 0]
    assert len(kv.pool.cached) == 4 and kv.stats().used == 1
    second = make_request("b", 17)
    hits = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits[:3]] == sorted(freed_ids)[:3] or len(hits) == 4
    assert kv.allocate_slots(second, 1, hits)
    assert second.num_computed_tokens == 16  # every full block came from the cache
    second.num_computed_tokens += 1
    assert kv.free_outside_window(second) == 3
    kv.free(first)
    kv.free(second)
    assert kv.stats().used == 0


def test_an_evicted_freed_block_breaks_the_chain_and_is_recomputed() -> None:
    """Once a freed block is evicted for a fresh one, the chain from the first block no
    longer matches, so a later request recomputes instead of reading wrong KV."""
    kv = KVCacheManager(num_blocks=4, block_size=4, sliding_window=3)
    first = make_request("a", 13)
    assert compute(kv, first, 12) == 2  # blocks 0, 1 freed and evictable
    other = make_request("x", 8, first=100)
    assert compute(kv, other, 8) == 1  # evicts the LRU freed block: block 0 of "a"
    assert kv.get_computed_blocks(make_request("b", 13)) == []


def test_fork_shares_the_live_blocks_and_frees_its_own_references() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    parent = make_request("p", 30)
    assert compute(kv, parent, 20) == 3  # sees 15..: blocks 0..2 go
    child = make_request("c", 30)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [kv.pool.blocks[b].ref_count for b in parent.block_table[3:]] == [2, 2]
    assert compute(kv, child, 4) == 1  # the child's block 3 reference goes
    assert kv.pool.blocks[parent.block_table[3]].ref_count == 1
    kv.free(parent)
    kv.free(child)
    assert kv.stats().used == 0 and all(b.ref_count == 0 for b in kv.pool.blocks)


def test_preempted_request_releases_only_its_live_blocks_and_restarts_clean() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=4)
    request = make_request("a", 30, first=50)
    assert compute(kv, request, 24) == 5
    kv.free(request)  # preemption
    request.num_computed_tokens = 0
    assert kv.stats().used == 0 and kv.pool.num_free == 8
    hits = kv.get_computed_blocks(request)
    assert len(hits) == 6  # the freed blocks, still cached, give the whole prefix back
    assert kv.allocate_slots(request, 6, hits)
    request.num_computed_tokens += 6
    assert kv.free_outside_window(request) == 6  # n = 30: sees 27.. : blocks 0..5 go
    assert kv.stats().used == 2  # 24..27 and 28..29


# -- property tests through the scheduler ---------------------------------------------

MAX_MODEL_LEN = 48
VOCAB = 4
PREFIXES = [[0] * 32, [i % 3 for i in range(32)], [(i * 7) % VOCAB for i in range(32)]]


def prefix_keys(request: Request) -> list[int]:
    """key[p] names (salt, tokens[0..p]): what the KV at position p depends on."""
    key, keys = hash(("salt", request.cache_salt)), []
    for token in request.all_token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


class WindowHarness:
    """A scheduler with a windowed shadow model; `free` turns block freeing on."""

    def __init__(
        self, window: int, free: bool, block_size: int, num_blocks: int, seqs: int, budget: int
    ) -> None:
        config = EngineConfig(
            block_size=block_size,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
        )
        self.scheduler = Scheduler(config, num_blocks, sliding_window=window if free else None)
        self.window, self.free, self.size = window, free, block_size
        self.content: dict[int, list[int | None]] = {}  # shadow KV: block -> key per slot
        self.requests: list[Request] = []
        self.expected: dict[bytes, list[int]] = {}  # block hash -> the keys its slots hold
        self.freed = 0

    def add(self, prefix: int, prefix_len: int, tail: list[int], salt: str | None, n: int):
        prompt = PREFIXES[prefix][:prefix_len] + tail
        request = Request(
            str(len(self.requests)), prompt, SamplingParams(max_tokens=n), cache_salt=salt
        )
        self.requests.append(request)
        self.scheduler.add_request(request)

    def slot(self, request: Request, p: int) -> list[int | None]:
        block = request.block_table[p // self.size]
        assert block != FREED, (request.request_id, p)
        return self.content.setdefault(block, [None] * self.size)

    def read_window(self, request: Request, p: int) -> list[int | None]:
        """The keys position p attends to: its window, through the block table."""
        return [
            self.slot(request, k)[k % self.size] for k in range(max(0, p - self.window + 1), p + 1)
        ]

    def step(self) -> None:
        output = self.scheduler.schedule()
        for src, dst in output.copy_blocks:
            self.content[dst] = list(self.content.get(src, [None] * self.size))
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            keys = prefix_keys(request)
            for p in range(start, start + item.num_tokens):
                self.slot(request, p)[p % self.size] = keys[p]
        sampled = {}
        for item in output.scheduled:  # every write of the step lands before any read
            request, start = item.request, item.request.num_computed_tokens
            end, keys = start + item.num_tokens, prefix_keys(request)
            for p in range(start, end):
                lo = max(0, p - self.window + 1)
                assert self.read_window(request, p) == keys[lo : p + 1], (request.request_id, p)
            if end == request.num_tokens:
                sampled[request.request_id] = (
                    hash(tuple(self.read_window(request, end - 1))) % VOCAB
                )
        before = self.scheduler.kv_cache.stats().used
        self.scheduler.update_from_output(output, sampled)
        self.freed += max(before - self.scheduler.kv_cache.stats().used, 0)
        self.finish_at_max_tokens()

    def fork(self, index: int) -> None:
        parents = [r for r in self.scheduler.running if r.num_computed_tokens > 0]
        if not parents:
            return
        parent = parents[index % len(parents)]
        computed = parent.num_computed_tokens
        child = Request(
            f"{parent.request_id}.{len(self.requests)}",
            parent.prompt_token_ids,
            parent.sampling_params,
            cache_salt=parent.cache_salt,
        )
        for token in parent.all_token_ids[parent.num_prompt_tokens : computed]:
            child.append_output_token(token)
        if computed >= parent.num_prompt_tokens:
            child.append_output_token((parent.all_token_ids[computed] + 1) % VOCAB)
        self.requests.append(child)
        self.scheduler.fork_request(parent, child)
        self.finish_at_max_tokens()

    def finish(self, index: int, status: RequestStatus) -> None:
        if self.requests:
            self.scheduler.finish_request(
                self.requests[index % len(self.requests)].request_id, status
            )

    def finish_at_max_tokens(self) -> None:
        for request in list(self.scheduler.running):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    def preempt(self) -> None:
        if self.scheduler.running:
            self.scheduler._preempt_last()

    def check(self) -> None:
        assert_pool_consistent(self.scheduler)
        pool = self.scheduler.kv_cache.pool
        for request in self.scheduler.running:
            n, table = request.num_computed_tokens, request.block_table
            assert len(table) == -(-n // self.size)
            # Freed exactly the blocks wholly before the next token's window.
            first = max(n - self.window + 1, 0) // self.size if self.free else 0
            assert table[:first] == [FREED] * first
            assert FREED not in table[first:]
            keys = prefix_keys(request)
            for p in range(first * self.size, n):
                assert self.slot(request, p)[p % self.size] == keys[p]
            # A live hashed block is the one of its tokens and salt.
            prev, tokens = None, request.all_token_ids
            for i, block_id in enumerate(table):
                if (i + 1) * self.size > n:
                    break
                prev = hash_block(
                    prev, tokens[i * self.size : (i + 1) * self.size], request.cache_salt
                )
                self.expected[prev] = keys[i * self.size : (i + 1) * self.size]
                if block_id != FREED:
                    assert pool.blocks[block_id].block_hash in (None, prev)
        # Every cached block, freed ones too, holds the KV of the prefix its hash names.
        for block_hash, block in pool.cached.items():
            if block_hash in self.expected:
                assert self.content[block.block_id] == self.expected[block_hash]
        assert_finished_hold_nothing(self.requests)

    def drain(self) -> None:
        for _ in range(5000):
            if not self.scheduler.has_unfinished():
                break
            self.step()
            self.check()
        assert not self.scheduler.has_unfinished()


add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),
    st.integers(0, 28),
    st.lists(st.integers(0, VOCAB - 1), max_size=8),
    st.sampled_from([None, "tenant"]),
    st.integers(1, 14),
)
operation = st.one_of(
    add_op,
    add_op,
    st.just(("step",)),
    st.just(("step",)),
    st.just(("step",)),
    st.just(("step",)),
    st.tuples(st.sampled_from(["finish", "abort"]), st.integers(0, 50)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.just(("preempt",)),
)
windows = st.sampled_from([1, 5, 16, 20])
block_sizes = st.sampled_from([1, 4, 7, 16])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=windows,
    block_size=block_sizes,
    extra_blocks=st.integers(0, 60),
    seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    operations=st.lists(operation, min_size=20, max_size=80),
)
def test_random_operations_free_behind_the_window_and_leak_nothing(
    window: int, block_size: int, extra_blocks: int, seqs: int, budget: int, operations: list
) -> None:
    per_request = -(-MAX_MODEL_LEN // block_size)
    harness = WindowHarness(window, True, block_size, per_request + extra_blocks, seqs, budget)
    for name, *args in operations:
        if name == "add":
            prefix, prefix_len, tail, salt, max_tokens = args
            harness.add(prefix, prefix_len, tail or [1], salt, max_tokens)
        elif name == "step":
            harness.step()
        elif name in ("finish", "abort"):
            finished = name == "finish"
            status = RequestStatus.FINISHED_STOPPED if finished else RequestStatus.FINISHED_ABORTED
            harness.finish(args[0], status)
        elif name == "fork":
            harness.fork(args[0])
        else:
            harness.preempt()
        harness.check()
    harness.drain()
    harness.scheduler.schedule()
    harness.check()
    assert_all_free(harness.scheduler)
    event(f"freed: {harness.freed > 0}")
    event(f"preempted: {harness.scheduler.num_preemptions > 0}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=windows,
    block_size=block_sizes,
    requests=st.lists(add_op, min_size=2, max_size=10),
    tightness=st.integers(0, 8),
    budgets=st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
def test_outputs_are_the_same_with_and_without_freeing_and_under_pressure(
    window: int, block_size: int, requests: list, tightness: int, budgets: tuple[int, int]
) -> None:
    per_request = -(-MAX_MODEL_LEN // block_size)
    tight_blocks = per_request + per_request * tightness // 16
    runs = [
        WindowHarness(window, False, block_size, 12 * per_request, 12, budgets[0]),
        WindowHarness(window, True, block_size, 12 * per_request, 12, budgets[0]),
        WindowHarness(window, True, block_size, tight_blocks, 8, budgets[1]),
    ]
    for harness in runs:
        for _, prefix, prefix_len, tail, salt, max_tokens in requests:
            harness.add(prefix, prefix_len, tail or [1], salt, max_tokens)
        harness.drain()
        assert_all_free(harness.scheduler)
    outputs = [[r.output_token_ids for r in h.requests] for h in runs]
    assert outputs[1] == outputs[0]
    assert outputs[2] == outputs[0]
    event(f"freed: {runs[1].freed > 0}")
    event(f"preempted: {runs[2].scheduler.num_preemptions > 0}")
