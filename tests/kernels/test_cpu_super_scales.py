"""GGUF K-quant weights held as their files hold them: per 256 inputs fp16 scales, per run
small integer scales (and mins), multiplied out in registers as the dequantisation
multiplies them; each weight exactly llama.cpp's, each product the fixed order's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_gemm import emulate

from pagedinfer.kernels.cpu import grid_gemm
from pagedinfer.service import gguf_quants

# Each type's fp16 fields (byte offsets in its block): d, and dmin where it has one.
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,), "IQ4_NL": (0,)}


def k_blocks(type_name: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks * block bytes]: random codes and integer scales, fp16 fields of
    either sign over a few binades (zeros among them)."""
    rng = np.random.default_rng(seed)
    fmt = gguf_quants.FORMATS[type_name]
    raw = rng.integers(0, 256, (rows, blocks, fmt.nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        field = rng.normal(size=(rows, blocks)) * 2.0 ** rng.integers(-14, -6, (rows, blocks))
        field[0, 0] = 0.0
        raw[:, :, offset : offset + 2] = (
            field.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
        )
    return raw.reshape(rows, blocks * fmt.nbytes)


def file_grid(
    type_name: str, raw: np.ndarray, six_bits: bool
) -> tuple[grid_gemm.GridWeight, torch.Tensor]:
    """The executor's grid of a file tensor's blocks (6-bit codes in FINE6 or not), and the
    fp32 weight they dequantise to."""
    block = gguf_quants.block_grid(raw, type_name)
    assert block is not None
    grid = grid_gemm.from_codes(
        block.codes, block.d, block.m, block.low, block.high, block.supers, six_bits
    )
    weight = torch.from_numpy(gguf_quants.dequantize(raw, type_name))
    assert grid is not None
    return grid, weight


# type -> (kind, scales' dtype, bits a weight the grid takes)
LAYOUTS = {
    "Q4_K": (grid_gemm.AFFINE4, np.uint8, 4 + (64 + 8 * 32) * 8 / 4096),
    "Q5_K": (grid_gemm.SCALED8, np.uint8, 8 + (64 + 8 * 32) * 8 / 4096),
    "Q6_K": (grid_gemm.FINE6, np.int8, 6 + (32 + 16 * 16) * 8 / 4096),
    "Q6_K as 8-bit codes": (grid_gemm.FINE8, np.int8, 8 + (32 + 16 * 16) * 8 / 4096),
    "IQ4_XS": (grid_gemm.LEVELS4, np.int8, 4 + (32 + 8 * 16) * 8 / 4096),
    "IQ4_NL": (grid_gemm.LEVELS4, np.uint16, 4 + 2 * 16 / 32),  # fp16 d and m per 32
}


@pytest.mark.parametrize("type_name", list(LAYOUTS))
def test_a_k_quant_keeps_its_files_scales_and_gives_each_weight_exactly(type_name) -> None:
    """Scales as the file's integers (d * scale and dmin * min formed as the dequantisation
    forms them; IQ4_NL's fp16 d as it is), codes in as many bits as the file's (the
    i-quants' as indices into their levels), each weight the dequantisation's value, one
    ulp off not held, and the products the fixed order's bits in every call size."""
    kind, scale_type, bits = LAYOUTS[type_name]
    file_type = type_name.split()[0]
    blocks = 512 // gguf_quants.FORMATS[file_type].values
    raw = k_blocks(file_type, rows=64, blocks=blocks, seed=3)
    grid, weight = file_grid(file_type, raw, six_bits=kind == grid_gemm.FINE6)
    assert grid.kind == kind and grid.scales.dtype == scale_type
    assert grid.nbytes * 8 == bits * weight.numel()
    assert torch.equal(grid.dense(), weight) and grid_gemm.holds(grid, weight)
    off = weight.clone()
    off[37, 300] = torch.nextafter(off[37, 300], torch.tensor(np.inf))
    assert not grid_gemm.holds(grid, off)
    # The fp32 d and m the kernels form are those the file's dequantisation forms.
    block = gguf_quants.block_grid(raw, file_type)
    plain = grid_gemm.from_codes(block.codes, block.d, block.m, block.low, block.high)
    assert np.array_equal(grid_gemm._fp32_scales(grid.scales), grid_gemm._fp32_scales(plain.scales))
    order = grid_gemm.fixed_order(512)
    x = torch.randn(grid_gemm.MAX_ROWS + 9, 512, generator=torch.Generator().manual_seed(2))
    expected = emulate(weight, x, order)
    for rows in (1, grid_gemm.WIDE_ROWS + 1, grid_gemm.MAX_ROWS, len(x)):
        assert torch.equal(grid_gemm.grid_linear(x[:rows], grid, order), expected[:rows]), rows


@pytest.mark.parametrize("kind", [grid_gemm.FINE6, grid_gemm.FINE8])
def test_q4_k_and_q6_k_parts_of_one_weight_keep_their_files_scales(kind) -> None:
    """A fused weight of Q4_K rows (q, k) and Q6_K rows (v), as a Q4_K_M file's layers
    have it: runs of 16, the Q4_K runs' scales twice, Q6_K's with zero mins, in 6-bit or
    8-bit codes; exact, and the fixed order's products."""
    parts = [("Q4_K", 48), ("Q6_K", 16)]
    raws = [k_blocks(name, rows, blocks=2, seed=9 + rows) for name, rows in parts]
    blocks = [gguf_quants.block_grid(raw, name) for raw, (name, _) in zip(raws, parts, strict=True)]
    whole = gguf_quants.concatenate(blocks)
    assert whole.supers is not None and whole.supers.mins is not None
    assert whole.group == 16
    six_bits = kind == grid_gemm.FINE6
    grid = grid_gemm.from_codes(
        whole.codes, whole.d, whole.m, whole.low, whole.high, whole.supers, six_bits
    )
    weight = torch.cat(
        [
            torch.from_numpy(gguf_quants.dequantize(raw, name))
            for raw, (name, _) in zip(raws, parts, strict=True)
        ]
    )
    assert grid.kind == kind and grid.scales.dtype == np.uint8
    assert torch.equal(grid.dense(), weight) and grid_gemm.holds(grid, weight)
    wide = grid_gemm.fine(grid)  # as a position mixing it with other kinds takes it
    assert wide.kind == grid_gemm.FINE8 and (wide is grid or wide.scales.dtype == np.float32)
    assert torch.equal(wide.dense(), weight) and grid_gemm.holds(wide, weight)
    order = grid_gemm.fixed_order(512)
    x = torch.randn(grid_gemm.MAX_ROWS + 3, 512, generator=torch.Generator().manual_seed(4))
    expected = emulate(weight, x, order)
    for rows in (2, len(x)):
        assert torch.equal(grid_gemm.grid_linear(x[:rows], grid, order), expected[:rows]), rows


def test_scales_that_do_not_give_the_weights_d_and_m_are_not_taken() -> None:
    """Super-block scales that disagree with the grid's d and m, or do not cover them,
    leave the grid in fp32 scales, which hold what d and m say."""
    raw = k_blocks("Q4_K", rows=64, blocks=2, seed=5)
    block = gguf_quants.block_grid(raw, "Q4_K")
    assert block is not None and block.supers is not None
    scales = block.supers.scales.copy()
    scales[3, 1] += 1
    wrong = gguf_quants.SuperScales(block.supers.d, scales, block.supers.dmin, block.supers.mins)
    grid = grid_gemm.from_codes(block.codes, block.d, block.m, block.low, block.high, wrong)
    assert grid is not None and grid.scales.dtype == np.float32
    dropped = gguf_quants.SuperScales(block.supers.d[:, :1], block.supers.scales[:, :8])
    grid = grid_gemm.from_codes(block.codes, block.d, block.m, block.low, block.high, dropped)
    assert grid is not None and grid.scales.dtype == np.float32


def test_the_levels_are_the_i_quants_levels() -> None:
    assert tuple(gguf_quants.IQ4_LEVELS.tolist()) == grid_gemm.LEVELS
