"""The operator end to end against an emulated API server (kmock).

The test plays the rest of the cluster: it writes the InferenceServices, and a fake
kubelet writes Pods and Deployment status; each pod's /metrics is a real HTTP server
on 127.0.0.1 whose free-block ratio the test chooses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import kmock
import pytest
from operator_fakes import NAMESPACE as NS

from pagedinfer.operator.spec import GROUP, KIND, PLURAL, VERSION

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

ISVCS = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
OWNER_REF = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "controller": True}

FAST_AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targetFreeBlockRatio": 0.3,
    "tolerance": 0.1,
    "syncPeriodSeconds": 1,
    "scrapeTimeoutSeconds": 0.5,
    "metricStalenessSeconds": 30,
    "podWarmupSeconds": 0,
    "scaleUp": {"stabilizationWindowSeconds": 0, "pods": 1, "percent": 0, "periodSeconds": 1},
    "scaleDown": {"stabilizationWindowSeconds": 3, "pods": 1, "percent": 0, "periodSeconds": 1},
}


def isvc(name: str, spec: dict) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": spec,
    }


async def create(cluster: kmock.KubernetesEmulator, body: dict) -> None:
    response = await cluster.post(ISVCS, json=body)
    assert response.status in (200, 201), await response.text()


def get(cluster: kmock.KubernetesEmulator, resource: str, name: str) -> dict | None:
    key = (kmock.resource(resource), NS, name)
    if key not in cluster.objects or cluster.objects[key].deleted:
        return None
    return json.loads(json.dumps(cluster.objects[key].raw))


def deployment(cluster, name: str) -> dict | None:
    return get(cluster, "apps/v1/deployments", name)


def status(cluster, name: str) -> dict:
    return (get(cluster, f"{GROUP}/{VERSION}/{PLURAL}", name) or {}).get("status") or {}


def condition(cluster, name: str, type_: str) -> dict:
    return next((c for c in status(cluster, name).get("conditions", []) if c["type"] == type_), {})


def events(cluster, reason: str | None = None) -> list[dict]:
    found = []
    for (resource, _, _), obj in cluster.objects.items():
        if resource == "v1/events" and not obj.deleted:
            event = obj.raw
            if reason is None or event.get("reason") == reason:
                found.append(event)
    return found


async def eventually(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll `check` until it returns something truthy without raising."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
            last = result
        except (KeyError, TypeError, AssertionError, IndexError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s; last: {last!r}")


async def test_creation_yields_an_owned_deployment_and_service(cluster, operator, kubelet) -> None:
    await create(cluster, isvc("static", {"replicas": 2, "model": {"name": "smol"}}))

    dep = await eventually(lambda: deployment(cluster, "static"))
    assert dep["spec"]["replicas"] == 2
    assert OWNER_REF.items() <= dep["metadata"]["ownerReferences"][0].items()
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-static"
    svc = await eventually(lambda: get(cluster, "v1/services", "static"))
    assert OWNER_REF.items() <= svc["metadata"]["ownerReferences"][0].items()
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    # The fake kubelet makes both replicas ready; the printer columns fill in.
    await eventually(lambda: condition(cluster, "static", "DeploymentReady")["status"] == "True")
    st = status(cluster, "static")
    assert (st["replicas"], st["readyReplicas"], st["desiredReplicas"]) == (2, 2, 2)
    assert condition(cluster, "static", "Ready")["status"] == "True"
    assert condition(cluster, "static", "ScalingActive")["reason"] == "AutoscalingDisabled"
    assert st["selector"] == "serving.pagedinfer.dev/inferenceservice=static"
    assert st["url"] == f"http://static.{NS}.svc:8000"
    assert st["grpcUrl"] == f"grpc://static.{NS}.svc:50051"
    assert st["observedGeneration"] == 1
    # A fixed-size InferenceService needs no finalizer.
    body = get(cluster, f"{GROUP}/{VERSION}/{PLURAL}", "static")
    assert not body["metadata"].get("finalizers")


async def test_a_spec_update_updates_the_deployment(cluster, operator) -> None:
    await create(cluster, isvc("updated", {"replicas": 1}))
    await eventually(lambda: deployment(cluster, "updated"))

    patch = {"spec": {"replicas": 3, "engine": {"blockSize": 32}}}
    response = await cluster.patch(f"{ISVCS}/updated", json=patch)
    assert response.status == 200

    dep = await eventually(
        lambda: (d := deployment(cluster, "updated"))["spec"]["replicas"] == 3 and d
    )
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--block-size") + 1] == "32"
    await eventually(lambda: status(cluster, "updated")["observedGeneration"] == 2)


async def test_a_deleted_deployment_and_service_come_back(cluster, operator) -> None:
    await create(cluster, isvc("phoenix", {"replicas": 1}))
    await eventually(lambda: deployment(cluster, "phoenix"))
    await eventually(lambda: get(cluster, "v1/services", "phoenix"))

    await cluster.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/phoenix")
    await cluster.delete(f"/api/v1/namespaces/{NS}/services/phoenix")
    assert deployment(cluster, "phoenix") is None

    dep = await eventually(lambda: deployment(cluster, "phoenix"))
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-phoenix"
    await eventually(lambda: get(cluster, "v1/services", "phoenix"))


async def test_autoscales_up_on_a_low_free_ratio_and_down_after_the_window(
    cluster, operator, kubelet
) -> None:
    kubelet.set_free_ratio(0.05)  # 95% of the KV cache in use, the target is 70%
    await create(cluster, isvc("auto", {"autoscaling": FAST_AUTOSCALING}))

    # One pod per period (the rate cap) up to maxReplicas.
    await eventually(lambda: deployment(cluster, "auto")["spec"]["replicas"] == 3, timeout=20)
    ups = await eventually(lambda: len(e := events(cluster, "ScaledUp")) == 2 and e)
    assert [e["message"].split(":")[0] for e in ups] == ["1 -> 2", "2 -> 3"]
    assert all(e["type"] == "Normal" for e in ups)
    assert ups[0]["involvedObject"]["name"] == "auto"

    st = await eventually(
        lambda: (s := status(cluster, "auto"))["autoscaling"]["podsWithMetrics"] == 3 and s
    )
    assert st["autoscaling"]["freeBlockRatio"] == pytest.approx(0.05)
    assert [(h["from"], h["to"]) for h in st["autoscaling"]["history"]] == [(1, 2), (2, 3)]
    assert condition(cluster, "auto", "MetricsAvailable")["status"] == "True"
    assert condition(cluster, "auto", "ScalingActive")["status"] == "True"
    assert st["desiredReplicas"] == 3
    print("\nscale-up Event:", json.dumps(ups[0], indent=2))
    print("status after scaling up:", json.dumps(st, indent=2))
    # Autoscaled objects carry kopf's finalizer: it stops their autoscaler first.
    body = get(cluster, f"{GROUP}/{VERSION}/{PLURAL}", "auto")
    assert body["metadata"]["finalizers"] == ["serving.pagedinfer.dev/autoscaler"]

    # Idle now: nothing happens inside the 3 s scale-down window, then one pod per period.
    idle_since = time.monotonic()
    kubelet.set_free_ratio(0.9)
    await eventually(lambda: deployment(cluster, "auto")["spec"]["replicas"] == 1, timeout=20)
    assert time.monotonic() - idle_since >= 3.0
    downs = await eventually(lambda: len(e := events(cluster, "ScaledDown")) == 2 and e)
    assert [e["message"].split(":")[0] for e in downs] == ["3 -> 2", "2 -> 1"]

    # Deleting it stops the autoscaler, and kopf lets the object go.
    await cluster.delete(f"{ISVCS}/auto")
    await eventually(lambda: get(cluster, f"{GROUP}/{VERSION}/{PLURAL}", "auto") is None)


async def test_broken_metrics_change_nothing_and_say_why(
    cluster, operator, kubelet, fake_pods
) -> None:
    kubelet.set_free_ratio(0.05)  # would scale up, if the operator could read it
    kubelet.set_mode("garbage")
    body = isvc("blind", {"autoscaling": FAST_AUTOSCALING})
    # the fake kubelet starts pods with the mode of those already there: set it early
    await create(cluster, body)
    pod = await eventually(lambda: kubelet.pods.get("blind-0"))
    pod.mode = "garbage"

    def metrics_condition(reason: str, text: str) -> bool:
        c = condition(cluster, "blind", "MetricsAvailable")
        return c["status"] == "False" and c["reason"] == reason and text in c["message"]

    await eventually(lambda: metrics_condition("ScrapeFailed", "unparseable"))
    pod.mode = "slow"
    await eventually(lambda: metrics_condition("ScrapeFailed", "timed out after 0.5s"))
    pod.mode = "error"
    await eventually(lambda: metrics_condition("ScrapeFailed", "HTTP 500"))
    await fake_pods.stop(pod)
    await eventually(lambda: metrics_condition("ScrapeFailed", "ClientConnectorError"))

    assert deployment(cluster, "blind")["spec"]["replicas"] == 1
    assert events(cluster, "ScaledUp") == []
    assert condition(cluster, "blind", "ScalingActive")["reason"] == "NoMetrics"
    assert "history" not in status(cluster, "blind").get("autoscaling", {})


async def test_api_errors_are_retried(cluster, operator, kubelet) -> None:
    cluster["fetch apps/v1/deployments"][:3] << kmock.KubernetesError(
        status=500, reason="InternalError", message="etcdserver: request timed out"
    )
    cluster["patch", kmock.resource(f"{GROUP}/{VERSION}/{PLURAL}"), kmock.subresource("status")][
        :1
    ] << kmock.KubernetesError(
        status=409, reason="Conflict", message="the object has been modified"
    )
    await create(cluster, isvc("flaky", {"replicas": 1}))

    await eventually(lambda: deployment(cluster, "flaky"))
    await eventually(lambda: condition(cluster, "flaky", "Ready")["status"] == "True")
    assert len(cluster["fetch apps/v1/deployments"]) > 3
    assert operator.is_alive()


async def test_an_invalid_spec_is_refused_with_a_reason(cluster, operator) -> None:
    # Both replicas and autoscaling: the CRD's CEL rule refuses it on a real API server;
    # the emulator lets it through, so the operator's own check must catch it.
    await create(cluster, isvc("confused", {"replicas": 2, "autoscaling": FAST_AUTOSCALING}))

    ready = await eventually(lambda: condition(cluster, "confused", "Ready"))
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "mutually exclusive" in ready["message"]
    warning = await eventually(lambda: events(cluster, "InvalidSpec"))
    assert warning[0]["type"] == "Warning"
    assert deployment(cluster, "confused") is None
