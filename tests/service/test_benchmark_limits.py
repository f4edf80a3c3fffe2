"""The run-time floors of benchmarks/limits.py: the bound must hold and must not be loose.

The benchmark quotes these floors as what no engine can beat on this machine's matmul
library, so the tests check the bound against schedules computed by brute force.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedinfer.service.loader import load_model

_path = Path(__file__).resolve().parents[2] / "benchmarks" / "limits.py"
_spec = importlib.util.spec_from_file_location("benchmark_limits", _path)
limits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(limits)


def staircase(curve: dict[int, float], per_token: float, m: int) -> float:
    """The least a pass of m tokens can cost under the module's two assumptions."""
    below = max(k for k in curve if k <= m)
    return max(curve[below], m * per_token)


def test_minorant_lies_below_the_staircase_and_is_convex() -> None:
    curve = {1: 14.0, 2: 20.0, 4: 23.0, 8: 33.0, 16: 39.0, 32: 45.0, 64: 70.0, 128: 110.0}
    per_token = 0.6
    hull = limits.convex_minorant(curve, per_token, 600)
    for m in range(1, 601):
        assert limits._evaluate(hull, m) <= staircase(curve, per_token, m) + 1e-9
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.pairwise(hull)]
    assert slopes == sorted(slopes)
    # Tight where it can be: it touches the staircase at one token per pass.
    assert limits._evaluate(hull, 1) == pytest.approx(14.0)


def test_affine_cost_gives_fixed_cost_per_pass_plus_cost_per_token() -> None:
    # t(m) = 10 + 2m measured everywhere: K passes of N tokens cost 10K + 2N, least at
    # the fewest passes.
    curve = {m: 10.0 + 2.0 * m for m in range(1, 101)}
    floor, passes = limits.any_schedule_floor(curve, 2.0, total_tokens=100, min_passes=7)
    assert passes == 7
    assert floor == pytest.approx(10 * 7 + 2 * 100)


@pytest.mark.parametrize("total,min_passes", [(6, 2), (9, 3), (12, 4), (10, 1)])
def test_floor_is_at_most_every_brute_force_schedule(total: int, min_passes: int) -> None:
    """Every way to split `total` tokens into at least `min_passes` passes costs at least
    the floor, and the cheapest of them comes close to it (the bound is not vacuous)."""
    curve = {1: 5.0, 2: 6.0, 3: 9.0, 4: 9.5, 6: 12.0}
    per_token = 1.5
    floor, _ = limits.any_schedule_floor(curve, per_token, total, min_passes)

    def splits(n: int, parts: int, largest: int):
        if parts == 0:
            if n == 0:
                yield ()
            return
        for first in range(min(n, largest), 0, -1):
            for rest in splits(n - first, parts - 1, first):
                yield (first, *rest)

    cheapest = min(
        sum(staircase(curve, per_token, m) for m in split)
        for k in range(min_passes, total + 1)
        for split in splits(total, k, total)
    )
    assert floor <= cheapest + 1e-9
    assert floor >= 0.8 * cheapest


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="m = 1"):
        limits.convex_minorant({2: 1.0}, 0.1, 10)
    with pytest.raises(ValueError, match="min_passes"):
        limits.any_schedule_floor({1: 1.0}, 0.1, total_tokens=5, min_passes=6)


def test_measures_the_models_own_gemms(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(make_tiny_model("llama")), torch.device("cpu"), torch.float32).model
    cfg = model.config
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    assert limits.layer_flops_per_token(model) == 2 * cfg.num_layers * per_layer
    # Every GEMM of every layer runs, at the token count asked, through the model's code.
    seen: list[tuple[int, int]] = []
    for layer in model.layers:
        for linear in layer.linears():
            forward, add_into = linear.forward, linear.add_into

            def record_forward(x, linear=linear, forward=forward):
                seen.append((id(linear), x.shape[0]))
                return forward(x)

            def record_add_into(out, x, linear=linear, add_into=add_into):
                seen.append((id(linear), x.shape[0]))
                add_into(out, x)

            monkeypatch.setattr(linear, "forward", record_forward)
            monkeypatch.setattr(linear, "add_into", record_add_into)
    curve = limits.gemm_curve(model, [4, 1, 4], repeats=1)
    assert sorted(curve) == [1, 4]
    linears = {id(linear) for layer in model.layers for linear in layer.linears()}
    for tokens in (1, 4):
        # Once to warm up and once timed, for each distinct token count.
        calls = [linear for linear, rows in seen if rows == tokens]
        assert sorted(calls) == sorted(2 * list(linears))
