"""The InferenceService's status, computed from what the operator sees: pure functions.

Conditions:
- DeploymentReady: every replica the Deployment wants is ready and up to date;
- Ready: at least one replica serves (what `kubectl wait --for=condition=Ready` waits on);
- MetricsAvailable: every ready, warmed-up pod gave fresh KV-cache metrics;
- ScalingActive: the autoscaler could compute a recommendation (its reason is the last
  decision's).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from pagedinfer.operator.autoscaler import Decision, ScaleEvent
from pagedinfer.operator.resources import grpc_url, selector_string, service_url

HISTORY_LENGTH = 10


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: float,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """`conditions` with `type_` set; its transition time moves only when its status does."""
    value = "Unknown" if status is None else ("True" if status else "False")
    old = next((c for c in conditions if c.get("type") == type_), None)
    changed = old is None or old.get("status") != value
    new: dict[str, Any] = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": rfc3339(now) if changed else old.get("lastTransitionTime"),
    }
    if generation is not None:
        new["observedGeneration"] = generation
    others = [dict(c) for c in conditions if c.get("type") != type_]
    return sorted([*others, new], key=lambda c: CONDITION_ORDER.get(c["type"], 99))


CONDITION_ORDER = {"Ready": 0, "DeploymentReady": 1, "MetricsAvailable": 2, "ScalingActive": 3}


def deployment_status(
    body: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    now: float,
    invalid: Sequence[str] = (),
) -> dict[str, Any]:
    """The status fields that follow from the Deployment (None: it is missing)."""
    meta = body["metadata"]
    status = dict(body.get("status") or {})
    conditions = status.get("conditions") or []
    generation = meta.get("generation")
    fields: dict[str, Any] = {
        "selector": selector_string(meta["name"]),
        "url": service_url(body),
        "grpcUrl": grpc_url(body),
    }
    if invalid:
        message = "; ".join(invalid)
        conditions = set_condition(conditions, "Ready", False, "InvalidSpec", message, now)
        return {**fields, "conditions": conditions}

    fields["observedGeneration"] = generation
    if deployment is None:
        wanted = ready = replicas = 0
        dep_ok, dep_reason, dep_message = False, "DeploymentMissing", "the Deployment is missing"
    else:
        dep_status = deployment.get("status") or {}
        wanted = int((deployment.get("spec") or {}).get("replicas", 1))
        replicas = int(dep_status.get("replicas", 0))
        ready = int(dep_status.get("readyReplicas", 0))
        updated = int(dep_status.get("updatedReplicas", 0))
        rolled_out = dep_status.get("observedGeneration", 0) >= deployment["metadata"].get(
            "generation", 0
        )
        dep_ok = wanted > 0 and ready >= wanted and updated >= wanted and rolled_out
        if dep_ok:
            dep_reason, dep_message = "ReplicasReady", f"{ready}/{wanted} replicas ready"
        elif wanted == 0:
            dep_reason, dep_message = "ScaledToZero", "no replicas are wanted"
        else:
            dep_reason = "ReplicasNotReady" if rolled_out and updated >= wanted else "RollingOut"
            dep_message = f"{ready}/{wanted} replicas ready, {updated} up to date"
    fields.update(replicas=replicas, readyReplicas=ready, desiredReplicas=wanted)
    conditions = set_condition(
        conditions, "DeploymentReady", dep_ok, dep_reason, dep_message, now, generation
    )
    if ready > 0:
        conditions = set_condition(
            conditions, "Ready", True, "Serving", f"{ready} replica(s) serving", now, generation
        )
    else:
        conditions = set_condition(
            conditions, "Ready", False, "NoReadyReplicas", dep_message, now, generation
        )
    return {**fields, "conditions": conditions}


def static_scaling_status(status: Mapping[str, Any], now: float) -> dict[str, Any]:
    """Conditions of an InferenceService with a fixed replica count."""
    conditions = status.get("conditions") or []
    why = "replicas is fixed by spec.replicas (or the scale subresource)"
    conditions = set_condition(
        conditions, "MetricsAvailable", None, "AutoscalingDisabled", why, now
    )
    conditions = set_condition(conditions, "ScalingActive", False, "AutoscalingDisabled", why, now)
    return {"conditions": conditions}


def autoscaling_status(
    status: Mapping[str, Any],
    decision: Decision,
    current: int,
    errors: Mapping[str, str],
    now: float,
) -> dict[str, Any]:
    """Status after one autoscaler run: what it measured, decided, and any scaling."""
    conditions = status.get("conditions") or []
    block = dict(status.get("autoscaling") or {})
    block.update(
        lastEvaluationTime=rfc3339(now),
        lastDecision=f"{decision.reason}: {decision.message}",
        podsWithMetrics=decision.pods_with_metrics,
    )
    if decision.free_ratio is not None:
        block.update(
            freeBlockRatio=round(decision.free_ratio, 4),
            utilization=round(decision.utilization or 0.0, 4),
        )
    if decision.desired != current:
        entry = {"time": rfc3339(now), "from": current, "to": decision.desired}
        entry["reason"] = decision.reason
        block["history"] = [*(block.get("history") or []), entry][-HISTORY_LENGTH:]
        block.update(lastScaleTime=rfc3339(now), lastScaleReason=decision.message)

    missing = {pod: errors.get(pod, "no fresh sample") for pod in decision.missing}
    if decision.pods_with_metrics and not missing:
        conditions = set_condition(
            conditions,
            "MetricsAvailable",
            True,
            "MetricsScraped",
            f"{decision.pods_with_metrics} pod(s) scraped",
            now,
        )
    else:
        reason = "ScrapeFailed" if any(p in errors for p in missing) else "NoFreshMetrics"
        detail = "; ".join(f"{pod}: {why}" for pod, why in sorted(missing.items())[:3])
        if len(missing) > 3:
            detail += f"; and {len(missing) - 3} more"
        if not decision.pods_with_metrics and not missing:
            reason, detail = "NoReadyPods", "no ready, warmed-up pod to scrape"
        conditions = set_condition(conditions, "MetricsAvailable", False, reason, detail, now)
    active = decision.recommendation is not None
    conditions = set_condition(
        conditions, "ScalingActive", active, decision.reason, decision.message, now
    )
    return {"desiredReplicas": decision.desired, "autoscaling": block, "conditions": conditions}


def history_events(status: Mapping[str, Any]) -> tuple[ScaleEvent, ...]:
    """The scaling actions recorded in the status, for the rate limits after a restart."""
    events = []
    for entry in (status.get("autoscaling") or {}).get("history") or []:
        at = parse_rfc3339(entry.get("time"))
        if at is not None and "from" in entry and "to" in entry:
            events.append(ScaleEvent(at, int(entry["from"]), int(entry["to"])))
    return tuple(events)


def changed(status: Mapping[str, Any], update: Mapping[str, Any]) -> bool:
    """Whether writing `update` over `status` would change anything."""
    return any(status.get(k) != v for k, v in update.items())
