"""A real server under faults: random cancellations mid-stream, overload at ten times
its capacity, and forced preemption. Each test ends by checking that every KV block is
free again and that the server still serves."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from reliability_servers import TIGHT_MAX_QUEUE, TIGHT_MAX_SEQS
from test_server import Server, collect, greedy

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = pytest.mark.slow


def prompt_ids(rng: random.Random, length: int) -> list[int]:
    """Token ids of ordinary words, so that prompts look like text to the model."""
    return [rng.randrange(1000, 20000) for _ in range(length)]


def served(server: Server) -> None:
    """The server still answers a plain request after whatever the test did."""
    responses = collect(server.generate(prompt="Still there?", sampling=greedy(2)))
    assert responses[-1].finish_reason in (pb.STOP, pb.LENGTH)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


# ------------------------------------------------------------------ cancellations

NUM_CANCELLATIONS = 200


def cancel_one(server: Server, seed: int) -> str:
    """One request cancelled at a random point; returns where it was cancelled.

    Points: right after sending (often still queued), after a random delay (often in
    prefill), or after 1-4 streamed messages (decoding). Some requests fork (n=2) and
    some share a prompt prefix, so aborts also release shared and copied blocks.
    """
    rng = random.Random(seed)
    shared = prompt_ids(random.Random(seed % 5), 32) if rng.random() < 0.4 else []
    request = {
        "prompt_token_ids": shared + prompt_ids(rng, rng.randint(2, 40)),
        "sampling": pb.SamplingParams(
            max_tokens=150, temperature=rng.choice([0.0, 0.8]), seed=seed, ignore_eos=True,
            n=rng.choice([1, 1, 1, 2]),
        ),
    }  # fmt: skip
    call = server.generate(timeout=120, **request)
    point = rng.choice(["sent", "delay", "streaming"])
    if point == "sent":
        call.cancel()
    elif point == "delay":
        threading.Timer(rng.uniform(0.0, 0.3), call.cancel).start()
    else:
        for _ in range(rng.randint(1, 4)):
            response = next(call)
            assert response.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        call.cancel()
    try:
        for response in call:
            assert response.finish_reason != pb.LENGTH, "150 tokens cannot finish in time"
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED, exc
    else:
        pytest.fail("a cancelled call ended without an error")
    return point


@pytest.mark.timeout(420)
def test_random_cancellations_mid_stream_leak_no_block(roomy_server: Server) -> None:
    server = roomy_server
    before = server.wait_all_blocks_free()
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        points = Counter(pool.map(lambda i: cancel_one(server, i), range(NUM_CANCELLATIONS)))
    after = server.wait_all_blocks_free(timeout=30)
    print(
        "\ncancellations:",
        json.dumps({
            "cancelled": NUM_CANCELLATIONS,
            "points": dict(points),
            "blocks_total": after["pagedinfer_kv_cache_blocks_total"],
            "blocks_free_after": after["pagedinfer_kv_cache_blocks_free"],
            "seconds": round(time.monotonic() - started, 1),
        }),
    )  # fmt: skip
    assert sum(points.values()) == NUM_CANCELLATIONS
    assert all(points[p] > 0 for p in ("sent", "delay", "streaming"))
    assert after["pagedinfer_kv_cache_blocks_free"] == before["pagedinfer_kv_cache_blocks_total"]
    served(server)


# ----------------------------------------------------------------------- overload


def overload_burst(server: Server, size: int, tag: str) -> tuple[Counter, list[float]]:
    """`size` requests at once; returns the outcomes and the server's RSS (MiB) sampled
    every 20 ms meanwhile."""
    rss, done = [rss_mib(server.process.pid)], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            rss.append(rss_mib(server.process.pid))

    def one(i: int) -> str:
        request = {
            "prompt_token_ids": prompt_ids(random.Random(f"{tag}-{i}"), 8),
            "sampling": greedy(6, ignore_eos=True),
        }
        try:
            responses = collect(server.generate(timeout=120, **request))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "queue" in exc.details()
            return exc.code().name
        last = responses[-1]
        assert (last.finish_reason, last.usage.completion_tokens) == (pb.LENGTH, 6)
        return "COMPLETED"

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        barrier = threading.Barrier(size)
        with ThreadPoolExecutor(size) as pool:
            outcomes = Counter(pool.map(lambda i: (barrier.wait(), one(i))[1], range(size)))
    finally:
        done.set()
        sampler.join()
    return outcomes, rss


# Everything that can grow with load is bounded by the configuration: the KV cache is
# allocated once at start-up, at most max_num_seqs + max_queue requests are admitted
# (a few KiB of token ids each), and one step's activations for at most
# max_num_batched_tokens (512) tokens are a few MiB for this model (hidden size 576,
# MLP 1536, logits only for the sampled rows). Refused calls cost one gRPC call each.
# 128 MiB over the idle RSS leaves room for the allocator's arenas and gRPC's buffers
# and still catches anything proportional to the offered load.
RSS_HEADROOM_MIB = 128
RSS_GROWTH_BETWEEN_BURSTS_MIB = 32


@pytest.mark.timeout(300)
def test_overload_at_ten_times_capacity(tight_server: Server) -> None:
    server = tight_server
    capacity = TIGHT_MAX_SEQS + TIGHT_MAX_QUEUE  # running plus waiting
    size = 10 * capacity
    server.wait_all_blocks_free()
    served(server)  # the allocator has seen a step before the baseline is taken
    idle = rss_mib(server.process.pid)
    first, rss_first = overload_burst(server, size, "first")
    server.wait_all_blocks_free()
    second, rss_second = overload_burst(server, size, "second")
    server.wait_all_blocks_free()

    for outcomes in (first, second):
        assert set(outcomes) <= {"COMPLETED", "RESOURCE_EXHAUSTED"}, outcomes
        assert outcomes["COMPLETED"] >= TIGHT_MAX_QUEUE  # the queue's worth was admitted
        assert outcomes["RESOURCE_EXHAUSTED"] >= size - 3 * capacity  # most was refused
    peak = max(rss_first + rss_second)
    print(
        "\noverload:",
        json.dumps({
            "capacity": capacity, "offered": size, "first": dict(first),
            "second": dict(second), "rss_idle_mib": round(idle),
            "rss_peak_mib": round(peak), "rss_bound_mib": round(idle + RSS_HEADROOM_MIB),
        }),
    )  # fmt: skip
    assert server.process.poll() is None, "the server crashed"
    assert peak <= idle + RSS_HEADROOM_MIB
    # A second identical burst does not leave more memory behind than the first.
    assert max(rss_second) <= max(rss_first) + RSS_GROWTH_BETWEEN_BURSTS_MIB
    served(server)


# --------------------------------------------------------------------- preemption


def generate_with_backpressure(server: Server, request: dict, deadline: float) -> list:
    """Retries while the server says its queue is full, as a well-behaved client does."""
    while True:
        try:
            return collect(server.generate(timeout=180, **request))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(420)
def test_greedy_output_is_identical_under_forced_preemption(
    tight_server: Server, roomy_server: Server
) -> None:
    """Six requests of 5 to 6 blocks each against an 8-block cache: they preempt each
    other over and over, and must produce exactly what a cache with room for all
    produces."""
    rng = random.Random("preemption")
    requests = [
        {"prompt_token_ids": prompt_ids(rng, rng.randint(40, 60)), "sampling": greedy(32)}
        for _ in range(6)
    ]
    tight_server.wait_all_blocks_free()
    preemptions_before = tight_server.metrics()["pagedinfer_preemptions_total"]
    deadline = time.monotonic() + 300
    outputs = {}
    for name, server in (("tight", tight_server), ("roomy", roomy_server)):
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(
                pool.map(lambda r: generate_with_backpressure(server, r, deadline), requests)  # noqa: B023
            )
        outputs[name] = [[t for r in responses for t in r.token_ids] for responses in results]
        server.wait_all_blocks_free()
    preemptions = tight_server.metrics()["pagedinfer_preemptions_total"] - preemptions_before
    print("\npreemption:", json.dumps({"requests": len(requests), "preemptions": preemptions}))
    assert preemptions > 0, "the tight cache never had to preempt"
    assert outputs["tight"] == outputs["roomy"]
    assert all(outputs["roomy"]), "every request produced tokens"
