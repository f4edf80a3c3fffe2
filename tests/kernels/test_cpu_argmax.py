"""The LM head's argmax without its logits: the token is the one the full logits give
(numpy's argmax of the grid GEMM's fp32 logits, the first on ties), for an LM head on an
8-bit grid, on another grid and on none, and a row it cannot pick is marked for its
logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the argmax kernels are compiled with numba")

from test_cpu_gemm import affine4_weight, scaled8_weight
from threads import torch_threads

from pagedinfer.kernels.cpu import greedy_argmax, grid_gemm

VOCAB, HIDDEN = 1024, 256
ORDERS = [
    grid_gemm.SumOrder((HIDDEN,), True),
    grid_gemm.SumOrder((96, 192, HIDDEN), False),
]


# LM heads whose 8-bit codes are their own (a GGUF Q8_0), are rounded from another grid
# (Q4_1), and from an fp32 weight on no grid.
KINDS = [grid_gemm.SCALED8, grid_gemm.AFFINE4, grid_gemm.REBUILT]


def lm_weight(kind: str, seed: int) -> torch.Tensor:
    if kind == grid_gemm.SCALED8:
        return scaled8_weight(VOCAB, HIDDEN, seed=seed)
    if kind == grid_gemm.AFFINE4:
        return affine4_weight(VOCAB, HIDDEN, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05


def lm_head(weight: torch.Tensor, order: grid_gemm.SumOrder) -> greedy_argmax.ArgmaxWeights:
    grid = grid_gemm.to_grid(weight) or grid_gemm.rebuilt(weight)
    assert grid is not None
    return greedy_argmax.ArgmaxWeights.of(grid, order)


def full_argmax(hidden: torch.Tensor, weights: greedy_argmax.ArgmaxWeights) -> np.ndarray:
    logits = grid_gemm.grid_linear(hidden.contiguous(), weights.grid, weights.order)
    return logits.numpy().argmax(axis=1)


def hidden_states(rows: int, seed: int) -> torch.Tensor:
    """Final-normed rows as a model gives them: mostly small, a few large dimensions."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=gen)
    x[:, torch.randint(0, HIDDEN, (4,), generator=gen)] *= 12
    return x


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("kind", "order"),
    [(kind, ORDERS[0]) for kind in KINDS] + [(grid_gemm.SCALED8, ORDERS[1])],
    ids=[f"{kind}-one-fused-chain" for kind in KINDS] + ["scaled8-three-unfused-parts"],
)
def test_the_token_is_the_argmax_of_the_full_logits(kind, order, threads) -> None:
    weights = lm_head(lm_weight(kind, seed=1), order)
    assert weights.grid.kind == kind
    hidden = hidden_states(70, seed=2)  # 11 passes of 6 rows and 4 rows left
    with torch_threads(threads):
        tokens = greedy_argmax.lm_head_argmax(hidden, weights)
    np.testing.assert_array_equal(tokens.numpy(), full_argmax(hidden, weights))


def test_a_scratch_kept_from_more_threads_gives_the_same_tokens() -> None:
    """The weights keep their scratch from call to call: what workers of an earlier call
    with more threads left in it is not read."""
    weights = lm_head(scaled8_weight(VOCAB, HIDDEN, seed=14), ORDERS[0])
    with torch_threads(3):
        greedy_argmax.lm_head_argmax(hidden_states(8, seed=15) * 50, weights)
    hidden = hidden_states(8, seed=16)
    with torch_threads(1):
        tokens = greedy_argmax.lm_head_argmax(hidden, weights)
    np.testing.assert_array_equal(tokens.numpy(), full_argmax(hidden, weights))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_close_to_an_output_pick_it_over_its_near_neighbours(kind) -> None:
    """Rows along an output's own weight (its logit far ahead) and rows halfway between
    two outputs' weights (their logits within rounding of each other)."""
    weight = lm_weight(kind, seed=3)
    weights = lm_head(weight, ORDERS[0])
    gen = torch.Generator().manual_seed(4)
    near = weight[torch.randint(0, VOCAB, (8,), generator=gen)] * 30
    pairs = torch.randint(0, VOCAB, (2, 8), generator=gen)
    between = (weight[pairs[0]] + weight[pairs[1]]) * 15
    hidden = torch.cat((near, between))
    np.testing.assert_array_equal(
        greedy_argmax.lm_head_argmax(hidden, weights).numpy(), full_argmax(hidden, weights)
    )


