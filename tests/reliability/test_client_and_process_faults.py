"""Faults outside the server's control: clients that open streams and stop reading, and
a server process killed with SIGKILL in the middle of its work."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_server import Server, collect, greedy, start_server, stop_server

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = pytest.mark.slow

STALLED_STREAMS = 12
STALLED_TOKENS = 160
# What a stalled stream may leave in the server's memory: its undelivered events (a few
# hundred bytes a token, in the engine's queue and the socket's send buffer), far below
# this; a server that buffered without bound, or leaked per request, would pass it.
STALLED_RSS_BOUND_MIB = 64


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def stalled_stream(port: int, prompt: str) -> socket.socket:
    """A streamed completion whose client never reads a byte of the answer, with a small
    receive buffer, so that the server's writes back up at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": prompt, "max_tokens": STALLED_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + body)
    return sock


def completion(port: int, prompt: str) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8,
                 "temperature": 0}), {"Content-Type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    return json.loads(response.read())


def test_clients_that_stop_reading_hold_no_memory_and_block_no_one(roomy_server: Server) -> None:
    server = roomy_server
    server.wait_all_blocks_free()
    completion(server.http_port, "Warm up:")  # the first request's one-off allocations
    idle = rss_mib(server.process.pid)
    stalled = [stalled_stream(server.http_port, f"Story {i}: once upon a time")
               for i in range(STALLED_STREAMS)]  # fmt: skip
    try:
        # Others are served meanwhile, in full.
        for i in range(3):
            assert completion(server.http_port, f"Question {i}:")["usage"]["completion_tokens"] == 8
        # The engine finishes the unread requests and frees their blocks: what is left of
        # them is bytes waiting for their readers, not KV cache.
        server.wait_all_blocks_free(timeout=300)
        peak = rss_mib(server.process.pid)
        print(f"\nstalled streams: RSS idle {idle:.0f} MiB, with {STALLED_STREAMS} unread "
              f"streams of {STALLED_TOKENS} tokens {peak:.0f} MiB")  # fmt: skip
        assert peak - idle < STALLED_RSS_BOUND_MIB
    finally:
        for sock in stalled:
            sock.close()
    server.wait_all_blocks_free()
    assert completion(server.http_port, "Still there?")["usage"]["completion_tokens"] == 8


@pytest.fixture
def doomed_server(tmp_path: Path) -> Iterator[Server]:
    server = start_server(tmp_path, "--max-model-len", "256")
    yield server
    if server.process.poll() is None:
        stop_server(server)


def test_a_server_killed_under_load_restarts_and_serves_from_its_caches(
    doomed_server: Server, roomy_server: Server, tmp_path: Path
) -> None:
    """SIGKILL leaves no chance to clean up: the other replica's requests must not
    notice, and the restarted server must not depend on anything the killed one would
    have closed (its ports, a lock on the converted model, the kernel cache it was
    reading), and serves again at once. (The operator's side, a pod whose metrics port
    stopped answering, is `test_operator_metrics_faults.py`'s.)"""
    calls = [doomed_server.generate(prompt=f"Count to fifty, {i}:", timeout=120,
                                    sampling=greedy(200, ignore_eos=True)) for i in range(4)]  # fmt: skip
    survivors = [roomy_server.generate(prompt=f"Count to twenty, {i}:", timeout=300,
                                       sampling=greedy(40, ignore_eos=True)) for i in range(4)]  # fmt: skip
    for call in calls + survivors:
        next(call)  # all eight are running, four on each replica
    os.kill(doomed_server.process.pid, signal.SIGKILL)
    assert doomed_server.process.wait(30) == -signal.SIGKILL
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:  # the connection is gone mid-stream
            collect(call)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    for call in survivors:  # the other replica's requests end in full
        assert collect(call)[-1].finish_reason == pb.LENGTH

    started = time.monotonic()
    # The same ports: a killed server leaves no listener behind.
    restarted = start_server(tmp_path / "restarted", "--max-model-len", "256",
                             ports=(doomed_server.port, doomed_server.metrics_port,
                                    doomed_server.http_port))  # fmt: skip
    try:
        ready = time.monotonic() - started
        responses = collect(restarted.generate(prompt="Hello again:", sampling=greedy(4)))
        answered = time.monotonic() - started
        assert responses[-1].finish_reason in (pb.STOP, pb.LENGTH)
        print(f"\nrestart after SIGKILL: serving in {ready:.1f} s, first answer in "
              f"{answered:.1f} s")  # fmt: skip
        restarted.wait_all_blocks_free()
    finally:
        assert stop_server(restarted) == 0
