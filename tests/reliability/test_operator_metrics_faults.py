"""The autoscaler when the metrics go wrong: it takes no action and says so.

tests/operator/test_operator_kmock.py::test_broken_metrics_change_nothing_and_say_why
already shows that garbage, a slow endpoint, HTTP 500 and a closed port block a
scale-up and set MetricsAvailable=False with the reason. This extends it to the other
direction and to partial failures: an idle fleet whose metrics break is not scaled
down, however long it stays broken; neither is one whose metrics parse but say
nonsense (NaN, a ratio above 1); one broken pod among healthy ones holds a scale-down
(HPA's conservative treatment of pods without metrics); and when the metrics come
back, MetricsAvailable turns True and scaling resumes.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_operator_kmock import (
    FAST_AUTOSCALING,
    condition,
    create,
    deployment,
    eventually,
    isvc,
    status,
)
from test_operator_kmock import events as events_of

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

WINDOW_S = 2  # the scale-down stabilisation window
POLICY = {
    **FAST_AUTOSCALING,
    "maxReplicas": 2,
    "scaleDown": {**FAST_AUTOSCALING["scaleDown"], "stabilizationWindowSeconds": WINDOW_S},
}


def nonsense(value: str):
    """An exposition that parses, with `value` as the free-block ratio."""

    def exposition() -> str:
        name = "pagedinfer_kv_cache_free_ratio"
        return f"# TYPE {name} gauge\n{name} {value}\n"

    return exposition


async def scaled_to_two(cluster, kubelet, name: str) -> None:
    kubelet.set_free_ratio(0.05)
    await create(cluster, isvc(name, {"autoscaling": POLICY}))
    await eventually(lambda: deployment(cluster, name)["spec"]["replicas"] == 2, timeout=20)
    await eventually(lambda: status(cluster, name)["autoscaling"]["podsWithMetrics"] == 2)


def metrics_unavailable(cluster, name: str, *pods: str) -> bool:
    """MetricsAvailable=False because scraping `pods` failed, each named in the message."""
    c = condition(cluster, name, "MetricsAvailable")
    named = all(pod in c["message"] for pod in pods)
    return c["status"] == "False" and c["reason"] == "ScrapeFailed" and named


async def holds_at_two(cluster, name: str, seconds: float) -> None:
    """Nothing is scaled for `seconds`, well past the scale-down window."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert deployment(cluster, name)["spec"]["replicas"] == 2
        assert events_of(cluster, "ScaledDown") == []
        await asyncio.sleep(0.1)


async def test_broken_metrics_never_scale_an_idle_fleet_down(cluster, operator, kubelet) -> None:
    await scaled_to_two(cluster, kubelet, "idle")
    pods = list(kubelet.pods.values())
    kubelet.set_free_ratio(0.95)  # idle now: it would scale down, if it could see that
    breakages = {
        "garbage": lambda pod: setattr(pod, "mode", "garbage"),
        "HTTP 500": lambda pod: setattr(pod, "mode", "error"),
        "slow": lambda pod: setattr(pod, "mode", "slow"),
        "NaN ratio": lambda pod: (setattr(pod, "mode", "ok"), setattr(pod, "exposition", nonsense("NaN"))),
        "ratio above 1": lambda pod: setattr(pod, "exposition", nonsense("1.5")),
    }  # fmt: skip
    for name, breakage in breakages.items():
        for pod in pods:
            breakage(pod)
        await eventually(lambda: metrics_unavailable(cluster, "idle", "idle-0", "idle-1"))
        await holds_at_two(cluster, "idle", WINDOW_S + 1)
        assert metrics_unavailable(cluster, "idle", "idle-0", "idle-1"), name
        assert condition(cluster, "idle", "ScalingActive")["reason"] == "NoMetrics", name

    # Metrics come back: they are believed again, and the idle fleet shrinks.
    for pod in pods:
        vars(pod).pop("exposition", None)
        pod.mode = "ok"
    await eventually(lambda: condition(cluster, "idle", "MetricsAvailable")["status"] == "True")
    await eventually(lambda: deployment(cluster, "idle")["spec"]["replicas"] == 1, timeout=20)
    (down,) = await eventually(lambda: events_of(cluster, "ScaledDown"))
    assert down["message"].startswith("2 -> 1")


async def test_one_pod_without_metrics_holds_a_scale_down(cluster, operator, kubelet) -> None:
    await scaled_to_two(cluster, kubelet, "half")
    healthy, broken = kubelet.pods["half-0"], kubelet.pods["half-1"]
    kubelet.set_free_ratio(0.95)
    broken.mode = "garbage"
    await eventually(lambda: metrics_unavailable(cluster, "half", "half-1"))
    assert "half-0" not in condition(cluster, "half", "MetricsAvailable")["message"]
    # The healthy pod alone would ask for one replica; the broken one counts as at
    # target, which keeps two.
    await holds_at_two(cluster, "half", WINDOW_S + 2)
    assert healthy.hits > 0

    broken.mode = "ok"
    await eventually(lambda: deployment(cluster, "half")["spec"]["replicas"] == 1, timeout=20)
