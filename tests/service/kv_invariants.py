"""Invariants of the block pool and of what requests' blocks hold, shared by the property
tests (`test_properties.py`, `test_scheduler_spec.py`).

A shadow KV cache plays the model runner's: `content` maps a block id to one key per
slot, naming the token prefix (and salt) the KV at that slot was computed over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedinfer.service.block_manager import hash_block
from pagedinfer.service.request import Request
from pagedinfer.service.scheduler import Scheduler

Content = dict[int, list[int | None]]


def assert_pool_consistent(scheduler: Scheduler) -> None:
    """Free, evictable and held blocks partition the pool; the hash map names exactly the
    hashed blocks; every block's ref count is the number of live requests holding it."""
    pool = scheduler.kv_cache.pool
    blocks, free, evictable = pool.blocks, pool._free, list(pool._evictable)
    assert len(set(free)) == len(free)  # no double free
    assert not set(free) & set(evictable)
    for block in blocks:
        is_free = block.block_id in pool._evictable or block.block_id in set(free)
        assert is_free == (block.ref_count == 0), block
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert all(blocks[b].block_hash is None for b in free)
    assert all(blocks[b].block_hash is not None for b in evictable)
    assert len(pool.cached) == sum(b.block_hash is not None for b in blocks)
    holders = Counter(b for r in scheduler.requests.values() for b in r.block_table)
    assert all(block.ref_count == holders[block.block_id] for block in blocks)


def assert_context(
    content: Content, block_size: int, keys: list[int], request: Request, length: int
) -> None:
    """The request's first `length` positions hold the KV of keys[0..length)."""
    for p in range(length):
        block = request.block_table[p // block_size]
        assert content[block][p % block_size] == keys[p], (request.request_id, p)


def assert_cached_blocks_match(scheduler: Scheduler, request: Request) -> None:
    """A hashed block is fully computed and holds exactly the tokens and salt of its hash."""
    pool, size = scheduler.kv_cache.pool, scheduler.config.block_size
    prev, tokens = None, request.all_token_ids
    for i, block_id in enumerate(request.block_table):
        block_hash = pool.blocks[block_id].block_hash
        if (i + 1) * size > request.num_computed_tokens:
            assert block_hash is None
            continue
        prev = hash_block(prev, tokens[i * size : (i + 1) * size], request.cache_salt)
        assert block_hash in (None, prev)


def assert_finished_hold_nothing(requests: Iterable[Request]) -> None:
    for request in requests:
        if request.status.is_finished:
            assert request.block_table == []


def assert_all_free(scheduler: Scheduler) -> None:
    """Nothing left to run and every block back in the pool."""
    stats = scheduler.stats()
    assert not scheduler.has_unfinished()
    assert stats.kv.free == stats.kv.total and stats.kv.used == 0
    assert all(block.ref_count == 0 for block in scheduler.kv_cache.pool.blocks)
