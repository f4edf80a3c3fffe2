"""The autoscaling decision: Kubernetes HPA's algorithm on KV-cache utilisation.

A pure function of the policy, the current replicas, the pods, their metric samples and
the recent history, with the time passed in. Each pod's utilisation is
`max(1 - free_ratio, demand / total)`: demand keeps growing past saturation (queued
prompts), so a saturated fleet is scaled by how much it is short, not just "full".

The steps follow the HPA controller:
1. average utilisation of the ready, warmed-up pods with fresh samples; no such pod
   means no action at all;
2. `ceil(n * u / target)`, nothing inside the tolerance band; pods without fresh
   samples count as at target when scaling down and as idle when scaling up, and a
   decision they reverse or bring into the band is dropped;
3. stabilisation: the lowest recommendation of the scale-up window, the highest of the
   scale-down window;
4. rate limits: per period, at most `max(pods, percent of the period's start)` added or
   removed;
5. no scale-up while pods are pending or warming up (their capacity is on its way);
6. clamp to [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedinfer.operator.spec import AutoscalingSpec


@dataclass(frozen=True)
class PodState:
    """A pod of the Deployment that is not terminating."""

    name: str
    ready: bool
    ready_since: float | None = None  # when it turned Ready (epoch seconds)


@dataclass(frozen=True)
class Sample:
    """One pod's KV-cache gauges from one scrape."""

    free_ratio: float
    observed_at: float
    blocks_total: float = 0.0
    blocks_free: float = 0.0
    blocks_demand: float | None = None

    @property
    def utilization(self) -> float:
        used = 1.0 - self.free_ratio
        if self.blocks_demand is not None and self.blocks_total > 0:
            return max(used, self.blocks_demand / self.blocks_total)
        return used


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    at: float
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True)
class History:
    """What the stabilisation windows and rate limits look back on."""

    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()

    def record(self, decision: Decision, current: int, now: float, keep_s: float) -> History:
        """This history plus `decision`, forgetting what no window can see any more."""
        recs = self.recommendations
        if decision.recommendation is not None:
            recs += (Recommendation(now, decision.recommendation),)
        events = self.events
        if decision.desired != current:
            events += (ScaleEvent(now, current, decision.desired),)
        return History(
            tuple(r for r in recs if r.at >= now - keep_s),
            tuple(e for e in events if e.at >= now - keep_s),
        )


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str  # CamelCase, for the Event and the condition
    message: str
    recommendation: int | None = None  # before stabilisation; None when nothing was measured
    utilization: float | None = None
    free_ratio: float | None = None
    pods_with_metrics: int = 0
    missing: tuple[str, ...] = field(default_factory=tuple)  # ready pods without fresh samples
    pending: int = 0


