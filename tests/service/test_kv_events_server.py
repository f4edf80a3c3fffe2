"""`pagedinfer serve --kv-events-config`, end to end: a real server process publishes the
blocks of a gRPC request, a router decodes them, and after a restart on the same ports
the new process starts its sequence over with AllBlocksCleared and names the same
prompt's blocks alike."""

from __future__ import annotations

import json
import time

import pytest
from kv_event_router import AllBlocksCleared, BlockStored, Subscriber, block_keys, decode_all
from test_server import free_ports, greedy, start_server, stop_server

pytestmark = pytest.mark.slow

PROMPT = [(i * 37) % 40000 + 100 for i in range(3 * 16 + 5)]


def published(subscriber: Subscriber, wanted, deadline_s: float = 60) -> list:
    """The batches published so far, once `wanted(batches)` holds (the publisher sends
    on its own thread, a moment after the step that made the events)."""
    deadline = time.monotonic() + deadline_s
    while True:
        batches = decode_all(subscriber.replay(0))
        if wanted(batches) or time.monotonic() > deadline:
            return batches
        time.sleep(0.2)


def stored_keys(batches) -> list[int]:
    return [
        k for b in batches for e in b.events if isinstance(e, BlockStored) for k in e.block_hashes
    ]


def test_a_served_request_is_published_and_a_restart_starts_over(
    tmp_path, make_tiny_model, monkeypatch
):
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")
    ports = free_ports(3)
    events_port, replay_port = free_ports(2)
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv@pod-0@tiny",
    }
    model = str(make_tiny_model("llama"))
    args = ("--model", model, "--max-model-len", "256", "--kv-events-config", json.dumps(config))
    runs = []
    for run in ("first", "restarted"):
        server = start_server(tmp_path / run, *args, ports=tuple(ports))
        subscriber = Subscriber(f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}")
        try:
            outputs = list(server.generate(prompt_token_ids=PROMPT, sampling=greedy(4)))
            assert outputs[-1].finish_reason
            batches = published(subscriber, lambda b: len(stored_keys(b)) >= 3)
            metrics = server.metrics()
        finally:
            subscriber.close()
            assert stop_server(server) == 0
        runs.append(batches)
        assert metrics["pagedinfer_kv_events_dropped_total"] == 0
    for batches in runs:
        # A new process: its sequence starts at 0 (decode_all checks), with a clear.
        assert isinstance(batches[0].events[0], AllBlocksCleared)
        assert stored_keys(batches) == block_keys(PROMPT, 16)
