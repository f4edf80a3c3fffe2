"""fp32 GEMMs of few rows on CPU from weights kept on the grid they were quantised to,
with the bits MKL's packed sgemm gives (numba).

A model that comes as a GGUF file (the embedded SmolLM2 is Q4_1, its embeddings Q8_0) is
dequantised to fp32 once, and every fp32 weight is then a grid point: in each run of 32
inputs of an output row, w = fp16(d) * q + fp16(m) with q in 0..15 (4-bit, affine) or
w = fp16(d) * q with q in -127..127 (8-bit). `to_grid` finds that grid in the fp32
weight and keeps it in 5 (4-bit) or 9 (8-bit) bits a weight instead of 32.

Why it pays: a decode step of a few tokens reads every weight once and does little with
it, so its GEMMs take as long as reading 538 MB of fp32 weights. SmolLM2's grids hold
the same values in 98 MB (LM head included); `gemm` rebuilds each weight in registers
(two rounded operations, as the dequantisation did) and multiplies in fp32. Its 30
layers' GEMMs took 8.1 ms at 1 row, 10.7 at 4 and 14.6 at 8, against 14-20, 19-25 and
22-28 ms for MKL's packed sgemm (2 threads, weights from memory).

Same bits: for the shapes of these models MKL sums each output over K in ceil(K / 384)
equal parts, each one chain of fused multiply-adds from 0 in K order, and then adds the
parts in order (measured for SmolLM2's shapes on 1 and 2 threads, at every row count).
`gemm` does the same, so a row comes out the same whichever path computes it. The
library's order is not the same for every shape, row count and thread count (one row of
128 outputs on 2 threads sums otherwise): `matches_mkl` checks the model's weights
against the library before a model uses them.

Layouts: 16 output columns form a tile (a vector of fp32 lanes).
- 4-bit: codes uint8 [tiles, K / 2, 16], byte (t, p, j) = q[16t + j, 2p] + 16 q[16t + j,
  2p + 1]; scales uint16 (fp16 bits) [tiles, K / 32, 2, 16]: d then m.
- 8-bit: codes int8 [tiles, K, 16]; scales uint16 [tiles, K / 32, 2, 16] (m is 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba.core import types

from pagedinfer.kernels.cpu_numba import (
    EXACT,
    FASTMATH,
    Job,
    intrinsic,
    jit,
    lanes_add,
    lanes_copy,
    lanes_fma,
    run_jobs,
    stack_array,
)

LANES = 16  # output columns per tile: one 512-bit vector of fp32
GRID_BLOCK = 32  # inputs sharing one scale (and offset), as in GGUF's Q4_1 and Q8_0
MKL_K_PART = 384  # the longest part of K that MKL's sgemm sums in one chain
# The most rows one pass over the weight serves (more rows take more passes), and the
# tiles it works on at once: enough independent chains to hide the FMA latency, few
# enough that the accumulators stay in the 32 vector registers (measured on SmolLM2's
# 30 layers, 2 threads: 8.1 ms at 1 row, 10.7 at 4, 14.6 at 8 with 2 tiles, 32.5 with 4).
MAX_ROWS = 8
TILE_GROUP = 4  # tiles per group; kernels of more than WIDE_ROWS rows take half of it
WIDE_ROWS = 5
AFFINE4, SCALED8 = "affine4", "scaled8"


@dataclass(frozen=True)
class GridWeight:
    """An fp32 weight [out_features, in_features] held as its quantisation grid."""

    kind: str  # AFFINE4 or SCALED8
    out_features: int
    in_features: int
    codes: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dense(self) -> torch.Tensor:
        """The fp32 weight the grid holds (for checks: the kernels never build it)."""
        tiles = self.out_features // LANES
        k = self.in_features
        scales = self.scales.view(np.float16).astype(np.float32)
        d = np.repeat(scales[:, :, 0, :], GRID_BLOCK, axis=1)  # [tiles, K, 16]
        m = np.repeat(scales[:, :, 1, :], GRID_BLOCK, axis=1)
        if self.kind == AFFINE4:
            q = np.empty((tiles, k, LANES), dtype=np.float32)
            q[:, 0::2] = self.codes & 15
            q[:, 1::2] = self.codes >> 4
        else:
            q = self.codes.astype(np.float32)
        w = (d * q).astype(np.float32) + m
        return torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1))).reshape(
            self.out_features, k
        )


def k_part(in_features: int) -> int:
    """The length of each of MKL's equal parts of K (0 where they are not whole grid blocks)."""
    parts = -(-in_features // MKL_K_PART)
    size = in_features // parts
    return size if size * parts == in_features and size % GRID_BLOCK == 0 else 0


def shape_supported(out_features: int, in_features: int) -> bool:
    return out_features % (LANES * TILE_GROUP) == 0 and k_part(in_features) > 0


def to_grid(weight: torch.Tensor) -> GridWeight | None:
    """The 4-bit affine or 8-bit grid that holds every value of `weight` exactly (fp32
    [out_features, in_features], a view of an [in_features, out_features] tensor or
    contiguous), or None where there is none (or the shape does not tile)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if not shape_supported(n, k):
        return None
    # The grid runs along in_features: read [in, out] rows, each a run of out_features
    # (a copy where the weight is stored [out, in]: 3x faster than reading it strided).
    w = weight.detach().t().contiguous().numpy()
    for kind in (AFFINE4, SCALED8):
        affine = kind == AFFINE4
        m, span = _ranges(w, affine)  # [blocks, n]
        if not (np.isfinite(span).all() and (m.astype(np.float16).astype(np.float32) == m).all()):
            continue
        high = 15 if affine else 127
        guess = (span.astype(np.float64) / high).astype(np.float16)
        candidates = np.stack((guess, *_fp16_neighbours(guess)), axis=-1)  # [blocks, n, c]
        tiles = n // LANES
        codes = np.empty((tiles, k // 2, LANES) if affine else (tiles, k, LANES), np.uint8)
        chosen = np.empty(m.shape, dtype=np.int64)
        if not _fit(w, candidates.astype(np.float32), m, affine, codes, chosen):
            continue
        d = np.take_along_axis(candidates, chosen[..., None], axis=-1)[..., 0]
        scales = np.stack((d, m.astype(np.float16)), axis=1)  # [blocks, 2, n]
        scales = scales.reshape(k // GRID_BLOCK, 2, tiles, LANES).transpose(2, 0, 1, 3)
        codes = codes if affine else codes.view(np.int8)
        return GridWeight(kind, n, k, codes, np.ascontiguousarray(scales).view(np.uint16))
    return None


@jit(nogil=True, error_model="numpy")
def _ranges(w: np.ndarray, affine: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per block of GRID_BLOCK inputs and output (w: [in, out]): the offset m (the least
    value, or 0 for the 8-bit grid) and the span the largest code covers (max - min, or
    the largest magnitude), each [blocks, out]."""
    k, n = w.shape
    m = np.zeros((k // GRID_BLOCK, n), dtype=np.float32)
    span = np.zeros((k // GRID_BLOCK, n), dtype=np.float32)
    lo = np.empty(n, dtype=np.float32)
    hi = np.empty(n, dtype=np.float32)
    for b in range(k // GRID_BLOCK):
        lo[:] = w[b * GRID_BLOCK]
        hi[:] = w[b * GRID_BLOCK]
        for i in range(b * GRID_BLOCK, (b + 1) * GRID_BLOCK):
            for j in range(n):
                v = w[i, j] if affine else abs(w[i, j])
                lo[j] = min(lo[j], v)
                hi[j] = max(hi[j], v)
        for j in range(n):
            if affine:
                m[b, j], span[b, j] = lo[j], hi[j] - lo[j]
            else:
                span[b, j] = hi[j]
    return m, span


@jit(nogil=True, error_model="numpy")
def _fit(
    w: np.ndarray,
    candidates: np.ndarray,
    m: np.ndarray,
    affine: bool,
    codes: np.ndarray,
    chosen: np.ndarray,
) -> bool:
    """For each block the first candidate scale d whose codes q (rounded, clipped to the
    grid) give back every value as fp32(d * q) + m, written into `codes` in the tile
    layout; False as soon as a block has none."""
    low, high = (0, 15) if affine else (-127, 127)
    for b in range(m.shape[0]):
        for j in range(m.shape[1]):
            t, lane, offset = j // LANES, j % LANES, m[b, j]
            found = False
            for c in range(candidates.shape[2]):
                d = candidates[b, j, c]
                ok = True
                for i in range(b * GRID_BLOCK, (b + 1) * GRID_BLOCK):
                    q = 0.0 if d == 0 else min(max(np.rint((w[i, j] - offset) / d), low), high)
                    if np.float32(d * np.float32(q)) + offset != w[i, j]:
                        ok = False
                        break
                    code = np.uint8(np.int64(q) & 255)
                    if not affine:
                        codes[t, i, lane] = code
                    elif i % 2 == 0:
                        codes[t, i // 2, lane] = code
                    else:
                        codes[t, i // 2, lane] |= code << np.uint8(4)
                if ok:
                    chosen[b, j], found = c, True
                    break
            if not found:
                return False
    return True


def _fp16_neighbours(x: np.ndarray) -> tuple[np.ndarray, ...]:
    up = np.nextafter(x, np.float16(np.inf))
    down = np.nextafter(x, np.float16(0))
    return up, down, np.nextafter(up, np.float16(np.inf)), np.nextafter(down, np.float16(0))


@intrinsic
def _dequant(typingctx: Any, w: Any, kind: Any, codes: Any, at: Any, scales: Any, sat: Any) -> Any:
    """The weights of one step of the inputs for one tile, rebuilt as
    fp32(d * q) + m, each operation rounded once (as the dequantisation rounded them):
    4-bit: w[0] and w[1] from the 16 bytes codes[at:] (inputs 2p and 2p + 1); 8-bit:
    w[0] from codes[at:]. d, m: the 2 x 16 fp16 values scales[sat:]."""
    if not isinstance(kind, types.StringLiteral):
        return None
    affine = kind.literal_value == AFFINE4

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.VectorType(ir.FloatType(), LANES)
        i32 = ir.VectorType(ir.IntType(32), LANES)

        def vector_at(i: int, offset: Any, element: ir.Type) -> Any:
            data = context.make_array(signature.args[i])(context, builder, args[i]).data
            pointer = builder.gep(data, [offset])
            return builder.bitcast(pointer, ir.VectorType(element, LANES).as_pointer())

        def half_lanes(offset: Any) -> Any:
            raw = builder.load(vector_at(4, offset, ir.IntType(16)), align=2)
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), f32)

        d = half_lanes(args[5])
        m = half_lanes(builder.add(args[5], ir.Constant(args[5].type, LANES)))
        raw = builder.load(vector_at(2, args[3], ir.IntType(8)), align=1)
        if affine:
            wide = builder.zext(raw, i32)
            codes = [
                builder.and_(wide, ir.Constant(i32, [15] * LANES)),
                builder.lshr(wide, ir.Constant(i32, [4] * LANES)),
            ]
        else:
            codes = [builder.sext(raw, i32)]
        out = context.make_array(signature.args[0])(context, builder, args[0])
        for i, code in enumerate(codes):
            value = builder.fadd(
                builder.fmul(builder.sitofp(code, f32), d, flags=EXACT), m, flags=EXACT
            )
            target = builder.gep(out.data, [ir.Constant(ir.IntType(64), i * LANES)])
            builder.store(value, builder.bitcast(target, f32.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(w, kind, codes, at, scales, sat), codegen


@functools.cache
def gemm_kernel(kind: str, rows: int, in_features: int) -> Callable[..., None]:
    """gemm(x, r0, codes, scales, out, add, worker, workers): rows r0 .. r0 + rows - 1 of
    x [M, K] times the grid weight, into the same rows of out [M, tiles, 16] (add: out +=
    the product, rounded once more, as `out += x @ W.T` does). The worker does tile groups
    worker, worker + workers, ... of the weight's tiles // `tiles_per_group(rows)`."""
    k, part = in_features, k_part(in_features)
    tb, steps = tiles_per_group(rows), 2 if kind == AFFINE4 else 1
    blocks = k // GRID_BLOCK
    code_row = k // steps * LANES  # codes of one tile

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def gemm(
        x: np.ndarray,
        r0: int,
        codes: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        add: bool,
        worker: int,
        workers: int,
    ) -> None:
        total = stack_array((tb, rows, LANES))
        acc = stack_array((tb, rows, LANES))
        w = stack_array((tb, 2, LANES))
        for group in range(worker, out.shape[1] // tb, workers):
            t0 = group * tb
            for b in range(tb):
                for r in range(rows):
                    lanes_copy(total[b, r], 0.0, LANES)
            for start in range(0, k, part):
                for b in range(tb):
                    for r in range(rows):
                        lanes_copy(acc[b, r], 0.0, LANES)
                for i in range(start, start + part, steps):
                    for b in range(tb):
                        t = t0 + b
                        at = t * code_row + i // steps * LANES
                        sat = (t * blocks + i // GRID_BLOCK) * 2 * LANES
                        _dequant(w[b], kind, codes, at, scales, sat)
                    for h in range(steps):
                        for r in range(rows):
                            xr = x[r0 + r, i + h]
                            for b in range(tb):
                                lanes_fma(acc[b, r], w[b, h], xr, LANES)
                for b in range(tb):
                    for r in range(rows):
                        lanes_add(total[b, r], acc[b, r], LANES)
            for b in range(tb):
                for r in range(rows):
                    if add:
                        lanes_add(out[r0 + r, t0 + b], total[b, r], LANES)
                    else:
                        lanes_copy(out[r0 + r, t0 + b], total[b, r], LANES)

    return gemm


def tiles_per_group(rows: int) -> int:
    return TILE_GROUP if rows <= WIDE_ROWS else TILE_GROUP // 2


@functools.cache
def gemm_all_rows(kind: str, in_features: int) -> Callable[..., None]:
    """gemm(x, codes, scales, out, add, worker, workers): `gemm_kernel`'s product for every
    row of x, MAX_ROWS rows per pass over the weight. Every worker takes part (each
    kernel's tile groups are split among them)."""
    g1, g2, g3, g4, g5, g6, g7, g8 = (
        gemm_kernel(kind, rows, in_features) for rows in range(1, MAX_ROWS + 1)
    )

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def gemm(
        x: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        add: bool,
        worker: int,
        workers: int,
    ) -> None:
        for r0 in range(0, x.shape[0], MAX_ROWS):
            rows = min(MAX_ROWS, x.shape[0] - r0)
            if rows == 8:
                g8(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 7:
                g7(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 6:
                g6(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 5:
                g5(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 4:
                g4(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 3:
                g3(x, r0, codes, scales, out, add, worker, workers)
            elif rows == 2:
                g2(x, r0, codes, scales, out, add, worker, workers)
            else:
                g1(x, r0, codes, scales, out, add, worker, workers)

    return gemm


def grid_linear(
    x: torch.Tensor, weight: GridWeight, out: torch.Tensor | None = None, add: bool = False
) -> torch.Tensor:
    """x @ W.T on the worker threads, W held as `weight` (x: fp32 [M, in_features], C
    contiguous). add: out += the product in place (out given)."""
    if add and out is None:
        raise ValueError("grid_linear: add needs out")
    if x.dim() != 2 or x.shape[1] != weight.in_features or not x.is_contiguous():
        raise ValueError(
            f"grid_linear: x must be contiguous [M, {weight.in_features}], got {tuple(x.shape)}"
        )
    if out is None:
        out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    view = out.numpy().reshape(x.shape[0], weight.out_features // LANES, LANES)
    gemm = gemm_all_rows(weight.kind, weight.in_features)
    args = (x.numpy(), weight.codes, weight.scales, view, add)
    run_jobs([Job(gemm, args, weight.out_features // LANES // TILE_GROUP)])
    return out


def matches_mkl(weight: GridWeight, mkl_linear: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `gemm` gives exactly what the library gives for this weight on this machine
    and thread count, at every row count a pass takes and at two passes (random inputs;
    the library's weight: `mkl_linear`). The library's order can change with the shape,
    the rows and the threads (one row of 128 outputs on two threads sums otherwise)."""
    x = torch.randn(MAX_ROWS + 1, weight.in_features, generator=torch.Generator().manual_seed(0))
    expected = mkl_linear(x)
    return all(
        torch.equal(grid_linear(x[:rows], weight), mkl_linear(x[:rows]))
        for rows in range(1, MAX_ROWS)
    ) and torch.equal(grid_linear(x, weight), expected)
