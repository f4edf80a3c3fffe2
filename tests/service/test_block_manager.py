"""KV cache manager: on-demand blocks, ref counts, prefix cache, forks, copy-on-write."""

from __future__ import annotations

import pytest

from pagedinfer.service.block_manager import BlockPool, KVCacheManager, hash_block
from pagedinfer.service.request import Request


def make_request(rid: str, num_tokens: int, salt: str | None = None, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + num_tokens)), cache_salt=salt)


def admit(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> bool:
    """What the scheduler does at admission: prefix lookup, then allocation."""
    hits = kv.get_computed_blocks(request)
    if num_tokens is None:
        num_tokens = request.num_tokens - len(hits) * kv.block_size
    return kv.allocate_slots(request, num_tokens, hits)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Allocate and mark computed, as one scheduler step plus its update would."""
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0, "block_size": 16}, "num_blocks"),
        ({"num_blocks": -3, "block_size": 16}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "block_size": 16, "policy": "buddy"}, "policy"),
        ({"num_blocks": 8, "block_size": 16, "max_model_len": 8}, "max_model_len"),
        ({"num_blocks": 8, "block_size": 16, "policy": "contiguous"}, "max_model_len"),
        (
            {"num_blocks": 3, "block_size": 16, "policy": "contiguous", "max_model_len": 64},
            "num_blocks",
        ),
    ],
)
def test_invalid_configuration_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVCacheManager(**kwargs)


def test_blocks_are_allocated_on_demand_for_the_computed_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    request = make_request("a", 20)
    assert kv.allocate_slots(request, 20)
    assert len(request.block_table) == 2
    request.num_computed_tokens = 20
    assert kv.allocate_slots(request, 1)  # position 20 still fits the second block
    assert len(request.block_table) == 2
    request.num_computed_tokens = 32
    assert kv.allocate_slots(request, 1)
    assert len(request.block_table) == 3
    assert kv.stats().used == 3


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", 12)
    assert not kv.allocate_slots(request, 12)
    assert request.block_table == []
    assert kv.stats().free == 2


def test_free_is_idempotent_and_returns_every_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    request = make_request("a", 10)
    compute(kv, request, 10)
    kv.free(request)
    kv.free(request)
    assert request.block_table == []
    assert kv.stats().free == 4
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_prefix_cache_hit_reuses_full_blocks_and_recomputes_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", 10)
    compute(kv, first, 10)
    # Same 8 leading tokens plus different ones: the two full blocks are shared.
    second = Request("b", [*first.prompt_token_ids[:8], 99, 98])
    assert admit(kv, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.num_computed_tokens == 8
    assert kv.pool.blocks[first.block_table[0]].ref_count == 2
    # A prompt made only of cached full blocks still recomputes its last token.
    exact = make_request("c", 8)
    assert kv.get_computed_blocks(exact) == [kv.pool.blocks[first.block_table[0]]]


def test_prefix_cache_is_partitioned_by_cache_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    compute(kv, make_request("a", 10, salt="tenant-a"), 10)
    assert kv.get_computed_blocks(make_request("b", 10, salt="tenant-b")) == []
    assert kv.get_computed_blocks(make_request("c", 10)) == []
    assert len(kv.get_computed_blocks(make_request("d", 10, salt="tenant-a"))) == 2


def test_hash_chain_depends_on_predecessor_tokens_and_salt() -> None:
    h = hash_block(None, [1, 2], None)
    assert hash_block(None, [1, 2], None) == h
    assert hash_block(h, [1, 2], None) != h
    assert hash_block(None, [1, 2], "s") != h
    assert hash_block(None, [2, 1], None) != h


def test_freed_cached_blocks_are_reused_by_a_later_request() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", 10)
    compute(kv, first, 10)
    table = list(first.block_table)
    kv.free(first)
    stats = kv.stats()
    assert stats.free == 8 and stats.cached == 2
    again = make_request("b", 10)
    assert admit(kv, again)
    assert again.block_table[:2] == table[:2]
    assert again.num_computed_tokens == 8


def test_cached_blocks_are_evicted_only_when_no_plain_block_is_left_lru_first() -> None:
    pool = BlockPool(3)
    old, new, plain = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(old, b"old")
    pool.cache(new, b"new")
    pool.release(old)  # freed first: least recently used
    pool.release(new)
    pool.release(plain)
    assert pool.allocate() is plain
    assert pool.allocate() is old
    assert b"old" not in pool.cached and old.block_hash is None
    assert pool.cached[b"new"] is new


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_pool() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", 9)
    compute(kv, first, 9)
    kv.free(first)
    second = make_request("b", 9)
    assert admit(kv, second)  # 2 revived cached blocks + 1 new
    assert kv.stats().free == 0
    assert [kv.pool.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]


def test_fork_shares_blocks_and_copies_the_shared_partial_block_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", 6)
    compute(kv, parent, 6)
    parent.append_output_token(100)
    child = Request("c", parent.prompt_token_ids)
    child.append_output_token(200)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [kv.pool.blocks[b].ref_count for b in parent.block_table] == [2, 2]

    shared_last = parent.block_table[1]
    assert kv.allocate_slots(parent, 1)  # parent writes position 6 into the shared block
    assert parent.block_table[1] != shared_last
    assert kv.take_pending_copies() == [(shared_last, parent.block_table[1])]
    assert kv.take_pending_copies() == []
    assert kv.allocate_slots(child, 1)  # now the child owns the old block alone: no copy
    assert child.block_table[1] == shared_last
    assert kv.take_pending_copies() == []
    assert kv.pool.blocks[parent.block_table[0]].ref_count == 2


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", 8)
    compute(kv, parent, 8)
    child = Request("c", parent.prompt_token_ids)
    child.append_output_token(1)
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)
    assert len(child.block_table) == 3
    assert kv.take_pending_copies() == []


def test_contiguous_policy_reserves_max_model_len_and_does_no_prefix_caching() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, policy="contiguous", max_model_len=16)
    request = make_request("a", 5)
    compute(kv, request, 5)
    assert len(request.block_table) == 4
    assert kv.allocate_slots(request, 1)
    assert len(request.block_table) == 4
    assert kv.get_computed_blocks(make_request("b", 5)) == []
    assert kv.allocate_slots(make_request("b", 1), 1)  # takes the other 4 blocks
    assert kv.stats().free == 0
    assert not kv.allocate_slots(make_request("c", 1), 1)
    assert kv.num_blocks_for(1) == 4


def test_stats_count_free_used_cached_and_demand() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    compute(kv, make_request("a", 9), 9)
    stats = kv.stats(waiting_demand=5)
    assert (stats.total, stats.free, stats.used, stats.cached) == (10, 7, 3, 2)
    assert stats.free_ratio == pytest.approx(0.7)
    assert stats.demand == 8
