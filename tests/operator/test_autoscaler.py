"""The autoscaling decision, as a table of situations and the expected replicas and reason."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedinfer.operator.autoscaler import (
    Decision,
    History,
    PodState,
    Recommendation,
    Sample,
    ScaleEvent,
    decide,
)
from pagedinfer.operator.spec import AutoscalingSpec, ScalingRules

NOW = 100_000.0
# target free ratio 0.3 -> target utilisation 0.7; tolerance 0.1; warm-up 30 s;
# staleness 60 s; up: no window, +max(2 pods, 100%) per 60 s; down: 300 s window,
# -max(1 pod, 10%) per 60 s.
POLICY = AutoscalingSpec(min_replicas=1, max_replicas=10)
FAST = replace(
    POLICY,
    scale_up=ScalingRules(0, 100, 1000, 60),
    scale_down=ScalingRules(0, 100, 100, 60),
)


@dataclass
class Case:
    current: int
    free: list[float | None]  # per ready pod; None: no sample
    expect: int
    reason: str
    policy: AutoscalingSpec = POLICY
    unready: int = 0  # pods that exist but are not Ready
    warming: int = 0  # Ready for less than the warm-up
    demand: float | None = None  # blocks demanded per pod, of 100
    age: float = 1.0  # seconds since the samples were taken
    history: History = field(default_factory=History)


def run(case: Case) -> Decision:
    pods = [PodState(f"ready-{i}", True, NOW - 600) for i in range(len(case.free))]
    pods += [PodState(f"warming-{i}", True, NOW - 5) for i in range(case.warming)]
    pods += [PodState(f"unready-{i}", False) for i in range(case.unready)]
    samples = {
        f"ready-{i}": Sample(
            free_ratio=f,
            observed_at=NOW - case.age,
            blocks_total=100,
            blocks_free=100 * f,
            blocks_demand=case.demand,
        )
        for i, f in enumerate(case.free)
        if f is not None
    }
    return decide(case.policy, case.current, pods, samples, case.history, NOW)


CASES = {
    # utilisation 0.95 over 0.7 on 2 pods: ceil(2 * 0.95 / 0.7) = 3
    "scales up on a low free ratio": Case(2, [0.05, 0.05], 3, "ScaleUp"),
    # saturated pods whose queues need 2.5x their blocks: ceil(2 * 2.5 / 0.7) = 8
    "demand beyond saturation scales up further": Case(
        2, [0.0, 0.0], 8, "ScaleUp", policy=FAST, demand=250
    ),
    "usage alone saturates at ceil(2 * 1 / 0.7)": Case(2, [0.0, 0.0], 3, "ScaleUp", policy=FAST),
    "demand below usage changes nothing": Case(2, [0.05, 0.05], 3, "ScaleUp", demand=10),
    "holds inside the tolerance band": Case(2, [0.33, 0.35], 2, "WithinTolerance"),
    "holds just inside the band": Case(2, [0.24, 0.24], 2, "WithinTolerance"),
    "scales down when idle and nothing recent was higher": Case(
        4, [0.9] * 4, 1, "ScaleDown", policy=FAST
    ),
    "the scale-down window holds the replicas": Case(
        4,
        [0.9] * 4,
        4,
        "ScaleDownStabilized",
        history=History(recommendations=(Recommendation(NOW - 100, 4),)),
    ),
    "the window takes the highest recent recommendation": Case(
        4,
        [0.9] * 4,
        3,
        "ScaleDown",
        policy=replace(POLICY, scale_down=ScalingRules(300, 100, 100, 60)),
        history=History(recommendations=(Recommendation(NOW - 100, 3),)),
    ),
    "after the window, down by at most max(1 pod, 10%) per period": Case(
        4,
        [0.9] * 4,
        3,
        "ScaleDownLimited",
        history=History(recommendations=(Recommendation(NOW - 400, 4),)),
    ),
    "up by at most max(2 pods, 100%) per period": Case(
        2, [0.0, 0.0], 4, "ScaleUpLimited", demand=900
    ),
    "what this period added counts against the cap": Case(
        2,
        [0.0, 0.0],
        3,
        "ScaleUpLimited",
        demand=900,
        history=History(events=(ScaleEvent(NOW - 30, 1, 2),)),
    ),
    "an older period does not": Case(
        2,
        [0.0, 0.0],
        4,
        "ScaleUpLimited",
        demand=900,
        history=History(events=(ScaleEvent(NOW - 90, 1, 2),)),
    ),
    "no scale-up while a pod is not ready": Case(
        3, [0.0, 0.0], 3, "PodsPending", unready=1, demand=200
    ),
    "no scale-up while a pod is not yet created": Case(3, [0.0, 0.0], 3, "PodsPending", demand=200),
    "no scale-up while a pod warms up": Case(
        3, [0.0, 0.0], 3, "PodsPending", warming=1, demand=200
    ),
    "pending pods do not block a scale-down": Case(
        3, [0.9, 0.9], 1, "ScaleDown", policy=FAST, unready=1
    ),
    "no metrics at all: no action": Case(2, [None, None], 2, "NoMetrics"),
    "stale metrics: no action": Case(2, [0.0, 0.0], 2, "NoMetrics", age=61),
    "no ready pod: no action": Case(2, [], 2, "NoMetrics", unready=2),
    "only warming pods: no action": Case(2, [], 2, "NoMetrics", warming=2),
    # one pod at 0.95, one unknown taken as idle: (0.95 + 0) / 2 < 0.7 reverses the decision
    "a pod without metrics counts as idle when scaling up": Case(
        2, [0.05, None], 2, "WithinTolerance"
    ),
    "and still lets a strong signal through": Case(
        3, [0.0, 0.0, None], 6, "ScaleUp", policy=FAST, demand=200
    ),
    # (0.1 + 0.1 + 0.7) / 3 / 0.7 = 0.43 -> ceil(0.43 * 3) = 2, not ceil(0.14 * 2) = 1
    "a pod without metrics counts as at target when scaling down": Case(
        3, [0.9, 0.9, None], 2, "ScaleDown", policy=FAST
    ),
    "clamped to maxReplicas": Case(
        2, [0.0, 0.0], 5, "TooManyReplicas", policy=replace(FAST, max_replicas=5), demand=900
    ),
    "at maxReplicas it holds": Case(
        5, [0.0] * 5, 5, "TooManyReplicas", policy=replace(FAST, max_replicas=5)
    ),
    "clamped to minReplicas": Case(
        3, [0.95] * 3, 2, "TooFewReplicas", policy=replace(FAST, min_replicas=2)
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decision(case: Case) -> None:
    decision = run(case)
    assert (decision.desired, decision.reason) == (case.expect, case.reason), decision.message


def test_decision_reports_what_it_measured() -> None:
    decision = run(Case(2, [0.05, 0.15, None], 2, "", demand=10))
    assert decision.pods_with_metrics == 2
    assert decision.missing == ("ready-2",)
    assert decision.free_ratio == pytest.approx(0.10)
    assert decision.utilization == pytest.approx(0.90)
    assert "utilization 0.90" in decision.message


def simulate(signal: list[float], policy: AutoscalingSpec, period: float = 15.0) -> list[int]:
    """Replicas after each sync period, with every pod ready and fresh."""
    history, current, replicas = History(), policy.min_replicas, []
    for step, free in enumerate(signal):
        now = NOW + step * period
        pods = [PodState(f"p{i}", True, 0.0) for i in range(current)]
        samples = {p.name: Sample(free, now) for p in pods}
        decision = decide(policy, current, pods, samples, history, now)
        history = history.record(decision, current, now, keep_s=600)
        current = decision.desired
        replicas.append(current)
    return replicas


def direction_changes(replicas: list[int]) -> int:
    steps = [b - a for a, b in itertools.pairwise(replicas) if b != a]
    return sum(1 for a, b in itertools.pairwise(steps) if (a > 0) != (b > 0))


def test_an_oscillating_signal_yields_few_direction_changes() -> None:
    # Busy and idle on alternate periods for 20 minutes.
    replicas = simulate([0.05, 0.9] * 40, POLICY)
    assert direction_changes(replicas) == 0
    assert max(replicas) <= POLICY.max_replicas
    # Without stabilisation the same signal flaps on every period.
    flapping = simulate([0.05, 0.9] * 40, FAST)
    assert direction_changes(flapping) > 20


def test_a_quiet_spell_scales_down_only_after_the_window() -> None:
    replicas = simulate([0.05] * 4 + [0.9] * 40, POLICY)
    peak = replicas[3]
    assert peak > 1
    # the last busy recommendation leaves the 300 s window 20 periods later
    assert replicas[4 : 4 + 19] == [peak] * 19
    assert replicas[-1] < peak


@given(
    current=st.integers(1, 20),
    free=st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=8),
    demand=st.one_of(st.none(), st.floats(0, 1000)),
    unready=st.integers(0, 3),
    min_replicas=st.integers(1, 5),
    span=st.integers(0, 15),
)
def test_invariants(current, free, demand, unready, min_replicas, span) -> None:
    policy = replace(POLICY, min_replicas=min_replicas, max_replicas=min_replicas + span)
    current = min(max(current, policy.min_replicas), policy.max_replicas)
    decision = run(Case(current, free, 0, "", policy=policy, unready=unready, demand=demand))
    assert policy.min_replicas <= decision.desired <= policy.max_replicas
    if all(f is None for f in free):
        assert decision.desired == current
    if unready:
        assert decision.desired <= current
    # the per-period caps (HPA truncates the percent policy, as here)
    assert decision.desired <= max(current + 2, 2 * current)
    assert decision.desired >= min(current - 1, int(current * 0.9))
