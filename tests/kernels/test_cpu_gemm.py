"""GEMMs from weights kept on their quantisation grid: the grid is found exactly, the
order the library sums in is found, and the products carry the library's bits."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the grid GEMM is compiled with numba")

from threads import torch_threads

from pagedinfer.kernels import cpu_gemm
from pagedinfer.service.models.llama import MKLPacked, cpu_mkl_packing_available, mkl_linear


def affine4_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as a Q4_1 model dequantises: fp32(d * q) + m per run of 32 inputs, with
    d and m fp16 values and q in 0..15."""
    rng = np.random.default_rng(seed)
    blocks = (out_features, in_features // 32, 1)
    d = (rng.random(blocks) * 0.01 + 1e-4).astype(np.float16).astype(np.float32)
    m = (-rng.random(blocks) * 0.08).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (out_features, in_features // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15  # as quantising does: the block's least and largest values
    w = (d * q).astype(np.float32) + m
    return torch.from_numpy(w.reshape(out_features, in_features))


def scaled8_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as a Q8_0 model dequantises: fp32(d * q) with q in -127..127."""
    rng = np.random.default_rng(seed)
    d = (rng.random((out_features, in_features // 32, 1)) * 0.01 + 1e-4).astype(np.float16)
    q = rng.integers(-127, 128, (out_features, in_features // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    w = (d.astype(np.float32) * q).astype(np.float32)
    return torch.from_numpy(w.reshape(out_features, in_features))


def test_the_4_bit_grid_is_found_and_holds_every_value() -> None:
    weight = affine4_weight(128, 576)
    grid = cpu_gemm.to_grid(weight)
    assert grid is not None and grid.kind == cpu_gemm.AFFINE4
    assert torch.equal(grid.dense(), weight)
    assert grid.nbytes * 6 < weight.numel() * 4  # about 5 bits a weight in place of 32


def test_the_8_bit_grid_is_found_and_holds_every_value() -> None:
    weight = scaled8_weight(192, 576)
    grid = cpu_gemm.to_grid(weight)
    assert grid is not None and grid.kind == cpu_gemm.SCALED8
    assert torch.equal(grid.dense(), weight)


def test_a_transposed_view_is_read_as_the_weight_it_shows() -> None:
    weight = affine4_weight(64, 256, seed=4)
    stored = weight.t().contiguous()  # [in, out], as our Linear keeps it
    grid = cpu_gemm.to_grid(stored.t())
    assert grid is not None and torch.equal(grid.dense(), weight)


def test_weights_off_every_grid_have_none() -> None:
    nudged = affine4_weight(64, 256)
    nudged[5, 77] = torch.nextafter(nudged[5, 77], torch.tensor(1.0))
    with_nan = affine4_weight(64, 256)
    with_nan[0, 0] = float("nan")
    assert cpu_gemm.to_grid(torch.randn(64, 256)) is None
    assert cpu_gemm.to_grid(nudged) is None
    assert cpu_gemm.to_grid(with_nan) is None
    assert cpu_gemm.to_grid(affine4_weight(48, 256)) is None  # 3 tiles: not whole groups
    assert cpu_gemm.to_grid(affine4_weight(64, 256).double()) is None


needs_mkl = pytest.mark.skipif(
    not cpu_mkl_packing_available(torch.device("cpu"), torch.float32),
    reason="torch was built without MKL: nothing to match",
)


@needs_mkl
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (affine4_weight, (960, 576)),
        (affine4_weight, (576, 1536)),
        (affine4_weight, (576, 256)),
        (scaled8_weight, (512, 576)),
    ],
    ids=["qkv", "down", "small", "lm-head"],
)
def test_every_row_carries_the_bits_of_the_librarys_large_calls(make, shape) -> None:
    """The grid sums in the order MKL takes for calls of more than GRID_MAX_ROWS rows on
    this machine, so a row comes out the same in a call of any size (the library alone
    sums small calls otherwise on some CPUs)."""
    weight = make(*shape)
    grid = cpu_gemm.to_grid(weight)
    mkl = MKLPacked.of(weight)
    order = cpu_gemm.library_order(grid, lambda x: mkl_linear(x, mkl, None))
    assert order is not None
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(cpu_gemm.GRID_MAX_ROWS + 9, shape[1], generator=generator)
    expected = mkl_linear(x, mkl, None)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, cpu_gemm.GRID_MAX_ROWS, len(x)):
        assert torch.equal(cpu_gemm.grid_linear(x[-rows:], grid, order), expected[-rows:]), rows


@pytest.mark.parametrize(
    "order",
    [
        cpu_gemm.SumOrder((256,), False),
        cpu_gemm.SumOrder((128, 256), True),
        cpu_gemm.SumOrder((96, 192, 256), True),
    ],
    ids=["one-chain-unfused", "two-equal-parts", "parts-of-96"],
)
def test_the_order_of_a_library_is_found(order) -> None:
    """Whatever order a library sums in (here the grid's own GEMM in a given order), the
    order found gives its bits: so a CPU whose library sums otherwise still gets the grid."""
    grid = cpu_gemm.to_grid(affine4_weight(64, 256, seed=3))
    found = cpu_gemm.library_order(grid, lambda x: cpu_gemm.grid_linear(x, grid, order))
    assert found == order
    x = torch.randn(5, 256)
    assert not torch.equal(
        cpu_gemm.grid_linear(x, grid, order),
        cpu_gemm.grid_linear(x, grid, cpu_gemm.SumOrder((32, 64, 256), order.fused)),
    )


def test_a_library_no_order_reproduces_gets_none() -> None:
    weight = affine4_weight(64, 256, seed=5)
    grid = cpu_gemm.to_grid(weight)
    dense = weight.double()

    def pairwise_in_fp64(x: torch.Tensor) -> torch.Tensor:
        return (x.double() @ dense.t()).float()

    assert cpu_gemm.library_order(grid, pairwise_in_fp64) is None


def test_the_grid_serves_as_many_rows_as_it_is_faster_at() -> None:
    grid = cpu_gemm.to_grid(affine4_weight(64, 256, seed=6))
    order = cpu_gemm.SumOrder((256,), True)

    def slow_library(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return cpu_gemm.grid_linear(x, grid, order)

    def instant_library(x: torch.Tensor) -> None:
        return None

    assert cpu_gemm.rows_faster([(grid, order, slow_library)]) == cpu_gemm.GRID_MAX_ROWS
    assert cpu_gemm.rows_faster([(grid, order, instant_library)]) == cpu_gemm.MAX_ROWS


# Row counts that take each way of sharing the work: four tiles at a time (up to
# WIDE_ROWS), two (up to MAX_ROWS), and past MAX_ROWS whole groups rebuilt into scratch,
# the groups left over shared by rows, SCRATCH_ROWS at a time and then every count of
# rows left over (1 to SCRATCH_ROWS - 1).
SHARED_ROWS = (
    1,
    cpu_gemm.WIDE_ROWS,
    cpu_gemm.WIDE_ROWS + 1,
    cpu_gemm.MAX_ROWS,
    *range(cpu_gemm.MAX_ROWS + 1, cpu_gemm.MAX_ROWS + cpu_gemm.SCRATCH_ROWS + 1),
    cpu_gemm.MAX_ROWS + 14,
)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_row_and_output_is_summed_once_however_the_workers_share_them(threads) -> None:
    """Nine tile groups, taken four tiles at a time (up to WIDE_ROWS rows), two at a time
    (up to MAX_ROWS) or past MAX_ROWS rows whole, and the groups left over shared among the
    workers by rows. Every output is x @ W.T in the order, added once into out."""
    weight = affine4_weight(576, 256, seed=7)
    grid = cpu_gemm.to_grid(weight)
    order = cpu_gemm.SumOrder((128, 256), True)
    generator = torch.Generator().manual_seed(2)
    with torch_threads(threads):
        for rows in SHARED_ROWS:
            x = torch.randn(rows, 256, generator=generator)
            expected = cpu_gemm._emulate(weight.numpy(), x.numpy(), [order.ends], order.fused)[0]
            assert np.array_equal(cpu_gemm.grid_linear(x, grid, order).numpy(), expected), rows
            out = torch.ones(rows, 576)
            cpu_gemm.grid_linear(x, grid, order, out, add=True)
            assert torch.equal(out, torch.from_numpy(expected) + 1), rows


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_gate_up_gemm_gives_silu_mul_of_its_product(threads) -> None:
    """A [gate | up] weight of 2 x 288 outputs (nine groups of two gate tiles and the same
    two of up): with silu, each group's product goes through `cpu_layer.silu_times` and
    out gets what `silu_mul` makes of the whole product, bit for bit, for every row count
    and however the workers share the groups."""
    from pagedinfer.kernels import cpu_layer
    from pagedinfer.kernels.cpu_numba import Job, run_jobs

    weight = affine4_weight(576, 256, seed=11)
    grid = cpu_gemm.to_grid(weight)
    order = cpu_gemm.SumOrder((128, 256), True)
    gemm = cpu_gemm.gemm_all_rows(grid.kind, 256, order.ends, order.fused, silu=True)
    generator = torch.Generator().manual_seed(3)
    with torch_threads(threads):
        for rows in SHARED_ROWS:
            x = torch.randn(rows, 256, generator=generator) * 4  # SiLU's both sides
            expected = cpu_layer.silu_mul(cpu_gemm.grid_linear(x, grid, order))
            out = np.full((rows, 288 // 16, 16), np.nan, dtype=np.float32)
            run_jobs([Job(gemm, (x.numpy(), grid.codes, grid.scales, out, False), 18)])
            assert np.array_equal(out.reshape(rows, 288), expected.numpy()), rows


@needs_mkl
def test_adding_into_out_rounds_as_an_inplace_add() -> None:
    weight = affine4_weight(576, 576, seed=2)
    grid, mkl = cpu_gemm.to_grid(weight), MKLPacked.of(weight)
    order = cpu_gemm.library_order(grid, lambda x: mkl_linear(x, mkl, None))
    x, residual = torch.randn(cpu_gemm.GRID_MAX_ROWS + 1, 576), torch.randn(3, 576)
    expected = residual.clone()
    expected += mkl_linear(x, mkl, None)[:3]
    out = residual.clone()
    cpu_gemm.grid_linear(x[:3].contiguous(), grid, order, out, add=True)
    assert torch.equal(out, expected)
    # More rows than one pass takes: the tiles rebuilt once, every row run over them.
    residual = torch.randn(len(x), 576)
    expected = residual.clone()
    expected += mkl_linear(x, mkl, None)
    cpu_gemm.grid_linear(x, grid, order, residual, add=True)
    assert torch.equal(residual, expected)


def test_an_input_of_the_wrong_shape_is_refused() -> None:
    grid = cpu_gemm.to_grid(affine4_weight(64, 256))
    order = cpu_gemm.SumOrder((256,), True)
    with pytest.raises(ValueError, match=r"contiguous \[M, 256\]"):
        cpu_gemm.grid_linear(torch.randn(2, 128), grid, order)
    with pytest.raises(ValueError, match="add needs out"):
        cpu_gemm.grid_linear(torch.randn(2, 256), grid, order, add=True)
    with pytest.raises(ValueError, match=r"out must be contiguous \[2, 64\]"):
        cpu_gemm.grid_linear(torch.randn(2, 256), grid, order, torch.empty(64, 2).t(), add=True)