def decide(
    policy: AutoscalingSpec,
    current: int,
    pods: Sequence[PodState],
    samples: Mapping[str, Sample],
    history: History,
    now: float,
) -> Decision:
    """The replicas to ask for now, and why. Holding is `desired == current`."""
    warm = warm_pods(policy, pods, now)
    pending = len(pods) - len(warm) + max(0, current - len(pods))
    fresh = {
        p.name: samples[p.name]
        for p in warm
        if p.name in samples and now - samples[p.name].observed_at <= policy.metric_staleness_s
    }
    missing = tuple(p.name for p in warm if p.name not in fresh)
    if not fresh:
        why = "no ready, warmed-up pod" if not warm else "no fresh metrics from any ready pod"
        return Decision(current, "NoMetrics", f"holding at {current}: {why}", missing=missing)

    utilization = sum(s.utilization for s in fresh.values()) / len(fresh)
    free_ratio = sum(s.free_ratio for s in fresh.values()) / len(fresh)
    measured = dict(
        utilization=utilization,
        free_ratio=free_ratio,
        pods_with_metrics=len(fresh),
        missing=missing,
        pending=pending,
    )
    target = policy.target_utilization
    raw = _recommend(utilization, target, policy.tolerance, len(fresh), len(missing), current)
    detail = f"utilization {utilization:.2f} vs target {target:.2f} on {len(fresh)} pod(s)"

    def hold(reason: str, why: str) -> Decision:
        return Decision(current, reason, f"holding at {current}: {why}", raw, **measured)

    if raw == current:
        return hold("WithinTolerance", detail)

    desired = _stabilize(raw, current, history, policy, now)
    if desired == current:
        window = policy.scale_down if raw < current else policy.scale_up
        return hold(
            "ScaleDownStabilized" if raw < current else "ScaleUpStabilized",
            f"{detail} recommends {raw}, stabilised over {window.stabilization_window_s:g}s",
        )
    up = desired > current
    limited = _rate_limit(desired, current, history, policy, now)
    reason = "ScaleUp" if up else "ScaleDown"
    if limited != desired:
        reason += "Limited"
        detail += f"; {desired} limited by the rate to {limited}"
    if up and pending:
        return hold("PodsPending", f"{detail} recommends {raw}, but {pending} pod(s) pending")
    clamped = min(max(limited, policy.min_replicas), policy.max_replicas)
    if clamped != limited:
        reason = "TooManyReplicas" if limited > clamped else "TooFewReplicas"
        detail += f"; clamped to [{policy.min_replicas}, {policy.max_replicas}]"
    if clamped == current:
        return hold(reason, detail)
    return Decision(clamped, reason, f"{current} -> {clamped}: {detail}", raw, **measured)


def warm_pods(policy: AutoscalingSpec, pods: Sequence[PodState], now: float) -> list[PodState]:
    """The pods whose metrics count: Ready, and for at least the warm-up period."""
    return [
        p
        for p in pods
        if p.ready and (p.ready_since is None or now - p.ready_since >= policy.pod_warmup_s)
    ]


def _recommend(
    utilization: float, target: float, tolerance: float, n_fresh: int, n_missing: int, current: int
) -> int:
    ratio = utilization / target
    if n_missing == 0:
        if abs(ratio - 1.0) <= tolerance:
            return current
        return math.ceil(ratio * n_fresh)
    # HPA's conservative treatment of pods without metrics: at target when scaling
    # down, idle when scaling up; drop the decision if that reverses it.
    assumed = target if ratio < 1.0 else 0.0
    new_ratio = (utilization * n_fresh + assumed * n_missing) / (n_fresh + n_missing) / target
    if abs(new_ratio - 1.0) <= tolerance or (ratio < 1.0) != (new_ratio < 1.0):
        return current
    replicas = math.ceil(new_ratio * (n_fresh + n_missing))
    if (new_ratio < 1.0 and replicas > current) or (new_ratio > 1.0 and replicas < current):
        return current
    return replicas


def _stabilize(
    raw: int, current: int, history: History, policy: AutoscalingSpec, now: float
) -> int:
    recs = (*history.recommendations, Recommendation(now, raw))
    up_from = now - policy.scale_up.stabilization_window_s
    down_from = now - policy.scale_down.stabilization_window_s
    up = min(r.replicas for r in recs if r.at >= up_from)
    down = max(r.replicas for r in recs if r.at >= down_from)
    return min(max(current, up), down)


def _rate_limit(
    desired: int, current: int, history: History, policy: AutoscalingSpec, now: float
) -> int:
    if desired > current:
        rules = policy.scale_up
        added = sum(
            e.to_replicas - e.from_replicas
            for e in history.events
            if e.at > now - rules.period_s and e.to_replicas > e.from_replicas
        )
        start = current - added
        limit = max(start + rules.pods, math.ceil(start * (1 + rules.percent / 100)))
        return max(current, min(desired, limit))
    rules = policy.scale_down
    removed = sum(
        e.from_replicas - e.to_replicas
        for e in history.events
        if e.at > now - rules.period_s and e.to_replicas < e.from_replicas
    )
    start = current + removed
    limit = min(start - rules.pods, math.floor(start * (1 - rules.percent / 100)))
    return min(current, max(desired, limit))
