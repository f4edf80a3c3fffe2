"""KV-cache events for prefix-aware routers, published as vLLM publishes them.

A router that knows which pod holds which prefix blocks sends each request to the pod
with the longest cached prefix (llm-d's precise prefix-cache scorer does this). The
block manager records what enters and leaves its prefix cache; once per engine step
the engine hands those records to `KVEventPublisher`, which encodes and sends them on
its own thread, so the step never waits on a socket.

Wire format (vLLM's `--kv-events-config` publisher, `vllm/distributed/kv_events.py`):
each message is three ZeroMQ frames, `topic`, an 8-byte big-endian sequence number
(0, 1, 2, ... per process) and a msgpack `KVEventBatch`. Every struct is encoded as a
msgpack array (msgspec `array_like`), events tagged by their class name in front:

    KVEventBatch     [ts, [event, ...], data_parallel_rank]
    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids,
                      block_size, lora_id, medium, lora_name, extra_keys, group_idx]
    BlockRemoved     ["BlockRemoved", block_hashes, medium, group_idx]
    AllBlocksCleared ["AllBlocksCleared"]

This positional layout is the one every consumer reads: llm-d's kv-cache indexer,
Dynamo and AIBrix decode it, and the indexers that also accept vLLM's newer map
layout still accept it.

Block hashes (`block_manager.hash_block`): block i of a request, tokens
`t[i*B:(i+1)*B]` for block size B, has the SHA-256 chain
`h_i = sha256(h_{i-1} || len(salt) as 4 bytes little-endian || salt || tokens as
int64 little-endian)`, with `h_{-1}` empty and `salt` the request's UTF-8 `cache_salt`
(empty when none). No per-process seed goes in, so every replica and every restart
names the same prefix the same. On the wire a hash is the integer of the digest's last
8 bytes, big-endian (vLLM's integer block hashes). A router can compute the keys from
token ids itself, or key its index by the `token_ids` each `BlockStored` carries, as
llm-d's indexer does. A salted request's first block carries `extra_keys` `[salt]`,
as vLLM puts `cache_salt` in the first block's extra keys only.

Delivery: a publisher that binds (`tcp://*:5557`) serves subscribers that connect; one
that connects (`tcp://router:5557`) feeds a router that binds, llm-d's default layout.
The first batch of every process is `AllBlocksCleared`, so a router forgets what a
restarted pod held. A subscriber that saw a gap in the sequence numbers asks the
ROUTER socket at `replay_endpoint` (frames: empty, 8-byte start sequence) and gets
every kept batch from there (frames: empty, sequence, payload), then sequence -1 with
an empty payload. When nobody drains the queue (a dead socket), batches are dropped
and counted (`dropped`) rather than stalling the engine; the next batch that fits then
starts with `AllBlocksCleared` and the whole cache stored again, so the router's view
is whole once more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgspec

log = logging.getLogger(__name__)

PUBLISHERS = ("zmq", "null")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

# What the block manager records, converted to wire structs on the publisher thread.
# ("stored", hashes, parent_hash, token_ids, extra_keys) | ("removed", hashes) | ("cleared",)
RawEvent = tuple


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are on, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                "kv-events-config: enable_kv_cache_events must be true or false, "
                f"got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv-events-config: replay_endpoint must be a string or null")
        if self.active and not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                "kv-events-config: endpoint must be a tcp://, ipc:// or inproc:// address, "
                f"got {self.endpoint!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"kv-events-config: {name} must be a positive integer, got {value!r}"
                )

    @property
    def active(self) -> bool:
        """Events on and a publisher that sends them."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(value: str | Mapping[str, Any] | KVEventsConfig) -> KVEventsConfig:
    """A `KVEventsConfig` from JSON text or a mapping; ValueError naming a bad field."""
    if isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError("kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"kv-events-config: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    return KVEventsConfig(**value)


# -- the wire structs (vLLM's field order) --------------------------------------------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events: encoded as an array whose first element is the class name."""


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


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_hash(block_hash: bytes) -> int:
    """A block hash as vLLM sends it: the digest's last 8 bytes as a big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")


def to_wire(raw: RawEvent, block_size: int, medium: str) -> KVCacheEvent:
    """One block-manager record as its wire struct."""
    kind = raw[0]
    if kind == "stored":
        _, hashes, parent, token_ids, extra_keys = raw
        return BlockStored(
            block_hashes=[wire_hash(h) for h in hashes],
            parent_block_hash=None if parent is None else wire_hash(parent),
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=extra_keys,
            group_idx=0,
        )
    if kind == "removed":
        return BlockRemoved(block_hashes=[wire_hash(h) for h in raw[1]], medium=medium, group_idx=0)
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event record {kind!r}")


class KVEventPublisher:
    """Sends the engine's KV events over ZeroMQ from a thread of its own.

    `publish` (the engine thread) only enqueues; the thread encodes, numbers and sends
    each batch, keeps the last `buffer_steps` for replay, and answers replay requests.
    `snapshot` returns the records that store the whole cache again (the block
    manager's `cached_block_events`); it runs on the engine thread after a drop.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        block_size: int,
        medium: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import zmq

        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.dropped = 0  # batches dropped because the queue was full
        self.published = 0  # batches sent
        self.thread_cpu_seconds = 0.0  # the publisher thread's CPU time on batches
        self._queued = 0  # batches accepted by publish
        self._sent = threading.Condition()
        self._clock = clock
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._resync = False
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv-events-config: cannot open {config.endpoint!r}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.publish([("cleared",)])  # a restarted process holds nothing

    @property
    def resync_pending(self) -> bool:
        """A batch was dropped: the next one must store the whole cache again."""
        return self._resync

    @property
    def endpoint(self) -> str:
        """The PUB socket's address, with the port a `:0` or `*` bind was given."""
        return self._pub.getsockopt_string(_zmq().LAST_ENDPOINT)

    @property
    def replay_address(self) -> str | None:
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(_zmq().LAST_ENDPOINT)

    def publish(
        self, events: list[RawEvent], snapshot: Callable[[], list[RawEvent]] | None = None
    ) -> bool:
        """Queue one step's events; False (counted in `dropped`) when the queue is full.

        After a drop the next batch that fits is prefixed with `AllBlocksCleared` and
        `snapshot()`, the records of every block cached now.
        """
        if self._resync and snapshot is not None:
            # The snapshot is the cache as it is now, these events included.
            events = [("cleared",), *snapshot()]
        batch = KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=0)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            self._resync = True
            return False
        self._resync = False
        self._queued += 1
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every accepted batch is sent; False if `timeout` passed first."""
        with self._sent:
            return self._sent.wait_for(lambda: self.published >= self._queued, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        # A moment for the last batches to leave; a subscriber that is gone costs no more.
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            start = time.thread_time()
            batch.events = [to_wire(e, self.block_size, self.medium) for e in batch.events]
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload))
            except Exception:  # the socket is closing: keep the batch for replay
                log.exception("KV event batch %d was not sent", seq)
            self._buffer.append((seq, payload))
            seq += 1
            self.thread_cpu_seconds += time.thread_time() - start
            with self._sent:
                self.published = seq
                self._sent.notify_all()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport binds; a host name connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _zmq():
    import zmq

    return zmq


def create_publisher(
    config: KVEventsConfig | None, block_size: int, medium: str
) -> KVEventPublisher | None:
    """The publisher `config` asks for, or None when events are off or go nowhere."""
    if config is None or not config.active:
        return None
    return KVEventPublisher(config, block_size, medium)