def test_equal_logits_give_the_first_output() -> None:
    """Outputs with the same weight tie exactly: the first one wins, as in numpy, within a
    group of 64 outputs and across groups; a zero row ties every output."""
    weight = scaled8_weight(VOCAB, HIDDEN, seed=5)
    weight[700] = weight[300]  # another group
    weight[305] = weight[300]  # the same group of 64
    weights = lm_head(weight, ORDERS[1])
    hidden = torch.cat((weight[300:301] * 40, torch.zeros(1, HIDDEN)))
    tokens = greedy_argmax.lm_head_argmax(hidden, weights).tolist()
    assert tokens == [300, 0]
    assert tokens == full_argmax(hidden, weights).tolist()


def test_rows_that_are_not_finite_are_left_for_their_logits() -> None:
    weights = lm_head(scaled8_weight(VOCAB, HIDDEN, seed=6), ORDERS[0])
    hidden = hidden_states(4, seed=7)
    hidden[1, 5] = float("nan")
    hidden[2, 9] = float("inf")
    tokens = greedy_argmax.lm_head_argmax(hidden, weights)
    assert tokens[1] == tokens[2] == -1
    expected = full_argmax(hidden[[0, 3]], weights)
    assert tokens[[0, 3]].tolist() == expected.tolist()


def test_a_row_with_too_many_outputs_to_check_is_left_for_its_logits() -> None:
    """A zero row ties all 1,024 outputs: with room for fewer candidates it is not picked;
    the other rows still are."""
    weights = lm_head(scaled8_weight(VOCAB, HIDDEN, seed=8), ORDERS[0])
    hidden = hidden_states(3, seed=9)
    hidden[1] = 0
    workers = torch.get_num_threads()
    scratch = greedy_argmax.Scratch.of(3, HIDDEN, VOCAB, workers, candidates=VOCAB - 1)
    tokens = greedy_argmax.lm_head_argmax(hidden, weights, scratch)
    assert tokens[1] == -1
    assert tokens[[0, 2]].tolist() == full_argmax(hidden[[0, 2]], weights).tolist()


def test_no_rows_give_no_tokens() -> None:
    weights = lm_head(scaled8_weight(VOCAB, HIDDEN, seed=10), ORDERS[0])
    assert greedy_argmax.lm_head_argmax(torch.empty(0, HIDDEN), weights).shape == (0,)


def test_an_8_bit_grid_keeps_its_codes_and_other_weights_are_rounded_to_them() -> None:
    """A Q8_0 LM head's codes are its own, with nothing left out; another one's are
    rounded, and what they leave out is bounded per block."""
    exact = lm_head(lm_weight(grid_gemm.SCALED8, seed=17), ORDERS[0])
    blocks = HIDDEN // grid_gemm.GRID_BLOCK
    assert not exact.bounds[:, blocks:].any()
    rounded = lm_head(lm_weight(grid_gemm.REBUILT, seed=17), ORDERS[0])
    assert (rounded.bounds[:, blocks:] > 0).all()


def test_hidden_states_of_the_wrong_width_are_refused() -> None:
    weights = lm_head(scaled8_weight(VOCAB, HIDDEN, seed=11), ORDERS[0])
    with pytest.raises(ValueError, match=r"hidden must be \[S, 256\]"):
        greedy_argmax.lm_head_argmax(torch.zeros(2, HIDDEN + 32), weights)


@pytest.mark.parametrize("kind", KINDS)
def test_the_approximation_is_within_its_bound_of_every_logit(kind) -> None:
    """The premise of the pick: each approximate logit lies within the bound of the
    exact one (checked on every output of rows with large and small dimensions)."""
    weights = lm_head(lm_weight(kind, seed=12), ORDERS[0])
    hidden = hidden_states(9, seed=13)
    rows = hidden.shape[0]
    workers = torch.get_num_threads()
    scratch = greedy_argmax.Scratch.of(rows, HIDDEN, VOCAB, workers)
    greedy_argmax.lm_head_argmax(hidden, weights, scratch)
    approx = scratch.approx.reshape(rows, VOCAB).astype(np.float64)
    exact = hidden.double().numpy() @ weights.grid.dense().double().numpy().T
    bound = scratch.errors.astype(np.float64) @ weights.bounds.astype(np.float64).T
    bound += scratch.margins.astype(np.float64)[:, None]
    assert (np.abs(approx - exact) <= bound).all()
    # ... and close enough to leave few outputs to check: on average within 10% of the
    # row's largest logit (7-bit row codes on AVX2 leave twice what 8-bit ones do)
    assert (bound.mean(axis=1) < 0.1 * np.abs(exact).max(axis=1)).all()
