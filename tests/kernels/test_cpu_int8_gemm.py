"""Integer GEMMs over a GGUF file's codes: the rows quantised to int8 as llama.cpp's q8_0
rounds them, each run's code products summed exactly in integers and scaled in one
fixed order, each weight still exactly the file's value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the integer GEMM is compiled with numba")

from test_cpu_gemm import fma32
from test_cpu_super_scales import FP16_FIELDS, k_blocks
from threads import torch_threads

from pagedinfer.kernels.cpu import grid_gemm, int8_gemm
from pagedinfer.service import gguf_quants

FIELDS = {**FP16_FIELDS, "Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,)}


def quantize(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 rounding of fp32 rows [M, K] per block of 32 (its AVX2 code; a
    K-quant's weight takes blocks of 256, as q8_K): codes rint(x * (127 / max |x|)), ties
    to even, and scales max |x| / 127, both in fp32."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block)
    largest = np.abs(blocks).max(axis=2)
    scales = (largest / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(largest > 0, np.float32(127) / largest, np.float32(0))
    codes = np.rint(blocks * inverse[..., None].astype(np.float32))
    return np.clip(codes, -127, 127).astype(np.int8).reshape(m, k), scales


def reference(grid: grid_gemm.GridWeight, x: np.ndarray) -> np.ndarray:
    """The integer GEMM's outputs [M, N], in numpy: per run of the grid (16 or 32 inputs)
    the int64 dot product of its codes and the row's codes, then, in K order from 0,
    total = fma(fp32(dot), fp32(d * s), total) and total = fma(m, fp32(s * sum(a)), total).
    A weight of SUPER scales (a K-quant's): `super_reference`."""
    if grid_gemm.super_layout(grid.scales) is not None:
        return super_reference(grid, x)
    a, s = quantize(x)
    q = grid_gemm._codes(grid.kind, grid.codes).astype(np.int64)  # [tiles, K, 16]
    dm = grid_gemm._fp32_scales(grid.scales)  # [tiles, runs, 2, 16]
    tiles, k = q.shape[:2]
    run = k // dm.shape[1]
    q = q.transpose(0, 2, 1).reshape(tiles * 16, k)
    d = dm[:, :, 0].transpose(0, 2, 1).reshape(tiles * 16, -1)
    offset = dm[:, :, 1].transpose(0, 2, 1).reshape(tiles * 16, -1)
    total = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)
    for b in range(k // run):
        part = slice(b * run, (b + 1) * run)
        dots = a[:, part].astype(np.int64) @ q[:, part].T  # [M, N]
        row_s = s[:, b * run // 32, None]
        sums = (row_s * a[:, part].astype(np.int64).sum(axis=1, keepdims=True)).astype(np.float32)
        scale = (d[None, :, b] * row_s).astype(np.float32)
        total = fma32(dots.astype(np.float32), scale, total)
        total = fma32(np.broadcast_to(offset[None, :, b], total.shape), sums, total)
    return total


def super_reference(grid: grid_gemm.GridWeight, x: np.ndarray) -> np.ndarray:
    """The integer GEMM's outputs [M, N] for a weight of SUPER scales, in numpy: rows
    quantised per super-block of 256 (scale s), and per super-block in K order the int64
    sums I = sum over runs of scale * (q . a) and I_min = sum of min * sum(a), then
    total = fma(fp32(I), fp32(d * s), total) and, with mins,
    total = fma(fp32(I_min), fp32(dmin * -s), total)."""
    a, s = quantize(x, block=grid_gemm.SUPER_BLOCK)
    head, per_run = grid_gemm.super_layout(grid.scales)
    q = grid_gemm._codes(grid.kind, grid.codes).astype(np.int64)  # [tiles, K, 16]
    tiles, k = q.shape[:2]
    raw = grid.scales.view(np.uint8)  # [tiles, supers, bytes]
    supers = raw.shape[1]
    runs = (raw.shape[2] - head) // per_run
    run = grid_gemm.SUPER_BLOCK // runs

    def lanes(part: np.ndarray) -> np.ndarray:  # [tiles, supers, (runs,) 16] -> [.., N]
        return np.moveaxis(part, 0, -2).reshape(*part.shape[1:-1], tiles * 16)

    d = lanes(np.ascontiguousarray(raw[:, :, : 2 * 16]).view(np.float16).astype(np.float32))
    body = raw[:, :, head:].reshape(tiles, supers, runs, per_run)
    scale = lanes(body[..., :16].view(np.int8).astype(np.int64))  # [supers, runs, N]
    mins = per_run == 2 * 16
    if mins:
        dmin = np.ascontiguousarray(raw[:, :, 2 * 16 : 4 * 16]).view(np.float16)
        dmin = lanes(dmin.astype(np.float32))
        least = lanes(body[..., 16:].astype(np.int64))
    q = q.transpose(0, 2, 1).reshape(tiles * 16, k)
    total = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)
    for sb in range(supers):
        ints = np.zeros(total.shape, dtype=np.int64)
        ints_min = np.zeros(total.shape, dtype=np.int64)
        for j in range(runs):
            part = slice((sb * runs + j) * run, (sb * runs + j + 1) * run)
            row = a[:, part].astype(np.int64)
            ints += (row @ q[:, part].T) * scale[sb, j][None]
            if mins:
                ints_min += row.sum(axis=1, keepdims=True) * least[sb, j][None]
        row_s = s[:, sb, None]
        total = fma32(ints.astype(np.float32), (d[sb][None] * row_s).astype(np.float32), total)
        if mins:
            factor = (dmin[sb][None] * -row_s).astype(np.float32)
            total = fma32(ints_min.astype(np.float32), factor, total)
    return total


def file_grid(type_name: str, rows: int, k: int, seed: int, six_bits: bool = False):
    fmt = gguf_quants.FORMATS[type_name]
    raw = _blocks(type_name, rows, k // fmt.values, seed)
    block = gguf_quants.block_grid(raw, type_name)
    grid = grid_gemm.from_codes(
        block.codes, block.d, block.m, block.low, block.high, block.supers, six_bits
    )
    return grid, torch.from_numpy(gguf_quants.dequantize(raw, type_name))


def _blocks(type_name: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    if type_name in FP16_FIELDS:
        return k_blocks(type_name, rows, blocks, seed)
    rng = np.random.default_rng(seed)
    fmt = gguf_quants.FORMATS[type_name]
    raw = rng.integers(0, 256, (rows, blocks, fmt.nbytes), dtype=np.uint8)
    d = rng.normal(size=(rows, blocks)) * 2.0 ** rng.integers(-12, -6, (rows, blocks))
    raw[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * fmt.nbytes)


# type -> (the grid's kind, the integer layout)
TYPES = {
    "Q4_0": (grid_gemm.AFFINE4, grid_gemm.DOT4),
    "Q4_K": (grid_gemm.AFFINE4, grid_gemm.DOT4),
    "Q8_0": (grid_gemm.SCALED8, grid_gemm.DOT8),
    "Q5_0": (grid_gemm.SCALED8, grid_gemm.DOT8),
    "Q5_K": (grid_gemm.SCALED8, grid_gemm.DOT5),
    "Q5_K in 8 bits": (grid_gemm.SCALED8, grid_gemm.DOT8),
    "Q6_K": (grid_gemm.FINE8, grid_gemm.DOT6_FINE),
    "Q6_K in 6 bits": (grid_gemm.FINE6, grid_gemm.DOT6_FINE),
    "Q6_K in 8 bits": (grid_gemm.FINE8, grid_gemm.DOT8_FINE),
}


@pytest.mark.parametrize("type_name", list(TYPES))
def test_integer_products_of_each_types_codes_equal_the_exact_reference(type_name) -> None:
    """Each weight the file's value; every row count (one pass of ROWS rows, rows left
    over one at a time) gives the reference's bits, with one worker or two."""
    kind, dot = TYPES[type_name]
    file_type = type_name.split()[0]
    grid, weight = file_grid(file_type, 128, 512, seed=5, six_bits="6 bits" in type_name)
    assert grid.kind == kind
    narrow = "8 bits" not in type_name
    ints = int8_gemm.to_int8(grid, six_bits=narrow, five_bits=narrow)
    assert ints.kind == dot and ints.scales is grid.scales
    assert torch.equal(ints.dense(), weight)
    x = torch.randn(2 * int8_gemm.ROWS + 1, 512, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0  # a block of zeros: scale 0, codes 0
    expected = reference(ints, x.numpy())
    order = grid_gemm.fixed_order(512)
    for threads in (1, 2):
        with torch_threads(threads):
            for rows in (1, 3, int8_gemm.ROWS, len(x)):
                got = grid_gemm.grid_linear(x[:rows], ints, order)
                assert np.array_equal(got.numpy(), expected[:rows]), (threads, rows)
    # close to the fp32 product: the rows' int8 rounding is all that differs
    exact = x @ weight.T
    error = (grid_gemm.grid_linear(x, ints, order) - exact).abs().max()
    assert error < 0.02 * exact.abs().max()


def test_q4_k_and_q6_k_rows_of_one_weight_and_addition_into_out() -> None:
    """A fused q/k/v weight of a Q4_K_M file (Q4_K rows, then Q6_K): runs of 16 with the
    Q4_K runs' mins; `add` adds the product into out."""
    parts = [("Q4_K", 48), ("Q6_K", 16)]
    raws = [k_blocks(name, rows, blocks=1, seed=rows) for name, rows in parts]
    blocks = [gguf_quants.block_grid(raw, name) for raw, (name, _) in zip(raws, parts, strict=True)]
    whole = gguf_quants.concatenate(blocks)
    grid = grid_gemm.from_codes(whole.codes, whole.d, whole.m, whole.low, whole.high, whole.supers)
    ints = int8_gemm.to_int8(grid)
    assert ints.kind == grid_gemm.DOT6_FINE and ints.scales.dtype == np.uint8
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    out = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    expected = out.numpy() + reference(ints, x.numpy())
    grid_gemm.grid_linear(x, ints, grid_gemm.fixed_order(256), out=out, add=True)
    assert np.array_equal(out.numpy(), expected)


def test_runs_of_16_with_codes_past_6_bits_keep_8_bits() -> None:
    """A grid of runs of 16 whose codes leave -32..31 becomes DOT8_FINE, whatever is asked;
    one whose codes fit becomes DOT6_FINE, and both give the reference's bits."""
    rng = np.random.default_rng(7)
    d = rng.uniform(0.01, 0.02, (64, 8)).astype(np.float32)
    m = np.zeros_like(d)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(8))
    for low, high, kind in ((-32, 31, grid_gemm.DOT6_FINE), (-33, 31, grid_gemm.DOT8_FINE)):
        codes = rng.integers(low, high + 1, (64, 128)).astype(np.int8)
        codes[0, 0], codes[1, 1] = low, high
        grid = grid_gemm.from_codes(codes, d, m, low, high, six_bits=False)
        assert grid.kind == grid_gemm.FINE8
        ints = int8_gemm.to_int8(grid)
        assert ints.kind == kind
        assert torch.equal(ints.dense(), grid.dense())
        got = grid_gemm.grid_linear(x, ints, grid_gemm.fixed_order(128))
        assert np.array_equal(got.numpy(), reference(ints, x.numpy()))


def test_rows_are_quantised_as_llama_cpp_rounds_them() -> None:
    """Zeros give scale 0 and codes 0; the largest magnitude gives +-127; halves of a code
    round to even; the kernel's codes, scales and run sums are the rule's."""
    x = np.zeros((3, 64), dtype=np.float32)
    x[1, :6] = [127, 2.5, 3.5, -0.5, -1.5, 0.49]  # max 127: x * 1, ties to even
    x[1, 32:35] = [-0.2, 0.1, 0.05]  # the largest negative gives -127
    x[2] = np.linspace(-3, 1, 64, dtype=np.float32)
    codes = np.empty((3, 64), dtype=np.int8)
    scales = np.empty((3, 2), dtype=np.float32)
    sums = np.empty((3, 4), dtype=np.float32)
    int8_gemm.quantize_rows(x, codes, scales, sums)
    assert not codes[0].any() and not scales[0].any() and not sums[0].any()
    assert list(codes[1, :6]) == [127, 2, 4, 0, -2, 0] and scales[1, 0] == 1
    assert list(codes[1, 32:35]) == [-127, 64, 32] and scales[1, 1] == np.float32(0.2) / 127
    want_codes, want_scales = quantize(x)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    run_sums = codes.reshape(3, 4, 16).astype(np.int64).sum(axis=2)
    expected = (np.repeat(scales, 2, axis=1) * run_sums).astype(np.float32)
    assert np.array_equal(sums, expected)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_the_gate_up_gemm_gives_silu_mul_of_its_product(type_name, gelu) -> None:
    """A [gate | up] weight of 2 x 2,560 outputs (80 groups of two gate tiles and the same
    two of up: more than one SiLU chunk for one row, and a chunk left part full): out gets
    what `silu_mul` makes of the integer GEMM's whole product, bit for bit, for every row
    count, with one worker or two."""
    from pagedinfer.kernels.cpu import layer_ops
    from pagedinfer.kernels.cpu.numba_support import Job, run_jobs

    grid, _ = file_grid(type_name, 5120, 256, seed=9)
    ints = int8_gemm.to_int8(grid)
    order = grid_gemm.fixed_order(256)
    gemm = grid_gemm.gemm_all_rows(ints.kind, 256, order.ends, order.fused, True, gelu)
    assert int8_gemm.SILU_VALUES // (grid_gemm.TILE_GROUP // 2 * 16) < 80
    generator = torch.Generator().manual_seed(3)
    for threads in (1, 2):
        with torch_threads(threads):
            for rows in (1, 3, int8_gemm.ROWS, 2 * int8_gemm.ROWS + 1):
                x = torch.randn(rows, 256, generator=generator) * 4  # SiLU's both sides
                expected = layer_ops.silu_mul(grid_gemm.grid_linear(x, ints, order), gelu)
                out = np.full((rows, 2560 // 16, 16), np.nan, dtype=np.float32)
                run_jobs([Job(gemm, (x.numpy(), ints.codes, ints.scales, out, False), 80)])
                assert np.array_equal(out.reshape(rows, 2560), expected.numpy()), (threads, rows)
