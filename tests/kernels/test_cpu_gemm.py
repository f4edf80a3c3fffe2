"""GEMMs from weights kept on their quantisation grid: the grid is found exactly, and the
products carry MKL's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the grid GEMM is compiled with numba")

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
def test_products_carry_the_library_bits_at_every_row_count(make, shape) -> None:
    weight = make(*shape)
    grid = cpu_gemm.to_grid(weight)
    mkl = MKLPacked.of(weight)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
        x = torch.randn(rows, shape[1], generator=generator)
        assert torch.equal(cpu_gemm.grid_linear(x, grid), mkl_linear(x, mkl, None)), rows
    assert cpu_gemm.matches_mkl(grid, lambda x: mkl_linear(x, mkl, None))


@needs_mkl
def test_adding_into_out_rounds_as_an_inplace_add() -> None:
    weight = affine4_weight(576, 576, seed=2)
    grid, mkl = cpu_gemm.to_grid(weight), MKLPacked.of(weight)
    x, residual = torch.randn(3, 576), torch.randn(3, 576)
    expected = residual.clone()
    expected += mkl_linear(x, mkl, None)
    out = residual.clone()
    cpu_gemm.grid_linear(x, grid, out, add=True)
    assert torch.equal(out, expected)


def test_an_input_of_the_wrong_shape_is_refused() -> None:
    grid = cpu_gemm.to_grid(affine4_weight(64, 256))
    with pytest.raises(ValueError, match=r"contiguous \[M, 256\]"):
        cpu_gemm.grid_linear(torch.randn(2, 128), grid)
    with pytest.raises(ValueError, match="add needs out"):
        cpu_gemm.grid_linear(torch.randn(2, 256), grid, add=True)
