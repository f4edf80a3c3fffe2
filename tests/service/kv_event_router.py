"""A router's side of KV-cache events, written from vLLM's documented format alone: the
msgpack structs field by field, a ZeroMQ subscriber with replay, the index a
prefix-aware router keeps per pod, and the block keys it computes from token ids.

Nothing here imports pagedinfer: the tests check the server against what a router
written from the format would read.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq


# vLLM's structs (vllm/distributed/kv_events.py, positional layout): arrays, tagged by
# the class name, fields in this order.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def block_keys(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """The keys of a prompt's full blocks, as the server documents them: a SHA-256 chain
    over (previous digest, salt length and salt, tokens as int64 little-endian), sent as
    the last 8 bytes of each digest, big-endian."""
    keys, prev = [], b""
    salt_bytes = (salt or "").encode()
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        tokens = token_ids[start : start + block_size]
        prev = hashlib.sha256(
            prev
            + len(salt_bytes).to_bytes(4, "little")
            + salt_bytes
            + struct.pack(f"<{len(tokens)}q", *tokens)
        ).digest()
        keys.append(int.from_bytes(prev[-8:], "big"))
    return keys


@dataclass
class PodIndex:
    """What a router knows of one pod's cache, built from its events in order. Each
    event is checked against what came before (a removed block was stored, a stored
    block's parent is held, its tokens fill its blocks)."""

    blocks: dict[int, int | None] = field(default_factory=dict)  # key -> parent key
    tokens: dict[int, list[int]] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0
    cleared: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = event.block_size
                assert len(event.token_ids) == size * len(event.block_hashes)
                assert event.extra_keys is None or len(event.extra_keys) == len(event.block_hashes)
                parent = event.parent_block_hash
                assert parent is None or parent in self.blocks, "parent was never stored"
                for i, key in enumerate(event.block_hashes):
                    self.blocks[key] = parent
                    self.tokens[key] = event.token_ids[i * size : (i + 1) * size]
                    parent = key
                self.stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    assert key in self.blocks, "BlockRemoved names a block never stored"
                    del self.blocks[key]
                    del self.tokens[key]
                self.removed += len(event.block_hashes)
            else:
                self.blocks.clear()
                self.tokens.clear()
                self.cleared += 1

    def prefix_length(self, keys: list[int]) -> int:
        """Leading blocks of a prompt (its keys) that this pod holds."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n


class Subscriber:
    """A router's sockets on one pod: SUB on its events, DEALER on its replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def receive(self, timeout_ms: int = 10_000) -> tuple[bytes, int, bytes] | None:
        """One live message (topic, sequence, payload), or None after timeout_ms."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def replay(self, start: int = 0) -> list[tuple[int, bytes]]:
        """Every kept batch from sequence `start` on, as the replay socket sends them."""
        assert self.replay_endpoint is not None
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert sock.poll(10_000), "the replay socket did not answer"
                empty, seq, payload = sock.recv_multipart()
                assert empty == b""
                seq_no = int.from_bytes(seq, "big", signed=True)
                if seq_no == -1:
                    assert payload == b""
                    return out
                out.append((seq_no, payload))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def decode_all(replayed: list[tuple[int, bytes]]) -> list[KVEventBatch]:
    """Decoded batches, checking their sequence numbers run 0, 1, 2, ... without gaps."""
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    return [DECODER.decode(payload) for _, payload in replayed]
