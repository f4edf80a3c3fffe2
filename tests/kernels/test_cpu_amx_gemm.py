"""bf16 GEMMs on AMX tiles (`amx_gemm`): BF16_DOT weights times rows rounded to bf16,
summed in fp32 by the tile unit; each row's bits the same whatever the step's other
rows and the workers; out += the product and the gate/up GEMM's SiLU as the other
kernels give them. Skipped on CPUs without AMX-BF16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the AMX GEMM is compiled with numba")

from threads import torch_threads

from pagedinfer.kernels.cpu import amx_gemm, grid_gemm, layer_ops
from pagedinfer.kernels.cpu.numba_support import Job, run_jobs

pytestmark = pytest.mark.skipif(not amx_gemm.available(), reason="no AMX-BF16 tiles here")

# One pass of 16 rows, a part of one, and passes past it, the last of one row.
ROWS = (1, 3, 16, 17, 33, 40)


def bf16_product(weight: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """x @ weight.T of both rounded to bf16, in float64: the exact sums the tiles round."""
    w = weight.bfloat16().double()
    return (x.bfloat16().double() @ w.T).numpy()


def within_fp32_sums(product: np.ndarray, exact: np.ndarray, weight, x) -> None:
    """product within fp32 rounding of each step of its sums: K * 2^-24 of sum |x * w|."""
    magnitude = x.bfloat16().double().abs() @ weight.bfloat16().double().abs().T
    bound = weight.shape[1] * 2.0**-24 * magnitude.numpy()
    assert np.all(np.abs(product - exact) <= bound)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tile_products_are_the_bf16_products_for_every_row_count(threads) -> None:
    """576 outputs (nine groups of four tiles) over 512 inputs: each row within fp32
    rounding of the exact product of the bf16-rounded row and weight, and the same bits
    in a call of any size and however the workers share the groups; rounding the rows to
    bf16 is the call's own (a row already in bf16 gives the same bits)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(576, 512, generator=generator) * 0.05
    paired = grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT)
    x = torch.randn(max(ROWS), 512, generator=generator)
    exact = bf16_product(weight, x)
    order = grid_gemm.fixed_order(512)
    with torch_threads(threads):
        full = grid_gemm.grid_linear(x, paired, order).numpy()
        within_fp32_sums(full, exact, weight, x)
        for rows in ROWS:
            product = grid_gemm.grid_linear(x[:rows], paired, order).numpy()
            assert np.array_equal(product, full[:rows]), rows
        rounded = grid_gemm.grid_linear(x.bfloat16().float(), paired, order).numpy()
        assert np.array_equal(rounded, full)


def test_the_tiles_are_not_the_pairs_chain() -> None:
    """The tile unit sums in its own order, not vdpbf16ps's chain of pairs: some output
    differs from that chain's bits (so the test above sees the tiles' arithmetic)."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(64, 512, generator=generator)
    x = torch.randn(16, 512, generator=generator)
    paired = grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT)
    ours = grid_gemm.grid_linear(x, paired, grid_gemm.fixed_order(512)).numpy()
    w, xs = weight.bfloat16().float().numpy(), x.bfloat16().float().numpy()
    chain = np.zeros((16, 64), dtype=np.float32)
    for i in range(0, 512, 2):
        for j in (i + 1, i):
            chain = chain + xs[:, j, None] * w[None, :, j]
    assert not np.array_equal(ours, chain)


def test_adding_into_out_adds_the_product_once() -> None:
    """add: out += the product, rounded once more, as `residual += x @ W.T` gives it."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(128, 256, generator=generator) * 0.1
    paired = grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT)
    order = grid_gemm.fixed_order(256)
    for rows in (5, 21):
        x, residual = torch.randn(rows, 256, generator=generator), torch.randn(rows, 128)
        expected = residual + grid_gemm.grid_linear(x, paired, order)
        grid_gemm.grid_linear(x, paired, order, residual, add=True)
        assert torch.equal(residual, expected)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_gate_up_gemm_gives_silu_mul_of_its_product(threads, gelu) -> None:
    """A [gate | up] weight of 2 x 288 outputs: out gets what `silu_mul` makes of the
    whole product, bit for bit, for every row count and however the workers share the
    groups (GELU's tanh approximation with gelu)."""
    generator = torch.Generator().manual_seed(10)
    weight = torch.randn(576, 256, generator=generator) * 0.1
    paired = grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT)
    order = grid_gemm.fixed_order(256)
    gemm = grid_gemm.gemm_all_rows(paired.kind, 256, order.ends, order.fused, True, gelu)
    with torch_threads(threads):
        for rows in ROWS:
            x = torch.randn(rows, 256, generator=generator) * 4
            expected = layer_ops.silu_mul(grid_gemm.grid_linear(x, paired, order), gelu)
            out = np.full((rows, 288 // 16, 16), np.nan, dtype=np.float32)
            run_jobs([Job(gemm, (x.numpy(), paired.codes, paired.scales, out, False), 9)])
            assert np.array_equal(out.reshape(rows, 288), expected.numpy()), rows
