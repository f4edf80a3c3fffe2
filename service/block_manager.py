"""KV cache blocks: a pool with ref counts and a prefix cache, and the per-request manager.

A request's KV lives in fixed-size blocks anywhere in the cache; its block table maps
logical block i (tokens i*B .. i*B+B-1) to a physical block id. Full blocks are
identified by a hash chain over their tokens, so requests with a common prefix share
them. Free blocks that still hold a cached prefix are reused only when no plain free
block is left, least recently freed first (lazy LRU eviction).

With a sliding window on every layer, a request's leading blocks that no token still to
compute can see are released as the window slides (`free_outside_window`); their table
entries become FREED, so logical block i stays at entry i.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedinfer.service.request import Request

# The block-table entry of a block released because no layer can read it again.
FREED = -1


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is in the prefix cache


@dataclass
class KVCacheStats:
    total: int
    free: int  # allocatable now: plain free blocks plus evictable cached ones
    used: int  # held by at least one request
    cached: int  # blocks in the prefix cache, in use or free
    free_ratio: float
    demand: int  # used plus the blocks the waiting queue needs for its tokens


def hash_block(prev_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """h_i = sha256(h_{i-1}, tokens of block i, cache_salt).

    Exactly: sha256 over the previous digest (nothing for the first block), the salt's
    UTF-8 length as 4 bytes little-endian, the salt, and each token id as 8 bytes
    little-endian. Nothing per process goes in, so every replica and restart names a
    prefix the same, and a router can compute the keys from token ids (kv_events.py).
    """
    h = hashlib.sha256(prev_hash or b"")
    salt = (cache_salt or "").encode()
    h.update(len(salt).to_bytes(4, "little") + salt)  # length prefix: salts never run into tokens
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """All blocks of the cache, created once; hands them out and takes them back."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # plain free blocks; pop() = lowest id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, LRU first
        self.cached: dict[bytes, Block] = {}
        # Prefix-cache changes for KV events (kv_events.py); None while events are off.
        self.events: list[tuple] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self) -> Block:
        """A block with ref count 1, evicting the least recently freed cached one if needed."""
        if self._free:
            block = self.blocks[self._free.pop()]
        else:
            block = self.blocks[self._evictable.popitem(last=False)[0]]
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.append(("removed", [block.block_hash]))
            block.block_hash = None
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Take one more reference; a free cached block leaves the eviction queue."""
        if block.ref_count == 0:
            del self._evictable[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free.append(block.block_id)
            else:
                self._evictable[block.block_id] = None

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Enter the block into the prefix cache; False if it or its hash is there already."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def clear_cache(self) -> bool:
        """Forget every cached prefix; False (and no change) while any block is in use."""
        if len(self._free) + len(self._evictable) < len(self.blocks):
            return False
        for block_id in self._evictable:
            self.blocks[block_id].block_hash = None
            self._free.append(block_id)
        self._evictable.clear()
        self.cached.clear()
        if self.events is not None:
            self.events.append(("cleared",))
        return True


class KVCacheManager:
    """Owns every block table: allocation per step, prefix cache, forks, copy-on-write.

    policy "paged" allocates blocks as tokens are computed; "contiguous" reserves
    max_model_len slots at a request's first allocation, like a naive server, and
    does no prefix caching, so that benchmarks compare both on the same code.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        policy: str = "paged",
        max_model_len: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if policy not in ("paged", "contiguous"):
            raise ValueError(f"policy must be 'paged' or 'contiguous', got {policy!r}")
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {sliding_window!r}"
            )
        if max_model_len is not None and max_model_len < block_size:
            raise ValueError(
                f"max_model_len ({max_model_len}) must be at least block_size ({block_size})"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.policy = policy
        self.max_model_len = max_model_len
        self.reserved_blocks = 0  # blocks a contiguous request reserves
        if policy == "contiguous":
            if max_model_len is None:
                raise ValueError("max_model_len is required by the contiguous policy")
            self.reserved_blocks = -(-max_model_len // block_size)
            if num_blocks < self.reserved_blocks:
                raise ValueError(
                    f"num_blocks ({num_blocks}) cannot hold one contiguous request of "
                    f"max_model_len {max_model_len} ({self.reserved_blocks} blocks)"
                )
        self.enable_prefix_caching = enable_prefix_caching and policy == "paged"
        # The window of every layer (None: some layer attends fully, nothing is freed). A
        # contiguous request keeps its reservation, as a naive server would.
        self.sliding_window = sliding_window if policy == "paged" else None
        self.pool = BlockPool(num_blocks)
        self._block_hashes: dict[str, list[bytes]] = {}  # hashes of each request's full blocks
        self._num_freed: dict[str, int] = {}  # leading FREED entries of each request's table
        self._pending_copies: list[tuple[int, int]] = []
        # hash -> (parent hash, token ids, extra keys, depth) of each cached block, kept
        # while KV events are on so that a publisher can store the whole cache again.
        self._stored: dict[bytes, tuple] | None = None

    def enable_events(self, on: bool = True) -> None:
        """Record prefix-cache changes for `take_events` (KV events, kv_events.py), or
        stop recording them."""
        if not on:
            self.pool.events = self._stored = None
        elif self.enable_prefix_caching and self.pool.events is None:
            self.pool.events = []
            self._stored = {}

    def take_events(self) -> list[tuple]:
        """The prefix-cache changes since the last call, oldest first (kv_events.RawEvent)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        if self._stored is not None:
            # A hash evicted and stored again in one step is cached: keep its record.
            cached = self.pool.cached
            for event in events:
                if event[0] == "removed" and event[1][0] not in cached:
                    self._stored.pop(event[1][0], None)
                elif event[0] == "cleared":
                    self._stored = {h: info for h, info in self._stored.items() if h in cached}
        return events

    def cached_block_events(self) -> list[tuple]:
        """Records storing every cached block again, parents first (after dropped events)."""
        if self._stored is None:
            return []
        blocks = sorted(
            (info[3], h, info) for h, info in self._stored.items() if h in self.pool.cached
        )
        return [("stored", [h], info[0], info[1], [info[2]]) for _, h, info in blocks]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and no change) while any request holds blocks."""
        return self.pool.clear_cache()

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request holding num_tokens tokens occupies under this policy."""
        return self.reserved_blocks or -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request's next num_new_tokens tokens add to its table."""
        end = request.num_computed_tokens + num_new_tokens
        return max(self.num_blocks_for(end) - len(request.block_table), 0)

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """Longest chain of cached full blocks matching the request's leading tokens.

        Stops one token short of the end: the last token is always recomputed so that
        the model produces logits to sample from.
        """
        if not self.enable_prefix_caching or request.block_table:
            return []
        tokens, size, prev = request.all_token_ids, self.block_size, None
        blocks: list[Block] = []
        for start in range(0, (len(tokens) - 1) // size * size, size):
            prev = hash_block(prev, tokens[start : start + size], request.cache_salt)
            block = self.pool.cached.get(prev)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Block] = (),
        keep_free: int = 0,
    ) -> bool:
        """Make room for the next num_new_tokens tokens; False (and no change) if short.

        computed_blocks, from get_computed_blocks at admission, become the head of the
        block table and count as computed. A shared block about to be written is first
        copied (copy-on-write); the (src, dst) pair goes to take_pending_copies.
        keep_free: blocks that must stay free afterwards (the admission watermark).
        """
        table, size, blocks = request.block_table, self.block_size, self.pool.blocks
        start = request.num_computed_tokens + len(computed_blocks) * size
        end = start + num_new_tokens
        num_needed = max(self.num_blocks_for(end) - len(table) - len(computed_blocks), 0)
        last = min(-(-end // size), len(table))  # blocks written this step that already exist
        shared = [i for i in range(start // size, last) if blocks[table[i]].ref_count > 1]
        revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_needed + len(shared) + revived + keep_free > self.pool.num_free:
            return False

        if computed_blocks:
            for block in computed_blocks:
                self.pool.touch(block)
                table.append(block.block_id)
            self._block_hashes[request.request_id] = [b.block_hash for b in computed_blocks]
            request.num_computed_tokens = start
        for i in shared:
            old, new = blocks[table[i]], self.pool.allocate()
            if i * size < start:  # the block already holds tokens: copy them over
                self._pending_copies.append((old.block_id, new.block_id))
            self.pool.release(old)
            table[i] = new.block_id
        for _ in range(num_needed):
            table.append(self.pool.allocate().block_id)
        if self.enable_prefix_caching:
            # Draft tokens past the request's known tokens may be rejected: their
            # blocks are cached once the tokens are real.
            self._cache_full_blocks(request, min(end, request.num_tokens))
        return True

    def trim(self, request: Request) -> None:
        """Release the blocks past those its tokens occupy (reached by a rejected draft).
        A contiguous request keeps its reservation."""
        keep = self.num_blocks_for(request.num_tokens)
        while len(request.block_table) > keep:
            self.pool.release(self.pool.blocks[request.block_table.pop()])

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Cached as soon as allocated: the model writes a step's KV before any attention
        # reads it, so a request admitted in the same step may already share the block.
        hashes = self._block_hashes.setdefault(request.request_id, [])
        tokens, size, salt = request.all_token_ids, self.block_size, request.cache_salt
        stored = None  # the run of blocks this call stores, for one BlockStored event
        for i in range(len(hashes), num_tokens // size):
            prev = hashes[-1] if hashes else None
            block_tokens = tokens[i * size : (i + 1) * size]
            hashes.append(hash_block(prev, block_tokens, salt))
            added = self.pool.cache(self.pool.blocks[request.block_table[i]], hashes[-1])
            if self.pool.events is None:
                continue
            if not added:
                stored = None
                continue
            # vLLM puts cache_salt in the extra keys of a request's first block only.
            extra = (salt,) if salt and i == 0 else None
            self._stored[hashes[-1]] = (prev, block_tokens, extra, i)
            if stored is None:
                stored = ("stored", [], prev, [], [])
                self.pool.events.append(stored)
            stored[1].append(hashes[-1])
            stored[3].extend(block_tokens)
            stored[4].append(extra)

    def free_outside_window(self, request: Request) -> int:
        """Release the request's leading blocks that no layer can read again; returns how
        many. Call it once the request's computed tokens are counted.

        With window W on every layer, the next token to compute, at position
        n = num_computed_tokens, sees positions from n - W + 1 on, and every later token
        sees less: blocks wholly before that position are never read again (by this
        request: a fork copies its table, FREED entries too). A released block that is in
        the prefix cache stays there: its KV depends only on its tokens' prefix, which its
        hash names, so another request may still reuse it.
        """
        if self.sliding_window is None:
            return 0
        table, rid = request.block_table, request.request_id
        first_seen = max(request.num_computed_tokens - self.sliding_window + 1, 0)
        end = min(first_seen // self.block_size, len(table))
        start = self._num_freed.get(rid, 0)
        for i in range(start, end):
            self.pool.release(self.pool.blocks[table[i]])
            table[i] = FREED
        if end <= start:
            return 0
        self._num_freed[rid] = end
        return end - start

    def free(self, request: Request) -> None:
        """Release the request's blocks; idempotent. The tail goes first so that the
        prefix cache evicts tails before the prefixes others are likelier to share."""
        for block_id in reversed(request.block_table):
            if block_id != FREED:
                self.pool.release(self.pool.blocks[block_id])
        request.block_table.clear()
        self._block_hashes.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares all of the parent's blocks; its first write copies a shared one."""
        if child.block_table:
            raise ValueError(f"fork target {child.request_id} already holds blocks")
        for block_id in parent.block_table:
            if block_id != FREED:
                self.pool.touch(self.pool.blocks[block_id])
        child.block_table.extend(parent.block_table)
        if parent.request_id in self._num_freed:
            self._num_freed[child.request_id] = self._num_freed[parent.request_id]
        num_full = child.num_computed_tokens // self.block_size
        self._block_hashes[child.request_id] = self._block_hashes.get(parent.request_id, [])[
            :num_full
        ]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies to do before this step's KV is written."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def stats(self, waiting_demand: int = 0) -> KVCacheStats:
        free = self.pool.num_free
        used = self.num_blocks - free
        return KVCacheStats(
            total=self.num_blocks,
            free=free,
            used=used,
            cached=len(self.pool.cached),
            free_ratio=free / self.num_blocks,
            demand=used + waiting_demand,
        )
