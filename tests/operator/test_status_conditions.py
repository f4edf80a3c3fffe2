"""Status and conditions, the controller's views of Pods, and the replicas it applies."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagedinfer.operator import status as st
from pagedinfer.operator.autoscaler import Decision, ScaleEvent
from pagedinfer.operator.controller import is_live, owner_name, pod_state
from pagedinfer.operator.resources import deployment_replicas
from pagedinfer.operator.spec import parse_spec

T0 = 1_800_000_000.0


def body(status: dict | None = None, generation: int = 3) -> dict:
    return {
        "apiVersion": "serving.pagedinfer.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "ns", "generation": generation},
        "spec": {},
        "status": status or {},
    }


def deployment(wanted: int, ready: int, updated: int | None = None, rolled: bool = True) -> dict:
    return {
        "metadata": {"generation": 5},
        "spec": {"replicas": wanted},
        "status": {
            "replicas": wanted,
            "readyReplicas": ready,
            "updatedReplicas": wanted if updated is None else updated,
            "observedGeneration": 5 if rolled else 4,
        },
    }


def conditions(update: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in update["conditions"]}


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    first = st.set_condition([], "Ready", True, "Serving", "1 replica", T0)
    again = st.set_condition(first, "Ready", True, "Serving", "2 replicas", T0 + 60)
    flipped = st.set_condition(again, "Ready", False, "NoReadyReplicas", "0", T0 + 120)
    assert again[0]["lastTransitionTime"] == st.rfc3339(T0)
    assert again[0]["message"] == "2 replicas"
    assert flipped[0]["lastTransitionTime"] == st.rfc3339(T0 + 120)
    assert st.parse_rfc3339(flipped[0]["lastTransitionTime"]) == T0 + 120


def test_conditions_come_in_a_stable_order() -> None:
    cs: list = []
    for type_ in ("ScalingActive", "MetricsAvailable", "Ready", "DeploymentReady"):
        cs = st.set_condition(cs, type_, None, "X", "", T0)
    assert [c["type"] for c in cs] == [
        "Ready",
        "DeploymentReady",
        "MetricsAvailable",
        "ScalingActive",
    ]
    assert all(c["status"] == "Unknown" for c in cs)


@pytest.mark.parametrize(
    "dep, ready, deployment_ready, counts",
    [
        (deployment(2, 2), ("True", "Serving"), ("True", "ReplicasReady"), (2, 2, 2)),
        (deployment(2, 1), ("True", "Serving"), ("False", "ReplicasNotReady"), (2, 1, 2)),
        (deployment(2, 0), ("False", "NoReadyReplicas"), ("False", "ReplicasNotReady"), (2, 0, 2)),
        (deployment(2, 2, rolled=False), ("True", "Serving"), ("False", "RollingOut"), (2, 2, 2)),
        (deployment(2, 2, updated=1), ("True", "Serving"), ("False", "RollingOut"), (2, 2, 2)),
        (deployment(0, 0), ("False", "NoReadyReplicas"), ("False", "ScaledToZero"), (0, 0, 0)),
        (None, ("False", "NoReadyReplicas"), ("False", "DeploymentMissing"), (0, 0, 0)),
    ],
    ids=["ready", "partly", "none", "old generation", "rolling", "zero", "missing"],
)
def test_deployment_status(dep, ready, deployment_ready, counts) -> None:
    update = st.deployment_status(body(), dep, T0)
    assert conditions(update)["Ready"] == ready
    assert conditions(update)["DeploymentReady"] == deployment_ready
    assert (update["replicas"], update["readyReplicas"], update["desiredReplicas"]) == counts
    assert update["observedGeneration"] == 3
    assert update["selector"] == "serving.pagedinfer.dev/inferenceservice=llm"
    assert update["url"] == "http://llm.ns.svc:8000"
    assert update["grpcUrl"] == "grpc://llm.ns.svc:50051"


def test_an_invalid_spec_is_not_ready_and_not_observed() -> None:
    update = st.deployment_status(body(), None, T0, invalid=["spec.replicas: no"])
    assert conditions(update) == {"Ready": ("False", "InvalidSpec")}
    assert update["conditions"][0]["message"] == "spec.replicas: no"
    assert "observedGeneration" not in update


def test_fixed_replicas_disable_the_autoscaling_conditions() -> None:
    update = st.static_scaling_status({}, T0)
    assert conditions(update) == {
        "MetricsAvailable": ("Unknown", "AutoscalingDisabled"),
        "ScalingActive": ("False", "AutoscalingDisabled"),
    }


def scale_up(**kw) -> Decision:
    defaults = dict(
        desired=3,
        reason="ScaleUp",
        message="2 -> 3: utilization 0.95 vs target 0.70 on 2 pod(s)",
        recommendation=3,
        utilization=0.95,
        free_ratio=0.05,
        pods_with_metrics=2,
    )
    return Decision(**{**defaults, **kw})


def test_a_scaling_action_is_recorded_in_the_status() -> None:
    update = st.autoscaling_status({}, scale_up(), current=2, errors={}, now=T0)
    auto = update["autoscaling"]
    assert update["desiredReplicas"] == 3
    assert auto["freeBlockRatio"] == 0.05 and auto["utilization"] == 0.95
    assert auto["history"] == [{"time": st.rfc3339(T0), "from": 2, "to": 3, "reason": "ScaleUp"}]
    assert auto["lastScaleTime"] == st.rfc3339(T0)
    assert auto["lastScaleReason"].startswith("2 -> 3")
    assert auto["lastDecision"].startswith("ScaleUp: 2 -> 3")
    assert conditions(update) == {
        "MetricsAvailable": ("True", "MetricsScraped"),
        "ScalingActive": ("True", "ScaleUp"),
    }
    assert st.history_events(update) == (ScaleEvent(T0, 2, 3),)


def test_the_history_keeps_the_last_ten_actions() -> None:
    status: dict = {}
    for i in range(12):
        status.update(st.autoscaling_status(status, scale_up(), 2, {}, T0 + i))
    assert len(status["autoscaling"]["history"]) == st.HISTORY_LENGTH
    assert status["autoscaling"]["history"][-1]["time"] == st.rfc3339(T0 + 11)


def test_holding_adds_no_history() -> None:
    hold = scale_up(desired=2, reason="WithinTolerance", message="holding at 2")
    update = st.autoscaling_status({}, hold, current=2, errors={}, now=T0)
    assert "history" not in update["autoscaling"]
    assert conditions(update)["ScalingActive"] == ("True", "WithinTolerance")


def test_missing_metrics_say_which_pods_and_why() -> None:
    decision = Decision(2, "NoMetrics", "holding at 2: no fresh metrics", missing=("a", "b"))
    errors = {"a": "timed out after 2s", "b": "HTTP 500"}
    update = st.autoscaling_status({}, decision, current=2, errors=errors, now=T0)
    metrics = next(c for c in update["conditions"] if c["type"] == "MetricsAvailable")
    assert (metrics["status"], metrics["reason"]) == ("False", "ScrapeFailed")
    assert metrics["message"] == "a: timed out after 2s; b: HTTP 500"
    assert conditions(update)["ScalingActive"] == ("False", "NoMetrics")
    assert "freeBlockRatio" not in update["autoscaling"]


def test_stale_samples_and_absent_pods_have_their_own_reasons() -> None:
    stale = Decision(2, "NoMetrics", "holding", missing=("a",))
    update = st.autoscaling_status({}, stale, 2, {}, T0)
    assert conditions(update)["MetricsAvailable"] == ("False", "NoFreshMetrics")
    nobody = Decision(2, "NoMetrics", "holding")
    update = st.autoscaling_status({}, nobody, 2, {}, T0)
    assert conditions(update)["MetricsAvailable"] == ("False", "NoReadyPods")


def test_many_failing_pods_are_summarised() -> None:
    pods = tuple(f"p{i}" for i in range(5))
    decision = scale_up(missing=pods)
    update = st.autoscaling_status({}, decision, 2, {p: "HTTP 500" for p in pods}, T0)
    metrics = next(c for c in update["conditions"] if c["type"] == "MetricsAvailable")
    assert metrics["message"].endswith("; and 2 more")


def test_changed_compares_only_the_updated_fields() -> None:
    assert not st.changed({"replicas": 2, "url": "x"}, {"replicas": 2})
    assert st.changed({"replicas": 2}, {"replicas": 3})


def pod(ready: str | None, since: str = "2027-01-15T08:00:00Z", **status) -> dict:
    conds = (
        [] if ready is None else [{"type": "Ready", "status": ready, "lastTransitionTime": since}]
    )
    return {
        "metadata": {"name": "p", **status.pop("meta", {})},
        "status": {"conditions": conds, **status},
    }


def test_pod_state_reads_the_ready_condition() -> None:
    assert pod_state(pod("True")).ready
    assert pod_state(pod("True")).ready_since == st.parse_rfc3339("2027-01-15T08:00:00Z")
    assert not pod_state(pod("False")).ready
    assert pod_state(pod("False")).ready_since is None
    assert not pod_state(pod(None)).ready


def test_terminating_and_finished_pods_do_not_count() -> None:
    assert is_live(pod("True", phase="Running"))
    assert is_live(pod(None, phase="Pending"))
    assert not is_live(pod("True", phase="Succeeded"))
    assert not is_live(pod("False", phase="Failed"))
    assert not is_live(
        pod("True", phase="Running", meta={"deletionTimestamp": "2027-01-01T00:00:00Z"})
    )


def test_children_are_traced_to_their_inferenceservice() -> None:
    ours = {
        "apiVersion": "serving.pagedinfer.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "a",
    }
    other = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "b"}
    assert owner_name({"metadata": {"ownerReferences": [other, ours]}}) == "a"
    assert owner_name({"metadata": {"ownerReferences": [other]}}) is None
    assert owner_name({"metadata": {}}) is None


@pytest.mark.parametrize(
    "spec, current, expected",
    [
        ({}, None, 1),
        ({"replicas": 0}, 5, 0),
        ({"replicas": 4}, 2, 4),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, None, 2),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 4, 4),  # the autoscaler's
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 9, 5),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 1, 2),
    ],
)
def test_replicas_applied_on_reconciliation(spec, current, expected) -> None:
    assert deployment_replicas(parse_spec(spec), current) == expected


def cli(*argv: str) -> argparse.Namespace:
    from pagedinfer.operator import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_cli_sets_kopfs_scope_and_peering() -> None:
    from pagedinfer.operator.main import kopf_kwargs

    kw = kopf_kwargs(cli("--namespace", "a", "-n", "b*", "--standalone"))
    assert kw["namespaces"] == ["a", "b*"] and "clusterwide" not in kw
    assert kw["standalone"] is True and "peering_name" not in kw
    kw = kopf_kwargs(cli("--all-namespaces", "--peering", "pagedinfer", "--priority", "7"))
    assert kw["clusterwide"] is True
    assert (kw["standalone"], kw["peering_name"], kw["priority"]) == (False, "pagedinfer", 7)
    assert kw["settings"].peering.mandatory is True
    assert kopf_kwargs(cli())["clusterwide"] is True
    with pytest.raises(SystemExit):
        cli("--standalone", "--peering", "x")
    with pytest.raises(SystemExit):
        cli("-A", "-n", "x")


def test_the_cli_settings() -> None:
    from pagedinfer.operator.main import kopf_kwargs

    kw = kopf_kwargs(
        cli("--liveness", "http://0.0.0.0:8080/healthz", "--default-image", "reg/pi:1")
    )
    settings = kw["settings"]
    assert kw["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert kw["memo"].options.default_image == "reg/pi:1"
    assert settings.persistence.finalizer == "serving.pagedinfer.dev/autoscaler"
    assert settings.posting.level == logging.WARNING
    assert settings.posting.reporting_component == "pagedinfer-operator"
    assert type(settings.persistence.progress_storage).__name__ == "AnnotationsProgressStorage"
    assert cli().default_image.startswith("pagedinfer:")
