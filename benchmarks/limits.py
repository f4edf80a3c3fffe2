"""What the model's GEMMs alone cost on this machine, and the floors on run time that follow.

Everything here times the model's own weights through its own GEMM code (the engine's
`Linear` modules and LM head, packed or not as the engine runs them), with nothing else
in the way: no attention, norms, sampling or Python around them.

- `gemm_curve` and `lm_head_seconds`: the layer GEMMs of one forward pass at a token
  count, and the LM head at a row count. Replayed at a run's own passes, they give the
  part of that run that was GEMMs; the rest is everything else the engine does.
- `any_schedule_floor`: a lower bound on the time any engine needs for a workload on
  this machine's matmul library, whatever its schedule. A workload whose longest
  request has `o` output tokens needs at least `o` forward passes, one after another,
  and all passes together carry every prompt token and every output token but each
  request's last. Each pass costs at least its GEMMs at its token count. From the
  measured times `t(m)` a convex function `g <= t` is built on two assumptions only:
  more rows never cost less (`t` is non-decreasing between measured points), and no
  pass beats the best GEMM rate seen (the 2048^3 matmul or any measured point). By
  Jensen's inequality K passes carrying N tokens cost at least `K * g(N / K)`; the floor
  is the least of that over every K from `o` to N. The same bound applies to the LM
  head, with one row per output token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from pagedinfer.service.models.llama import packed_linear


def _best_time(fn, repeats: int) -> float:
    fn()  # warm: first-touch allocations, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def layer_gemm_seconds(model, tokens: int, repeats: int = 3) -> float:
    """One forward pass's layer GEMMs (q/k/v, o, gate/up, down of every layer) at `tokens` rows."""
    config = model.config
    dtype = model.embed_tokens.weight.dtype
    x = torch.randn(tokens, config.hidden_size, dtype=dtype)
    residual = torch.zeros(tokens, config.hidden_size, dtype=dtype)
    attn_out = torch.randn(tokens, config.num_heads * config.head_dim, dtype=dtype)
    act = torch.randn(tokens, config.intermediate_size, dtype=dtype)

    def run() -> None:
        for layer in model.layers:
            qkv, o, gate_up, down = layer.linears()
            qkv(x)
            o.add_into(residual, attn_out)
            gate_up(x)
            down.add_into(residual, act)

    return _best_time(run, repeats)


def layer_flops_per_token(model) -> int:
    """2 x the weights of the layer GEMMs: their FLOPs for one token."""
    # A packed weight's dense copy is on the meta device: its shape is still there.
    return 2 * sum(linear.weight.numel() for layer in model.layers for linear in layer.linears())


@torch.inference_mode()
def lm_head_seconds(model, rows: int, repeats: int = 3) -> float:
    """The vocabulary projection of `rows` hidden states, as the model computes it."""
    hidden = torch.randn(rows, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype)
    if model.lm_head_packed is not None:
        return _best_time(lambda: packed_linear(hidden, model.lm_head_packed, None), repeats)
    weight = model.lm_head_weight()
    return _best_time(lambda: F.linear(hidden, weight), repeats)


def gemm_curve(model, token_counts: Iterable[int], repeats: int = 3) -> dict[int, float]:
    """Layer GEMM seconds at each token count (measured once per distinct count)."""
    return {m: layer_gemm_seconds(model, m, repeats) for m in sorted(set(token_counts))}


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of points sorted by x (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for x, y in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # Drop the middle point when it lies on or above the chord.
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append((x, y))
    return hull


def convex_minorant(
    curve: dict[int, float], seconds_per_token: float, max_tokens: int
) -> list[tuple[float, float]]:
    """Breakpoints of a convex g <= t on [1, max_tokens] (see the module doc).

    curve: measured t(m), which must include m = 1. seconds_per_token: the least a token
    can cost (the best GEMM rate seen). Between measured points the bound is the
    staircase max(t(m_i), m * seconds_per_token), a piecewise-linear function whose
    breakpoints are listed here; its lower convex hull lies below it.
    """
    if 1 not in curve:
        raise ValueError("the curve must include one token per pass (m = 1)")
    ms = sorted(m for m in curve if m <= max_tokens)
    points: list[tuple[float, float]] = []
    for i, m in enumerate(ms):
        floor = curve[m]
        end = ms[i + 1] - 1 if i + 1 < len(ms) else max_tokens
        points.append((m, max(floor, m * seconds_per_token)))
        crossing = floor / seconds_per_token  # where the rate line meets the step
        if m < crossing < end:
            points.append((crossing, floor))
        if end > m:
            points.append((end, max(floor, end * seconds_per_token)))
    return _lower_hull(points)


def _evaluate(hull: list[tuple[float, float]], x: float) -> float:
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if x1 <= x <= x2:
            return y1 + (y2 - y1) * (x - x1) / (x2 - x1)
    if x <= hull[0][0]:
        return hull[0][1]
    raise ValueError(f"{x} is beyond the curve's last point {hull[-1][0]}")


def any_schedule_floor(
    curve: dict[int, float],
    seconds_per_token: float,
    total_tokens: int,
    min_passes: int,
) -> tuple[float, int]:
    """(least layer-GEMM seconds of any schedule, the number of passes that attains it).

    total_tokens: tokens through the layers over the whole workload; min_passes: the
    longest request's output tokens. See the module doc for why this bounds every engine.
    """
    if not 1 <= min_passes <= total_tokens:
        raise ValueError(
            f"min_passes ({min_passes}) must be between 1 and total_tokens ({total_tokens})"
        )
    hull = convex_minorant(curve, seconds_per_token, total_tokens)
    best, best_k = float("inf"), min_passes
    for k in range(min_passes, total_tokens + 1):
        value = k * _evaluate(hull, total_tokens / k)
        if value < best:
            best, best_k = value, k
    return best, best_k
