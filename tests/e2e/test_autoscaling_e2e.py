"""The design's promise end to end: load rises, the free-block ratio falls, the operator
adds a replica; the load stops, and after the stabilisation window it removes it again;
no request fails on the way.

The operator runs against the emulated API server (kmock). The test plays kubelet: it
runs the operator's Deployment as real `pagedinfer serve` processes on 127.0.0.1 (see
server_kubelet.py), with an 8-block KV cache so that a few concurrent requests saturate
a replica, and drives them with a gRPC load generator, round robin over the ready pods.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter

import pytest
from server_kubelet import LoadGenerator, ServerKubelet
from test_operator_kmock import condition, create, deployment, events, eventually, isvc, status

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

STARTUP_S = 240  # a server loads and warms up the model in 10-30 s; slower on a busy CPU
TARGET_FREE_RATIO = 0.3
SCALE_DOWN_WINDOW_S = 6
ENGINE = {"numGpuBlocks": 8, "maxModelLen": 128, "maxNumSeqs": 4}
# 40-token prompts and 4 new tokens: a request holds 3 of the 8 blocks, so two run on a
# replica and the others wait. Eight workers ask for about three times one
# replica's cache, and still for about 1.5 times each of two: the load keeps both
# replicas above the target until it stops (with less, the operator rightly takes the
# second replica away again while the load still runs).
WORKERS, PROMPT_TOKENS, MAX_TOKENS = 8, 40, 4
AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "targetFreeBlockRatio": TARGET_FREE_RATIO,
    "tolerance": 0.1,
    "syncPeriodSeconds": 1,
    "scrapeTimeoutSeconds": 2,
    "metricStalenessSeconds": 30,
    "podWarmupSeconds": 0,
    "scaleUp": {"stabilizationWindowSeconds": 0, "pods": 1, "percent": 0, "periodSeconds": 1},
    "scaleDown": {
        "stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
        "pods": 1,
        "percent": 0,
        "periodSeconds": 1,
    },
}


def utilization_of(event: dict) -> float:
    return float(re.search(r"utilization ([\d.]+)", event["message"]).group(1))


async def note_events(cluster, seen: dict[str, float]) -> None:
    """When each Event was first seen (monotonic clock), polling every 0.1 s."""
    while True:
        for event in events(cluster):
            seen.setdefault(event["metadata"]["name"], time.monotonic())
        await asyncio.sleep(0.1)


@pytest.mark.timeout(900)
async def test_scales_up_under_load_and_back_down_when_it_stops(
    cluster, operator, server_kubelet: ServerKubelet
) -> None:
    kubelet = server_kubelet
    started = time.monotonic()
    seen: dict[str, float] = {}
    watcher = asyncio.create_task(note_events(cluster, seen))
    spec = {
        "model": {"name": "smollm2"},
        "engine": ENGINE,
        "autoscaling": AUTOSCALING,
        "lifecycle": {"preStopSleepSeconds": 1},
    }
    await create(cluster, isvc("llm", spec))

    # One replica, idle: it is scraped, and nothing is scaled.
    await eventually(lambda: len(kubelet.ready) == 1, timeout=STARTUP_S)
    (first,) = kubelet.ready
    await eventually(lambda: condition(cluster, "llm", "MetricsAvailable")["status"] == "True")
    assert status(cluster, "llm")["autoscaling"]["freeBlockRatio"] == 1.0
    # The engine settings of the InferenceService reached the server.
    assert first.server.metrics()["pagedinfer_kv_cache_blocks_total"] == ENGINE["numGpuBlocks"]
    assert deployment(cluster, "llm")["spec"]["replicas"] == 1 and not events(cluster)
    first_ready_s = time.monotonic() - started

    # Load: the cache fills, demand passes it, the operator adds a replica.
    load = LoadGenerator(lambda: kubelet.ready, WORKERS, PROMPT_TOKENS, MAX_TOKENS)
    load_started = time.monotonic()
    load.start()
    try:
        (up,) = await eventually(lambda: events(cluster, "ScaledUp"), timeout=120)
        await eventually(lambda: up["metadata"]["name"] in seen)
        scaled_up_s = seen[up["metadata"]["name"]] - load_started
        assert up["message"].startswith("1 -> 2")
        assert utilization_of(up) > (1 - TARGET_FREE_RATIO) * (1 + AUTOSCALING["tolerance"])
        assert deployment(cluster, "llm")["spec"]["replicas"] == 2
        # The new replica joins the round robin once its readiness probe passes ...
        await eventually(lambda: len(kubelet.ready) == 2, timeout=STARTUP_S)
        second = next(r for r in kubelet.ready if r is not first)
        both_ready = time.monotonic()
        second_ready_s = both_ready - load_started
        # ... and serves its share of the requests.
        await eventually(
            lambda: sum(o.replica == second.name for o in load.outcomes) >= 4, timeout=120
        )
        decisions = [(e["reason"], e["message"]) for e in events(cluster)]
        assert decisions == [("ScaledUp", up["message"])], "no other decision under load"
    finally:
        load_stopped = time.monotonic()
        await asyncio.to_thread(load.stop)  # sends nothing more; waits for those in flight

    # Idle again: the replica goes, after the scale-down window.
    (down,) = await eventually(lambda: events(cluster, "ScaledDown"), timeout=120)
    await eventually(lambda: down["metadata"]["name"] in seen)
    watcher.cancel()
    scaled_down_s = seen[down["metadata"]["name"]] - load_stopped
    assert down["message"].startswith("2 -> 1")
    # Until the load stopped, every recommendation was 2 or more.
    assert scaled_down_s >= SCALE_DOWN_WINDOW_S - AUTOSCALING["syncPeriodSeconds"]
    await eventually(lambda: second.name in kubelet.exits, timeout=60)
    assert kubelet.exits[second.name] == 0, "the removed replica shut down cleanly"
    assert [r.name for r in kubelet.ready] == [first.name]

    # Each decision is in the status history, and the metrics are still flowing.
    history = status(cluster, "llm")["autoscaling"]["history"]
    assert [(h["from"], h["to"]) for h in history] == [(1, 2), (2, 1)]
    assert condition(cluster, "llm", "MetricsAvailable")["status"] == "True"
    assert condition(cluster, "llm", "Ready")["status"] == "True"

    # No request failed, and each got all its tokens.
    failed = [o for o in load.outcomes if o.code != "OK"]
    assert not failed, failed[:5]
    assert all(
        (o.finish_reason, o.completion_tokens) == (pb.LENGTH, MAX_TOKENS) for o in load.outcomes
    )
    assert not kubelet.errors, kubelet.errors
    # Round robin: of the requests sent once both replicas were ready, each got half
    # (give or take a request whose worker picked its turn just as the second joined).
    shares = Counter(o.replica for o in load.outcomes if o.started_at > both_ready)
    assert abs(shares[first.name] - shares[second.name]) <= 2, shares

    per_replica = {
        name: sum(o.replica == name for o in load.outcomes) for name in (first.name, second.name)
    }
    figures = {
        "first_replica_ready_s": round(first_ready_s, 1),
        "scale_up_after_load_s": round(scaled_up_s, 1),
        "scale_up_utilization": utilization_of(up),
        "second_replica_ready_after_load_s": round(second_ready_s, 1),
        "scale_down_after_load_stop_s": round(scaled_down_s, 1),
        "requests": len(load.outcomes),
        "failed": len(failed),
        "requests_per_replica": per_replica,
        "requests_per_replica_once_both_ready": dict(shares),
        "events": [e["message"] for e in (up, down)],
    }
    print("\nautoscaling end to end:", json.dumps(figures))
