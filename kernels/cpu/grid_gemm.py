"""fp32 GEMMs on CPU from weights kept on the grid they were quantised to (numba).

A model that comes as a GGUF file (the embedded SmolLM2 is Q4_1, its embeddings Q8_0) has
fp32 weights that are all grid points: in each run of 32 inputs of an output row,
w = fp16(d) * q + fp16(m) with q in 0..15 (4-bit, affine) or w = fp16(d) * q with q in
-127..127 (8-bit). `to_grid` finds that grid and keeps it in 5 (4-bit) or 9 (8-bit) bits
a weight instead of 32. A GGUF K-quant's weight is d * q + m with fp32 d and m, per run
of 32 inputs (Q4_K, Q5_K, IQ4_XS: the 4-bit or 8-bit grid) or 16 (the others: FINE8, or
with 512-bit vectors FINE6 where the codes fit 6 bits, as Q6_K's do), each d and m the
product of an fp16 per 256 inputs and a small integer per run; `from_codes` keeps the
file's blocks as those grids, with the scales as the file keeps them (SUPER), multiplied
out in registers as the dequantisation multiplies them: Q4_K in 4.6 bits a weight, Q6_K
in 8.6 (6.6 as FINE6), IQ4_XS (its codes indices into a table of 16 levels) in 4.3.
Weights on no grid run the same kernels from fp32 tiles (REBUILT), or from their 16 bits
where every value is a bf16 or an fp16 (BF16, FP16). A model served in bf16 multiplies in
bf16 (BF16_DOT: weights and inputs rounded to bf16, products summed in fp32, two inputs
an instruction where the CPU has AVX512-BF16).

Why it pays: a decode step of a few tokens reads every weight once and does little with
it, so its GEMMs cost what reading the weights costs. `gemm` rebuilds each weight in
registers (one fused multiply-add with its block's scales, which gives the
dequantisation's bits: d * q is exact in fp32) and multiplies in fp32, reading a fifth
of the bytes. Calls of many rows rebuild a group of tiles once into scratch and run the
rows over it.

Every output is summed in one fixed `SumOrder` (`fixed_order`), so a row comes out the
same in a batch of any size, whichever path computes it.

Layouts: 16 output columns form a tile (a vector of fp32 lanes).
- 4-bit: codes uint8 [tiles, K / 2, 16], byte (t, p, j) = q[16t + j, 2p] + 16 q[16t + j,
  2p + 1]; scales uint16 (fp16 bits) [tiles, K / 32, 2, 16]: d then m.
- 8-bit: codes int8 [tiles, K, 16]; scales uint16 [tiles, K / 32, 2, 16] (m is 0).
- any of those with fp32 scales [tiles, K / 32, 2, 16].
- fine 8-bit (FINE8: a GGUF K-quant, or a weight whose parts differ in grid): codes int8
  [tiles, K, 16]; scales fp32 [tiles, K / 16, 2, 16], d then m.
- fine 6-bit (FINE6): codes -32..31 in uint8 [tiles, 3K / 4, 16], per 4 inputs three rows:
  the 4 low bits of the first two (as the 4-bit pairs), of the last two, then all four's
  2 high bits; scales as FINE8's.
- 4-bit levels (LEVELS4: a GGUF IQ4_NL or IQ4_XS): indices into LEVELS, laid out as the
  4-bit codes; the weight is d * LEVELS[index].
- SUPER scales (a GGUF super-block type's, in place of any grid's fp32 scales) [tiles, K /
  256, bytes]: per tile and 256 inputs, the 16 lanes' fp16 d (and dmin), then per run the
  16 lanes' int8 scales (and uint8 mins): d = fp32(d * scale), m = -fp32(dmin * min);
  uint8 with mins (64 + 32 bytes a run), int8 without (32 + 16 bytes a run).
- on no grid: fp32 as it is (REBUILT: codes fp32 [tiles, K, 16]), or, where every value
  is a bf16 or an fp16 (a checkpoint stored in that type), its 16 bits (BF16, FP16: codes
  uint16 [tiles, K, 16]), widened to fp32 exactly in registers; no scales.
- bf16 products (BF16_DOT): codes uint32 [tiles, K / 2, 16], word (t, p, j) = bf16(w[16t +
  j, 2p]) + 65536 bf16(w[16t + j, 2p + 1]); no scales.
Kernel shapes (rows per pass, tiles at once) were chosen by measurement; the figures are
in the benchmark results and the history.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types

from pagedinfer.kernels.cpu.layer_ops import silu_times
from pagedinfer.kernels.cpu.numba_support import (
    FASTMATH,
    Job,
    bf16_bits,
    fma_ir,
    int_stack_array,
    intrinsic,
    jit,
    lanes_add,
    lanes_copy,
    lanes_fma,
    lanes_mul_add,
    prefetch,
    prefetch_all,
    run_jobs,
    stack_array,
)

LANES = 16  # output columns per tile: one 512-bit vector of fp32
GRID_BLOCK = 32  # inputs sharing one scale (and offset), as in GGUF's Q4_1 and Q8_0
SUPER_BLOCK = 256  # inputs sharing one fp16 scale of the SUPER layout (a GGUF K-quant's)
# The most rows one pass over the weight serves (more rows take more passes); from
# WIDE_ROWS rows a pass works on half of TILE_GROUP tiles at once, so that accumulators,
# weights and scales stay in AVX-512's 32 vector registers (without AVX-512, fewer rows
# and tiles: `row_limits`, `tiles_per_group`).
MAX_ROWS = 8
# Past MAX_ROWS rows, the rows run SCRATCH_ROWS at a time over all TILE_GROUP tiles of the
# rebuilt scratch in one pass (24 accumulators: each input broadcast feeds 4 tiles).
SCRATCH_ROWS = 6
# Without AVX-512, a 16-lane accumulator takes two of the 16 registers: a pass keeps 12
# of them, NARROW_ROWS rows of one tile (a SiLU kernel's one pass: half as many rows of
# its two).
NARROW_ROWS = 6
TILE_GROUP = 4
WIDE_ROWS = 3
# Weights on no grid that the kernels read as they are (REBUILT, BF16_DOT) have no rebuild
# to share among passes: a pass takes up to IN_PLACE_ROWS rows of two tiles (24
# accumulators), and more rows run in passes of that many over each pair of tiles, the
# first reading it from memory and the others from L2. The more rows the pass that reads
# memory carries, the less of the product is left for the passes that do not.
IN_PLACE_ROWS = 12
# From this many rows a one-pass GEMM over weights in place prefetches its worker's next
# tile group (`gemm_kernel`'s ahead); fewer rows compute so little per group that the
# hardware prefetcher keeps up, and the extra requests only slowed fp32 tiles there.
PREFETCH_ROWS = 6
# The most new tokens the fused step takes (`fused_step`); larger steps run layer by layer.
GRID_MAX_ROWS = 512
# Whether this CPU has 512-bit vectors (32 registers of 16 fp32 lanes), which the tile
# groups are sized for (`tiles_per_group`).
_WIDE_VECTORS = bool(llvm.get_host_cpu_features().get("avx512f", False))
AFFINE4, SCALED8 = "affine4", "scaled8"
# 8-bit codes with fp32 scales and offsets per FINE_BLOCK inputs: any grid above, and the
# K-quants' runs of 16 with scales that are products of two (exact in fp32, not in fp16).
FINE8 = "fine8"
FINE_BLOCK = 16
# FINE8's weights whose codes fit 6 bits (-32..31: a GGUF Q6_K's, and Q4_K's beside them
# in one fused weight), in 6 bits: codes uint8 [tiles, 3K / 4, 16], per 4 inputs 4i ..
# 4i + 3 three rows, row h holding input 4i + h's 6 bits in its bits 2..7 (so that the
# byte masked is 4 q, signed) and 2 bits of input 4i + 3's in bits 0..1 (its bits 4..5,
# 2..3, 0..1 in rows 0, 1, 2).
FINE6 = "fine6"
# 4-bit indices into LEVELS (a GGUF IQ4_NL's or IQ4_XS's non-linear grid), kept as AFFINE4
# keeps its codes: the weight is d * LEVELS[index] (m is 0).
LEVELS4 = "levels4"
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GRIDS = (AFFINE4, SCALED8, FINE8, FINE6, LEVELS4)
FINE = (FINE8, FINE6)  # the kinds of runs of FINE_BLOCK inputs
# Weights already rebuilt in fp32 (codes: fp32 [tiles, K, 16]): calls of more than MAX_ROWS
# rows rebuild a tile group once into scratch and run every row over it.
REBUILT = "rebuilt"
# fp32 weights that are all bf16 (or fp16) values, kept in those 16 bits.
BF16, FP16 = "bf16", "fp16"
# bf16 weights multiplied in bf16 (a model served with --dtype bfloat16): each pair of
# inputs' two weights in one 32-bit word (codes uint32 [tiles, K / 2, 16], the lower half
# input 2p's), and the inputs rounded to bf16 (to nearest, ties to even) as each call
# starts; products summed in fp32 by AVX512-BF16's vdpbf16ps, two inputs an instruction,
# or where the CPU has AMX-BF16 by its tiles (`amx_gemm`), 32 inputs of 16 rows at once.
BF16_DOT = "bf16dot"
DENSE = (REBUILT, BF16, FP16, BF16_DOT)  # the kinds of weights on no quantisation grid
# A grid's codes laid out for integer products with rows quantised to int8
# (`int8_gemm`): per tile, each 32-bit word of a lane holds 4 consecutive inputs' codes,
# so one broadcast word of a row's codes multiplies 16 outputs (codes int32 [tiles, K / 4,
# 16]); DOT4 keeps two words' 4-bit codes in one, inputs 8h .. 8h + 3 in the low nibbles
# and 8h + 4 .. 8h + 7 in the high (codes int32 [tiles, K / 8, 16]). Scales as the grid
# they came from keeps them: per 32 inputs (DOT4, DOT8) or 16 (DOT8_FINE, DOT6_FINE).
# DOT6_FINE keeps signed 6-bit codes (a Q6_K's) in 6 bits, offset to 0..63: per run of
# 16 inputs, three words of a lane: two DOT4 words of their low 4 bits, then one of
# their high 2 bits, byte i holding inputs i, i + 4, i + 8 and i + 12 from its low bits
# up (codes int32 [tiles, K / 16 * 3, 16]).
# DOT5 keeps 5-bit codes (0..31: a Q5_K's, Q5_1's) in 5 bits: per run of 32 inputs,
# four DOT4 words of their low 4 bits, then one word of their fifth bits, byte i's bit
# 2j + p holding that of the input in byte i of DOT4 word j, nibble p (input
# 8j + 4p + i) (codes int32 [tiles, K / 32 * 5, 16]).
DOT4, DOT8, DOT8_FINE, DOT6_FINE, DOT5 = "dot4", "dot8", "dot8fine", "dot6fine", "dot5"
DOTS = (DOT4, DOT8, DOT8_FINE, DOT6_FINE, DOT5)
SIX_BIT_ZERO = 32  # DOT6_FINE's code for 0
IN_PLACE = (REBUILT, BF16_DOT)  # the kinds whose codes the products read as they are
# Whether this CPU multiplies bf16 pairs natively (vdpbf16ps); elsewhere BF16_DOT
# kernels do the same two fused multiply-adds a pair in fp32, at half the speed.
NATIVE_BF16_DOT = bool(llvm.get_host_cpu_features().get("avx512bf16", False))
# Whether this CPU looks up 16 bytes in a 16-byte table in one instruction (pshufb), as
# LEVELS4 kernels do; elsewhere they look each up on its own.
_BYTE_SHUFFLE = bool(llvm.get_host_cpu_features().get("ssse3", False))
# Whether `from_codes` keeps 6-bit codes in FINE6 rather than FINE8: with AVX2 alone its
# unpacking costs a decode step more than the bytes it saves (the step is bound by its
# instructions there, not by memory), so only CPUs with 512-bit vectors take it.
SIX_BIT_CODES = _WIDE_VECTORS


@dataclass(frozen=True)
class SumOrder:
    """How a GEMM sums each output over K: in parts ending at `ends` (the last at K), each
    one chain from 0 in K order, then the parts added in order, each addition rounded.
    fused: each step of a chain is a fused multiply-add (rounded once), else a rounded
    product and then a rounded add."""

    ends: tuple[int, ...]
    fused: bool


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

    @property
    def variant(self) -> tuple[str, np.dtype, np.dtype]:
        """What the compiled GEMM of this weight depends on: its kind and arrays' types."""
        return self.kind, self.codes.dtype, self.scales.dtype

    def dense(self, tiles: int | None = None) -> torch.Tensor:
        """The fp32 weight the grid holds, or its first `tiles` tiles' rows (for checks:
        the kernels never build it)."""
        tiles = self.out_features // LANES if tiles is None else tiles
        k = self.in_features
        if self.kind == BF16_DOT:  # [tiles, K / 2, 16] words -> [tiles, K, 16] halves
            words = self.codes[:tiles]
            pairs = np.stack((words & 0xFFFF, words >> 16), axis=2).astype(np.uint32) << 16
            w = np.ascontiguousarray(pairs.view(np.float32).reshape(tiles, k, LANES))
            return torch.from_numpy(w.transpose(0, 2, 1).copy()).reshape(tiles * LANES, k)
        if self.kind in DENSE:
            codes = self.codes[:tiles]
            if self.kind == BF16:
                codes = (codes.astype(np.uint32) << 16).view(np.float32)
            elif self.kind == FP16:
                codes = codes.view(np.float16).astype(np.float32)
            w = np.ascontiguousarray(codes.transpose(0, 2, 1))
            return torch.from_numpy(w).reshape(tiles * LANES, k)
        scales = _fp32_scales(self.scales[:tiles])
        d = np.repeat(scales[:, :, 0, :], block_of(self.kind), axis=1)  # [tiles, K, 16]
        m = np.repeat(scales[:, :, 1, :], block_of(self.kind), axis=1)
        q = _codes(self.kind, self.codes[:tiles]).astype(np.float32)
        w = (d * q).astype(np.float32) + m
        return torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1))).reshape(
            tiles * LANES, k
        )


def _codes(kind: str, codes: np.ndarray) -> np.ndarray:
    """A grid's codes, one per weight: int8 [tiles, K, 16]."""
    if kind == FINE6:
        tiles, rows = codes.shape[:2]
        rows3 = codes.reshape(tiles, rows // 3, 3, LANES)
        q = np.empty((tiles, rows // 3, 4, LANES), dtype=np.uint8)
        q[:, :, :3] = rows3 & np.uint8(0xFC)
        q[:, :, 3] = 0
        for h in range(3):
            q[:, :, 3] |= (rows3[:, :, h] & np.uint8(3)) << np.uint8(6 - 2 * h)
        return (q.view(np.int8) >> 2).reshape(tiles, rows // 3 * 4, LANES)
    if kind == DOT6_FINE:  # [tiles, K / 16, 3 words, 16, 4 bytes]
        tiles = codes.shape[0]
        raw = codes.view(np.uint8).reshape(tiles, codes.shape[1] // 3, 3, LANES, 4)
        low = np.stack((raw[:, :, :2] & 15, raw[:, :, :2] >> 4), axis=3)  # [.., 2, 2, 16, 4]
        high = np.stack([(raw[:, :, 2] >> np.uint8(2 * j)) & 3 for j in range(4)], axis=2)
        c = low.reshape(high.shape) | (high << np.uint8(4))  # [tiles, K / 16, 4, 16, 4]
        q = c.transpose(0, 1, 2, 4, 3).astype(np.int16) - SIX_BIT_ZERO
        return np.ascontiguousarray(q.astype(np.int8)).reshape(tiles, -1, LANES)
    if kind == DOT5:  # [tiles, K / 32, 5 words, 16, 4 bytes]
        tiles = codes.shape[0]
        raw = codes.view(np.uint8).reshape(tiles, codes.shape[1] // 5, 5, LANES, 4)
        low = np.stack((raw[:, :, :4] & 15, raw[:, :, :4] >> 4), axis=3)  # [.., 4, 2, 16, 4]
        fifth = np.stack([(raw[:, :, 4] >> np.uint8(s)) & 1 for s in range(8)], axis=2).reshape(
            low.shape
        )
        q = (low | (fifth << np.uint8(4))).transpose(0, 1, 2, 3, 5, 4)  # [.., j, p, 4, 16]
        return np.ascontiguousarray(q).view(np.int8).reshape(tiles, -1, LANES)
    if kind in DOTS:
        tiles = codes.shape[0]
        raw = codes.view(np.uint8).reshape(tiles, codes.shape[1], LANES, 4)
        if kind == DOT4:  # [tiles, K / 8, 2 nibbles, 4 inputs, 16]
            raw = np.stack((raw & 15, raw >> 4), axis=2).transpose(0, 1, 2, 4, 3)
        else:
            raw = raw.transpose(0, 1, 3, 2)
        return np.ascontiguousarray(raw).view(np.int8).reshape(tiles, -1, LANES)
    if kind not in (AFFINE4, LEVELS4):
        return codes.view(np.int8) if codes.dtype == np.uint8 else codes
    tiles, pairs = codes.shape[:2]
    q = np.empty((tiles, pairs * 2, LANES), dtype=np.uint8)
    q[:, 0::2], q[:, 1::2] = codes & 15, codes >> 4
    if kind == LEVELS4:
        return np.array(LEVELS, dtype=np.int8)[q]
    return q.view(np.int8)


def block_of(kind: str) -> int:
    """Inputs per scale of a grid of `kind`."""
    return FINE_BLOCK if kind in (*FINE, DOT8_FINE, DOT6_FINE) else GRID_BLOCK


def steps_of(kind: str) -> int:
    """Inputs one step of a kernel rebuilds (`_dequant`)."""
    if kind == FINE6:
        return 4
    return 2 if kind in (AFFINE4, BF16_DOT, LEVELS4) else 1


def code_rows(kind: str, in_features: int) -> int:
    """Rows of 16 codes a tile of a weight of `kind` takes."""
    if kind == FINE6:
        return in_features // 4 * 3
    return in_features // steps_of(kind)


def six_bit(q: np.ndarray) -> np.ndarray:
    """Codes int8 [tiles, K, 16] in -32..31 in FINE6's layout."""
    tiles, k = q.shape[:2]
    bits = q.view(np.uint8).reshape(tiles, k // 4, 4, LANES) & np.uint8(63)
    last = bits[:, :, 3]
    packed = np.empty((tiles, k // 4, 3, LANES), dtype=np.uint8)
    for h in range(3):
        packed[:, :, h] = (bits[:, :, h] << np.uint8(2)) | ((last >> np.uint8(4 - 2 * h)) & 3)
    return packed.reshape(tiles, k // 4 * 3, LANES)


def _fp32_scales(scales: np.ndarray) -> np.ndarray:
    """A grid's scales (fp16 bits, fp32, or a super-block type's) as fp32 [tiles, K /
    block, 2, 16]."""
    if scales.dtype == np.float32:
        return scales
    if scales.dtype == np.uint16:
        return scales.view(np.float16).astype(np.float32)
    return _products(scales)


def super_layout(scales: np.ndarray) -> tuple[int, int] | None:
    """(bytes before the runs, bytes a run) in each super-block of SUPER scales (uint8:
    with mins; int8: without), None for scales of another type."""
    if scales.dtype == np.uint8:
        return 4 * LANES, 2 * LANES
    if scales.dtype == np.int8:
        return 2 * LANES, LANES
    return None


def _products(scales: np.ndarray) -> np.ndarray:
    """SUPER scales [tiles, K / SUPER_BLOCK, bytes] as the fp32 d and m per run that the
    kernels compute from them: d = fp32(d * scale), m = -fp32(dmin * min) (or 0)."""
    layout = super_layout(scales)
    assert layout is not None
    head, per_run = layout
    tiles, supers, width = scales.shape
    runs = (width - head) // per_run
    raw = scales.view(np.uint8)
    body = raw[:, :, head:].reshape(tiles, supers, runs, per_run)
    d = np.ascontiguousarray(raw[:, :, : 2 * LANES]).view(np.float16).astype(np.float32)
    d = d[:, :, None, :] * body[..., :LANES].view(np.int8).astype(np.float32)
    if head == 2 * LANES:
        m = np.zeros_like(d)
    else:
        dmin = np.ascontiguousarray(raw[:, :, 2 * LANES : head]).view(np.float16)
        m = -(dmin.astype(np.float32)[:, :, None, :] * body[..., LANES:].astype(np.float32))
    return np.stack((d, m), axis=3).reshape(tiles, supers * runs, 2, LANES)


def _super_scales(supers: Any, tiles: int) -> np.ndarray:
    """A weight's `SuperScales`-like scales (fp16 d [N, K / SUPER_BLOCK], int8 scales
    [N, runs], and with offsets fp16 dmin and uint8 mins as those) in the SUPER layout:
    per tile and super-block, the 16 lanes' d (and dmin) and then each run's 16 scales
    (and 16 mins); uint8 with offsets, int8 without."""

    def lanes(a: np.ndarray, dtype: type) -> np.ndarray:  # [N, X] -> bytes [tiles, X, 16]
        tiled = a.astype(dtype).reshape(tiles, LANES, -1).transpose(0, 2, 1)
        return np.ascontiguousarray(tiled).view(np.uint8)

    supers_count = supers.d.shape[1]
    head = [lanes(supers.d, np.float16)]  # [tiles, S, 32]
    per_run = [lanes(supers.scales, np.int8)]  # [tiles, S * runs, 16]
    if supers.mins is not None:
        head.append(lanes(supers.dmin, np.float16))
        per_run.append(lanes(supers.mins, np.uint8))
    body = np.stack(per_run, axis=2).reshape(tiles, supers_count, -1)
    packed = np.concatenate((*head, body), axis=2)
    return packed if supers.mins is not None else packed.view(np.int8)


def shape_supported(out_features: int, in_features: int) -> bool:
    return out_features % (LANES * TILE_GROUP) == 0 and in_features % GRID_BLOCK == 0


def fine(grid: GridWeight) -> GridWeight:
    """A 4-bit or 8-bit grid as FINE8, holding the same weights (each fp16 scale and
    offset repeated for both runs of 16 of its block, in fp32): so that a GEMM position
    whose layers mix it with FINE8 grids and others runs one kind (`one_kind`)."""
    if grid.kind == FINE8:
        return grid
    if grid.kind not in GRIDS:
        raise ValueError(f"fine: {grid.kind} weights are on no grid")
    codes = np.ascontiguousarray(_codes(grid.kind, grid.codes))
    scales = np.repeat(_fp32_scales(grid.scales), block_of(grid.kind) // FINE_BLOCK, axis=1)
    return GridWeight(FINE8, grid.out_features, grid.in_features, codes, scales)


def one_kind(grids: list[GridWeight]) -> list[GridWeight] | None:
    """Grids of one GEMM position (one per layer) as grids of one kind and scale type (for
    a position whose layers come in more kinds than the fused step runs in one): as
    they are where they share them; where they differ, the narrowest that holds them all:
    with scales per 32 inputs throughout, AFFINE4 (all 4-bit) or SCALED8 with fp32 scales,
    else FINE8; None where one is not on a grid (its position then runs from fp32 tiles)."""
    if len({(g.kind, g.scales.dtype) for g in grids}) == 1:
        return grids
    kinds = {g.kind for g in grids}
    if not kinds <= set(GRIDS):
        return None
    if kinds & set(FINE):
        return [fine(g) for g in grids]
    kind = AFFINE4 if kinds == {AFFINE4} else SCALED8
    return [
        GridWeight(
            kind,
            g.out_features,
            g.in_features,
            g.codes if g.kind == kind else np.ascontiguousarray(_codes(g.kind, g.codes)),
            _fp32_scales(g.scales),
        )
        for g in grids
    ]


def rebuilt(weight: torch.Tensor, kind: str = REBUILT) -> GridWeight | None:
    """Any fp32 weight [out_features, in_features] in the kernels' tile layout, as already
    rebuilt weights (REBUILT: codes fp32 [tiles, K, 16]) or, with kind BF16 or FP16, as the
    16 bits of a weight whose every value is one (`narrowest`; others rounded to nearest);
    with BF16_DOT, rounded to bf16 in pairs of inputs. Its scales are zeros, which no
    kernel reads. So a checkpoint on no grid runs the same GEMMs and fused step. None
    where the shape does not tile."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if not shape_supported(n, k):
        return None
    tiles = n // LANES
    values = weight.detach()
    if kind == BF16_DOT:
        halves = values.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
        words = halves[:, 0::2] | (halves[:, 1::2] << 16)  # [n, K / 2]
        codes = words.reshape(tiles, LANES, k // 2).transpose(1, 2).contiguous().numpy()
        scales = np.zeros((tiles, 1, 2, LANES), dtype=np.uint16)
        return GridWeight(kind, n, k, codes.view(np.uint32), scales)
    if kind == BF16:
        values = values.to(torch.bfloat16).view(torch.int16)
    elif kind == FP16:
        values = values.to(torch.float16).view(torch.int16)
    codes = values.reshape(tiles, LANES, k).transpose(1, 2).contiguous().numpy()
    codes = codes if kind == REBUILT else codes.view(np.uint16)
    scales = np.zeros((tiles, 1, 2, LANES), dtype=np.uint16)
    return GridWeight(kind, n, k, codes, scales)


def narrowest(weight: torch.Tensor) -> str:
    """The narrowest kind on no grid that holds every value of an fp32 weight exactly:
    BF16 where each value's low 16 bits are zero, FP16 where each is an fp16 (all finite),
    else REBUILT."""
    bits = weight.detach().contiguous().view(torch.int32)
    if not bool((bits & 0xFFFF).any()):
        return BF16
    values = weight.detach()
    if bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values):
        return FP16
    return REBUILT


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
    # (a copy where the weight is stored [out, in]: cheaper than reading it strided).
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


def holds(grid: GridWeight, weight: torch.Tensor) -> bool:
    """Whether the grid gives back `weight` (fp32 [out_features, in_features]) value for
    value: fp32(d * q) + m, as the kernels rebuild it. A zero of either sign matches a
    zero (fma(d, 8, -8d) is +0 where a Q4_0's d * 0 is -0, which no sum can tell)."""
    if grid.kind not in GRIDS or weight.dtype != torch.float32:
        return False
    if tuple(weight.shape) != (grid.out_features, grid.in_features):
        return False
    scales = _fp32_scales(grid.scales)  # [tiles, blocks, 2, 16]
    codes = grid.codes.view(np.uint8) if grid.kind == AFFINE4 else _codes(grid.kind, grid.codes)
    return bool(_holds(weight.detach().contiguous().numpy(), codes, scales))


@jit(nogil=True, error_model="numpy")
def _holds(w: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> bool:
    """`holds` over the arrays: codes uint8 [tiles, K / 2, 16] (4-bit pairs) or int8
    [tiles, K, 16]; scales fp32 [tiles, K / block, 2, 16] (d, m)."""
    tiles, k = scales.shape[0], w.shape[1]
    paired = codes.shape[1] * 2 == k
    block = k // scales.shape[1]
    for t in range(tiles):
        for i in range(k):
            b = i // block
            for j in range(LANES):
                if paired:
                    byte = codes[t, i // 2, j]
                    q = np.float32(byte & 15 if i % 2 == 0 else byte >> 4)
                else:
                    q = np.float32(codes[t, i, j])
                value = np.float32(scales[t, b, 0, j] * q) + scales[t, b, 1, j]
                if value != w[t * LANES + j, i]:
                    return False
    return True


def from_codes(
    codes: np.ndarray,
    d: np.ndarray,
    m: np.ndarray,
    low: int,
    high: int,
    supers: Any = None,
    six_bits: bool = SIX_BIT_CODES,
) -> GridWeight | None:
    """The grid of a weight known to be fp32(d * q) + m in each run of inputs (a GGUF
    file's blocks): codes int8 [out_features, in_features] in low..high; d and m
    [out_features, runs], fp16 or fp32. Runs of GRID_BLOCK inputs give AFFINE4 where the
    codes fit 0..15, else SCALED8 (whose kernels add m too: a 5-bit code takes 8 bits,
    which decodes faster than 5 packed bits), with scales of d's type;
    runs of FINE_BLOCK give FINE8 (fp32 scales). supers: where d and m are the products
    of a super-block type's scales as its file keeps them (`gguf_quants.SuperScales`),
    those in the SUPER layout instead of fp32. six_bits: runs of FINE_BLOCK whose codes fit
    -32..31 give FINE6. None where the shape does not tile."""
    n, k = codes.shape
    if not shape_supported(n, k) or m.shape != d.shape or d.dtype != m.dtype:
        return None
    if d.dtype not in (np.float16, np.float32) or low < -128 or high > 127:
        return None
    runs = d.shape[1]
    if d.shape[0] != n or runs == 0 or k % runs or k // runs not in (GRID_BLOCK, FINE_BLOCK):
        return None
    tiles = n // LANES
    tiled = codes.reshape(tiles, LANES, k).transpose(0, 2, 1)  # [tiles, K, 16]
    if k // runs == FINE_BLOCK:
        kind, packed = FINE8, np.ascontiguousarray(tiled, dtype=np.int8)
        d, m = d.astype(np.float32), m.astype(np.float32)
        # FINE6 rebuilds fp32(4 q * (d / 4)) + m: d / 4 is exact where d is 0 or not below
        # 4 times fp32's least normal (a file's scales, fp16 times integers, always are).
        tiny = np.abs(d)[d != 0].min(initial=np.inf) < 2.0**-124
        if six_bits and low >= -32 and high <= 31 and not tiny:
            kind, packed = FINE6, six_bit(packed)
    elif low >= 0 and high <= 15:
        kind, q = AFFINE4, tiled.view(np.uint8)
        packed = np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << np.uint8(4)))
    elif (index := _level_indices(tiled, low, high)) is not None and not m.any():
        kind = LEVELS4
        packed = np.ascontiguousarray(index[:, 0::2] | (index[:, 1::2] << np.uint8(4)))
    else:
        kind, packed = SCALED8, np.ascontiguousarray(tiled, dtype=np.int8)
    if _supers_give(supers, d, m, k):
        return GridWeight(kind, n, k, packed, _super_scales(supers, tiles))
    scales = np.stack((d, m), axis=1)  # [n, 2, runs]
    scales = np.ascontiguousarray(scales.reshape(tiles, LANES, 2, runs).transpose(0, 3, 2, 1))
    return GridWeight(
        kind, n, k, packed, scales if d.dtype == np.float32 else scales.view(np.uint16)
    )


def _level_indices(codes: np.ndarray, low: int, high: int) -> np.ndarray | None:
    """Codes (int8, any shape) in low..high as indices into LEVELS (uint8), None where one is
    not a level (or the range is not LEVELS')."""
    if (low, high) != (LEVELS[0], LEVELS[-1]):
        return None
    table = np.full(256, 255, dtype=np.uint8)
    table[np.array(LEVELS, dtype=np.int8).view(np.uint8)] = np.arange(16, dtype=np.uint8)
    index = table[codes.view(np.uint8)]
    return None if (index == 255).any() else index


def _supers_give(supers: Any, d: np.ndarray, m: np.ndarray, k: int) -> bool:
    """Whether `supers` (None, or `gguf_quants.SuperScales`-like) give exactly the fp32 d
    and m [N, runs] of a weight of `k` inputs, in the runs of its kind (one per run)."""
    if supers is None or k % SUPER_BLOCK or supers.scales.shape != d.shape:
        return False
    if supers.d.shape != (d.shape[0], k // SUPER_BLOCK):
        return False
    if supers.scales.min(initial=0) < -128 or supers.scales.max(initial=0) > 127:
        return False
    per_super = d.shape[1] // supers.d.shape[1]
    sd = np.repeat(supers.d.astype(np.float32), per_super, axis=1)
    want_d = sd * supers.scales.astype(np.float32)
    if supers.mins is None:
        want_m = np.zeros_like(want_d)
    else:
        if supers.mins.min(initial=0) < 0 or supers.mins.max(initial=0) > 255:
            return False
        dmin = np.repeat(supers.dmin.astype(np.float32), per_super, axis=1)
        want_m = -(dmin * supers.mins.astype(np.float32))
    return bool(np.array_equal(want_d, d) and np.array_equal(want_m, m))


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
def _block_scales(typingctx: Any, dm: Any, scales: Any, sat: Any, runs: Any) -> Any:
    """A block's scales as `_dequant` takes them: dm[0] = d and dm[1] = m, fp32, from the
    2 x 16 values scales[sat:] (fp16 bits, or fp32 as they are); from SUPER scales (uint8
    or int8: `super_layout`), of run sat / 32 (with `runs` runs a super-block), computed
    as the dequantisation computes them: d = fp32(d * scale), m = -fp32(dmin * min)."""
    wide = scales.dtype == types.float32
    offsets = scales.dtype == types.uint8
    supers = offsets or scales.dtype == types.int8

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.VectorType(ir.FloatType(), LANES)
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        out = context.make_array(signature.args[0])(context, builder, args[0]).data

        def store(i: int, value: Any) -> None:
            target = builder.gep(out, [ir.Constant(ir.IntType(64), i * LANES)])
            builder.store(value, builder.bitcast(target, f32.as_pointer()), align=4)

        def lanes_at(at: Any, bits: int) -> Any:
            vector = ir.VectorType(ir.IntType(bits), LANES)
            pointer = builder.bitcast(builder.gep(data, [at]), vector.as_pointer())
            return builder.load(pointer, align=1)

        def halves(at: Any) -> Any:
            raw = builder.bitcast(lanes_at(at, 16), ir.VectorType(ir.HalfType(), LANES))
            return builder.fpext(raw, f32)

        if supers:
            i64 = ir.IntType(64)
            head, per_run = (4 * LANES, 2 * LANES) if offsets else (2 * LANES, LANES)
            run = builder.lshr(
                context.cast(builder, args[2], signature.args[2], types.int64), i64(5)
            )
            count = context.cast(builder, args[3], signature.args[3], types.int64)
            stride = builder.add(builder.mul(count, i64(per_run)), i64(head))
            base = builder.mul(builder.udiv(run, count), stride)
            at = builder.add(
                base, builder.add(i64(head), builder.mul(builder.urem(run, count), i64(per_run)))
            )
            scale = builder.sitofp(lanes_at(at, 8), f32)
            store(0, builder.fmul(halves(base), scale))
            if offsets:
                least = builder.uitofp(lanes_at(builder.add(at, i64(LANES)), 8), f32)
                dmin = halves(builder.add(base, i64(2 * LANES)))
                store(1, builder.fneg(builder.fmul(dmin, least)))
            else:
                store(1, ir.Constant(f32, [0.0] * LANES))
            return context.get_dummy_value()
        for i in range(2):
            at = builder.add(args[2], ir.Constant(args[2].type, i * LANES))
            if wide:
                pointer = builder.bitcast(builder.gep(data, [at]), f32.as_pointer())
                store(i, builder.load(pointer, align=4))
            else:
                store(i, halves(at))
        return context.get_dummy_value()

    return types.void(dm, scales, sat, runs), codegen


@intrinsic
def _dequant(typingctx: Any, w: Any, kind: Any, codes: Any, at: Any, dm: Any) -> Any:
    """The weights of one step of the inputs for one tile, rebuilt as fp32(d * q) + m, each
    operation rounded once as the dequantisation rounded them (d * q is exact in fp32: an
    fp16 times a code of at most 8 bits, so one fused multiply-add gives the same bits):
    4-bit: w[0] and w[1] from the 16 bytes codes[at:] (inputs 2p and 2p + 1); 8-bit: w[0]
    from codes[at:]; d, m: dm[0] and dm[1] (`_block_scales`). Rebuilt: w[0] is the 16 fp32
    values codes[at:], as they are (BF16_DOT: its 16 words of two bf16s, bit for bit);
    BF16 and FP16: their 16 values widened (dm unused). 6-bit (FINE6): w[0] .. w[3] from
    the 48 bytes codes[at:] of their 4 inputs."""
    if not isinstance(kind, types.StringLiteral):
        return None
    affine = kind.literal_value == AFFINE4
    six = kind.literal_value == FINE6
    levels = kind.literal_value == LEVELS4
    rebuilt = kind.literal_value in (REBUILT, BF16_DOT)  # 16 words a step, as they are
    narrow = kind.literal_value if kind.literal_value in (BF16, FP16) else None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.VectorType(ir.FloatType(), LANES)
        i32 = ir.VectorType(ir.IntType(32), LANES)

        def vector_at(i: int, offset: Any, element: ir.Type) -> Any:
            data = context.make_array(signature.args[i])(context, builder, args[i]).data
            pointer = builder.gep(data, [offset])
            return builder.bitcast(pointer, ir.VectorType(element, LANES).as_pointer())

        out = context.make_array(signature.args[0])(context, builder, args[0])
        if rebuilt:
            value = builder.load(vector_at(2, args[3], ir.FloatType()), align=4)
            builder.store(value, builder.bitcast(out.data, f32.as_pointer()), align=4)
            return context.get_dummy_value()
        if narrow is not None:
            raw = builder.load(vector_at(2, args[3], ir.IntType(16)), align=2)
            if narrow == BF16:  # a bf16 is the high half of its fp32
                wide = builder.shl(builder.zext(raw, i32), ir.Constant(i32, [16] * LANES))
                value = builder.bitcast(wide, f32)
            else:
                value = builder.fpext(
                    builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), f32
                )
            builder.store(value, builder.bitcast(out.data, f32.as_pointer()), align=4)
            return context.get_dummy_value()
        zero = ir.Constant(ir.IntType(64), 0)
        d = builder.load(vector_at(4, zero, ir.FloatType()), align=4)
        m = builder.load(vector_at(4, ir.Constant(ir.IntType(64), LANES), ir.FloatType()), align=4)
        raw = builder.load(vector_at(2, args[3], ir.IntType(8)), align=1)
        if six:
            i8 = ir.VectorType(ir.IntType(8), LANES)

            def byte(value: int) -> Any:
                return ir.Constant(i8, [value] * LANES)

            at = context.cast(builder, args[3], signature.args[3], types.int64)
            low, second, high = (
                builder.load(
                    vector_at(2, builder.add(at, ir.IntType(64)(r * LANES)), ir.IntType(8)),
                    align=1,
                )
                for r in range(3)
            )
            # Inputs 4g .. 4g + 3 as 4 q in a byte each: three rows masked, and the fourth
            # from their bits 0..1; the weight is then fp32(4 q * (d / 4)) + m, exactly.
            last = builder.or_(
                builder.shl(builder.and_(low, byte(3)), byte(6)),
                builder.or_(
                    builder.shl(builder.and_(second, byte(3)), byte(4)),
                    builder.shl(builder.and_(high, byte(3)), byte(2)),
                ),
            )
            sixes = (*(builder.and_(row, byte(0xFC)) for row in (low, second, high)), last)
            codes = [builder.sext(q, i32) for q in sixes]
            d = builder.fmul(d, ir.Constant(f32, [0.25] * LANES))
        elif levels:
            i8 = ir.VectorType(ir.IntType(8), LANES)
            codes = [
                builder.sext(_level_of(builder, index), i32)
                for index in (
                    builder.and_(raw, ir.Constant(i8, [15] * LANES)),
                    builder.lshr(raw, ir.Constant(i8, [4] * LANES)),
                )
            ]
        elif affine:
            wide = builder.zext(raw, i32)
            codes = [
                builder.and_(wide, ir.Constant(i32, [15] * LANES)),
                builder.lshr(wide, ir.Constant(i32, [4] * LANES)),
            ]
        else:
            codes = [builder.sext(raw, i32)]
        for i, code in enumerate(codes):
            value = fma_ir(builder, builder.sitofp(code, f32), d, m)
            target = builder.gep(out.data, [ir.Constant(ir.IntType(64), i * LANES)])
            builder.store(value, builder.bitcast(target, f32.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(w, kind, codes, at, dm), codegen


def _level_of(builder: Any, index: Any) -> Any:
    """LEVELS[index] for 16 byte indices 0..15 (IR): one pshufb, or lane by lane."""
    i8 = ir.VectorType(ir.IntType(8), LANES)
    table = ir.Constant(i8, [value & 255 for value in LEVELS])
    if _BYTE_SHUFFLE:
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i8, [i8, i8]), "llvm.x86.ssse3.pshuf.b.128"
        )
        return builder.call(function, [table, index])
    result = ir.Constant(i8, ir.Undefined)
    for lane in range(LANES):
        at = builder.extract_element(index, ir.IntType(32)(lane))
        value = builder.extract_element(table, at)
        result = builder.insert_element(result, value, ir.IntType(32)(lane))
    return result


@intrinsic
def _dot_pairs(typingctx: Any, acc: Any, word: Any, pairs: Any) -> Any:
    """acc[l] += the two products of word's bf16 halves with pairs[l]'s (16 lanes l; word
    an int32 of two bf16s, pairs 16 such words held in fp32 lanes' bits): vdpbf16ps, the
    high halves' product added first; on a CPU without it, two fused multiply-adds in
    that order, which differ only where it flushes a denormal to zero."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.VectorType(ir.FloatType(), LANES)
        i32 = ir.VectorType(ir.IntType(32), LANES)

        def pointer(i: int, element: ir.Type) -> Any:
            data = context.make_array(signature.args[i])(context, builder, args[i]).data
            return builder.bitcast(data, element.as_pointer())

        total = builder.load(pointer(0, f32), align=4)
        weights = builder.bitcast(builder.load(pointer(2, f32), align=4), i32)
        one = context.cast(builder, args[1], signature.args[1], types.int32)
        lane0 = builder.insert_element(ir.Constant(i32, ir.Undefined), one, ir.IntType(32)(0))
        spread = builder.shuffle_vector(
            lane0, ir.Constant(i32, ir.Undefined), ir.Constant(i32, [0] * LANES)
        )
        if NATIVE_BF16_DOT:
            # Declared with 32-bit lanes, which LLVM upgrades to its bf16 vector type.
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(f32, [f32, i32, i32]),
                "llvm.x86.avx512bf16.dpbf16ps.512",
            )
            result = builder.call(function, [total, weights, spread])
        else:
            high = ir.Constant(i32, [0xFFFF0000] * LANES)
            shift = ir.Constant(i32, [16] * LANES)
            result = total
            for part in (
                lambda v: builder.bitcast(builder.and_(v, high), f32),
                lambda v: builder.bitcast(builder.shl(v, shift), f32),
            ):
                result = fma_ir(builder, part(weights), part(spread), result)
        builder.store(result, pointer(0, f32), align=4)
        return context.get_dummy_value()

    if not (isinstance(word, types.Integer) and isinstance(acc, types.Array)):
        return None
    return types.void(acc, word, pairs), codegen


@jit(nogil=True, error_model="numpy")
def bf16_pairs(x: np.ndarray, out: np.ndarray) -> None:
    """out[r, p] = the bf16s of x[r, 2p] (low half) and x[r, 2p + 1] (high), each fp32
    rounded to nearest, ties to even, as torch rounds it (a NaN stays a NaN). x: fp32 [M,
    K]; out: int32 [M, K / 2]."""
    bits = x.view(np.int32)
    for r in range(x.shape[0]):
        for p in range(out.shape[1]):
            word = np.int32(0)
            for h in range(2):
                word |= np.int32(bf16_bits(bits[r, 2 * p + h]) << (16 * h))
            out[r, p] = word


@jit(inline="always")
def _paired_tile(group: int, b: int, half: int, tiles: int) -> int:
    """The weight tile that tile b of a group of 2 * half tiles is, where a group takes
    half tiles of the gate (the first tiles / 2) and then the same tiles of up."""
    if b < half:
        return group * half + b
    return tiles // 2 + group * half + b - half


@functools.cache
def _code_at(kind: str) -> Callable[[int], int]:
    """code_at(i): where the codes of input i (the first of a step) start in a tile's."""
    if kind == FINE6:

        @jit(inline="always")
        def six(i: int) -> int:
            return i // 4 * 3 * LANES

        return six
    steps = steps_of(kind)

    @jit(inline="always")
    def code_at(i: int) -> int:
        return i // steps * LANES

    return code_at


@functools.cache
def gemm_kernel(
    kind: str,
    rows: int,
    in_features: int,
    ends: tuple[int, ...],
    fused: bool,
    silu: bool = False,
    group_tiles: int = 0,
    gelu: bool = False,
) -> Callable[..., None]:
    """gemm(x, r0, codes, scales, out, first, tiles, add, ahead, worker, workers): rows r0
    .. r0 + rows - 1 of x [M, K] (BF16_DOT: its bf16 pairs, int32 [M, K / 2]) times the
    first `tiles` tiles of the weight (a grid, or on no grid), summed in the `SumOrder`
    (ends, fused), into the same rows of out [M, out tiles, 16] from its tile `first` on
    (add: out += the product, rounded once more, as `out += x @ W.T` does). The worker
    does tile groups worker, worker + workers, ... of tiles // `tiles_per_group`.

    ahead (weights read in place, IN_PLACE): what each step also asks the CPU to fetch,
    so that it arrives while this group computes: 0, the same part of the worker's next
    group; n > 0, of the tile n tiles past each tile read; < 0, nothing. The hardware
    prefetcher loses its stream where a worker skips to its next group, and keeps too
    little ahead while a pass of many rows computes.

    silu: the weight is [gate | up] (its first tiles / 2 tiles the gate's); each group
    takes as many tiles of the gate as of up, the same outputs of each, and out gets
    silu(gate) * up (`layer_ops.silu_times`, as `silu_mul` computes it from the product),
    gate tile j into out tile `first` + j (add unused). The product itself is never
    written: each worker takes the SiLU of its own tiles while they are in registers.
    gelu (with silu): the activation is GELU's tanh approximation (Gemma 3's), the same
    kernel with `silu_times`' switch."""
    k, parts = in_features, len(ends)
    paired = kind == BF16_DOT  # x: int32 [M, K / 2], each input pair's bf16s (`bf16_pairs`)
    if paired and (not fused or any(end % 2 for end in ends)):
        raise ValueError(f"{BF16_DOT} GEMMs sum input pairs in fused chains, not {ends}")
    tb = group_tiles or tiles_per_group(rows, silu, kind)
    steps = steps_of(kind)
    scaled = kind not in DENSE  # weights on no grid have no scales
    block = block_of(kind)
    blocks = k // block
    runs = SUPER_BLOCK // block  # runs a super-block of SUPER scales
    code_row = code_rows(kind, k) * LANES  # codes of one tile
    half = tb // 2  # with silu: the group's gate tiles, then as many of up
    values = half * rows * LANES  # with silu: the group's outputs
    streamed = kind in IN_PLACE
    code_at = _code_at(kind)
    held = max(steps, 2)  # weights one step rebuilds (a BF16_DOT step: one pair word)

    @jit(inline="always")
    def tile_of(group: int, b: int, tiles: int) -> int:
        """The weight tile that tile b of a group is."""
        return _paired_tile(group, b, half, tiles) if silu else group * tb + b

    @jit(inline="always")
    def each_input(acc: np.ndarray, w: np.ndarray, x: np.ndarray, r0: int, i: int) -> None:
        """acc[b, r] += row r0 + r of x times tile b's weights w[b] of inputs i .. i +
        steps - 1, input by input."""
        for h in range(steps):
            for r in range(rows):
                xr = x[r0 + r, i + h]
                for b in range(tb):
                    if fused:
                        lanes_fma(acc[b, r], w[b, h], xr, LANES)
                    else:
                        lanes_mul_add(acc[b, r], w[b, h], xr, LANES)

    @jit(inline="always")
    def input_pairs(acc: np.ndarray, w: np.ndarray, x: np.ndarray, r0: int, i: int) -> None:
        """`each_input` for BF16_DOT: inputs i and i + 1 in one dot product of bf16 pairs."""
        for r in range(rows):
            word = x[r0 + r, i // 2]
            for b in range(tb):
                _dot_pairs(acc[b, r], word, w[b, 0])

    products = input_pairs if paired else each_input

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def gemm(
        x: np.ndarray,
        r0: int,
        codes: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        first: int,
        tiles: int,
        add: bool,
        ahead: int,
        worker: int,
        workers: int,
    ) -> None:
        total = stack_array((tb, rows, LANES))
        acc = stack_array((tb, rows, LANES))
        w = stack_array((tb, held, LANES))
        dm = stack_array((tb, 2, LANES))
        negative, decay = stack_array((values,)), stack_array((values,))
        result, bits = stack_array((half, rows, LANES)), int_stack_array((values,))
        groups = tiles // tb
        for group in range(worker, groups, workers):
            skip = ahead
            if ahead == 0:  # the worker's next group, or none after its last
                skip = workers * (half if silu else tb) if group + workers < groups else -1
            for b in range(tb):
                for r in range(rows):
                    lanes_copy(total[b, r], 0.0, LANES)
            start = 0
            for p in range(parts):
                end = ends[p]
                for b in range(tb):
                    for r in range(rows):
                        lanes_copy(acc[b, r], 0.0, LANES)
                for i in range(start, end, steps):
                    if scaled and (i % block == 0 or i == start):
                        for b in range(tb):
                            tile = tile_of(group, b, tiles)
                            sat = (tile * blocks + i // block) * 2 * LANES
                            _block_scales(dm[b], scales, sat, runs)
                    for b in range(tb):
                        at = tile_of(group, b, tiles) * code_row + code_at(i)
                        _dequant(w[b], kind, codes, at, dm[b])
                        if streamed and skip > 0:
                            prefetch(codes, at + skip * code_row)
                    products(acc, w, x, r0, i)
                for b in range(tb):
                    for r in range(rows):
                        lanes_add(total[b, r], acc[b, r], LANES)
                start = end
            if silu:
                gate, up = total[:half].reshape(values), total[half:].reshape(values)
                silu_times(gate, up, result.reshape(values), negative, decay, bits, gelu)
                for b in range(half):
                    for r in range(rows):
                        lanes_copy(out[r0 + r, first + group * half + b], result[b, r], LANES)
                continue
            for b in range(tb):
                for r in range(rows):
                    if add:
                        lanes_add(out[r0 + r, first + group * tb + b], total[b, r], LANES)
                    else:
                        lanes_copy(out[r0 + r, first + group * tb + b], total[b, r], LANES)

    return gemm


def row_limits(silu: bool = False, kind: str = "") -> tuple[int, int]:
    """(the most rows one pass over the weight serves, the rows one pass over the rebuilt
    scratch takes) on this CPU: as many as keep every accumulator in a register, with the
    tiles of `tiles_per_group`. With AVX-512, MAX_ROWS and SCRATCH_ROWS, or IN_PLACE_ROWS
    for both where the weight is read in place; without it NARROW_ROWS, one pass halved
    for a SiLU kernel's two tiles (over the scratch, the SiLU comes after the product:
    `gemm_all_rows`)."""
    if not _WIDE_VECTORS:
        return (NARROW_ROWS // 2 if silu else NARROW_ROWS), NARROW_ROWS
    if kind in IN_PLACE:
        return IN_PLACE_ROWS, IN_PLACE_ROWS
    return MAX_ROWS, SCRATCH_ROWS


def tiles_per_group(rows: int, silu: bool = False, kind: str = "") -> int:
    """Tiles one pass of `gemm_kernel` works on at once. Each tile's accumulators take
    `rows` vectors of 16 lanes: AVX-512's 32 registers hold four tiles' up to WIDE_ROWS
    rows (BF16_DOT, with no scales and one weight vector a tile for two inputs: up to
    SCRATCH_ROWS), two tiles' beyond; a CPU without AVX-512 holds a 16-lane vector in two
    of its 16 registers, so one tile (a SiLU kernel needs two: a gate tile and its up
    tile). The grouping never changes a result: each output sums in its own fixed order."""
    if not _WIDE_VECTORS:
        return 2 if silu else 1
    widest = SCRATCH_ROWS if kind == BF16_DOT else WIDE_ROWS
    return TILE_GROUP if rows <= widest else TILE_GROUP // 2


def amx_tiles() -> bool:
    """Whether BF16_DOT weights multiply on AMX tiles here (`amx_gemm`): in the tile
    unit's order of sums, not the fixed order's vdpbf16ps chain."""
    from pagedinfer.kernels.cpu import amx_gemm

    return amx_gemm.available()


@functools.cache
def gemm_all_rows(
    kind: str,
    in_features: int,
    ends: tuple[int, ...],
    fused: bool,
    silu: bool = False,
    gelu: bool = False,
) -> Callable[..., None]:
    """gemm(x, codes, scales, out, add, worker, workers): `gemm_kernel`'s product for every
    row of x (fp32 [M, K]; a BF16_DOT kernel rounds it to bf16 first), summed in the
    `SumOrder` (ends, fused). Up to MAX_ROWS rows (`row_limits`)
    take one pass over the weight, rebuilding each weight in registers; more rows rebuild
    a group of TILE_GROUP tiles at a time into scratch (fp32, in L2) and run SCRATCH_ROWS
    rows at a time over it, so the weight is read and rebuilt once whatever the rows.
    Weights read in place (IN_PLACE) take IN_PLACE_ROWS rows a pass, over the weight's own
    tiles. Every worker takes part: a share of the tile groups, and past one pass's rows a
    share of the rows of the groups that do not divide evenly among them.

    silu: out [M, out_features / 32, 16] gets silu(gate) * up of the product of a [gate |
    up] weight, as `gemm_kernel` gives it (gelu: gelu_tanh(gate) * up)."""
    if kind in DOTS:
        from pagedinfer.kernels.cpu import int8_gemm

        return int8_gemm.gemm_all_rows(kind, in_features, silu, gelu)
    if kind == BF16_DOT and amx_tiles():
        from pagedinfer.kernels.cpu import amx_gemm

        return amx_gemm.gemm_all_rows(in_features, silu, gelu)
    k, steps = in_features, steps_of(kind)
    code_row = code_rows(kind, k) * LANES
    code_at = _code_at(kind)
    block = block_of(kind)
    blocks = k // block
    runs = SUPER_BLOCK // block  # runs a super-block of SUPER scales
    scaled = kind not in DENSE
    most, scratch_rows = row_limits(silu, kind)
    one_pass = _by_rows(kind, k, ends, fused, silu, most, gelu=gelu)
    half = TILE_GROUP // 2  # with silu: a group's gate tiles, then as many of up
    # fp32 weights are already what the scratch would hold: the rows run over the weight's
    # own tiles, with no copy, as many tiles at once as `tiles_per_group` gives for their
    # rows (a pass over a group then takes it a pair of tiles at a time); a gate/up pair in
    # two halves, its gate tiles and then its up tiles (not adjacent in the weight), which
    # costs less than copying them together.
    in_place = kind in IN_PLACE
    # Over the scratch the product itself, all TILE_GROUP tiles at once where the
    # registers hold them; with silu it goes to `product`, and `_silu_rows` makes out of
    # it (the SiLU inside this kernel, called for a few rows at a time, cost more than
    # the product).
    # In place, 0: the tiles `tiles_per_group` gives for each pass's rows.
    scratch_tiles = TILE_GROUP if _WIDE_VECTORS else tiles_per_group(scratch_rows)
    if in_place:
        scratch_tiles = min(scratch_tiles, half) if silu else 0
    over_scratch = _by_rows(
        kind if in_place else REBUILT, k, ends, fused, False, scratch_rows, scratch_tiles
    )
    halves = silu and scratch_tiles <= half
    scratch_tiles_held = 0 if in_place else TILE_GROUP

    @jit(inline="always")
    def group_weights(
        codes: np.ndarray, scales: np.ndarray, w: np.ndarray, dm: np.ndarray, group: int, tiles: int
    ) -> tuple[np.ndarray, int, int]:
        """(the array holding the group's tiles, its first gate tile, its first up tile;
        without silu its first tile twice): the weight itself, or the scratch w that the
        group was rebuilt into (gate tiles, then up)."""
        if in_place:
            if silu:
                return codes, group * half, tiles // 2 + group * half
            return codes, group * TILE_GROUP, group * TILE_GROUP
        for b in range(TILE_GROUP):
            t = _paired_tile(group, b, half, tiles) if silu else group * TILE_GROUP + b
            for i0 in range(0, k, block):
                if scaled:
                    _block_scales(dm, scales, (t * blocks + i0 // block) * 2 * LANES, runs)
                for i in range(i0, i0 + block, steps):
                    _dequant(w[b, i:], kind, codes, t * code_row + code_at(i), dm)
        return w, 0, half

    @jit(inline="always")
    def as_given(x: np.ndarray) -> np.ndarray:
        return x

    @jit(inline="always")
    def in_bf16_pairs(x: np.ndarray) -> np.ndarray:
        """x's rows in bf16 pairs (`bf16_pairs`): each worker rounds them for itself, which
        costs a tile's share of the products and needs no barrier."""
        packed = np.empty((x.shape[0], x.shape[1] // 2), dtype=np.int32)
        bf16_pairs(x, packed)
        return packed

    inputs = in_bf16_pairs if kind == BF16_DOT else as_given

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def gemm(
        given: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        add: bool,
        worker: int,
        workers: int,
    ) -> None:
        prefetch_all(given)  # in the fused step, rows every worker wrote a share of
        x = inputs(given)
        m, tiles = x.shape[0], out.shape[1] * (2 if silu else 1)
        if m <= most:
            ahead = 0 if m >= PREFETCH_ROWS else -1
            one_pass(m, x, 0, codes, scales, out, 0, tiles, add, ahead, worker, workers)
            return
        # Tasks: whole groups, while they divide evenly among the workers; each group left
        # over goes to every worker, each taking its share of the row blocks, so that no
        # worker waits while another does an extra group (9 groups on 2 workers: 4 whole
        # ones each, the ninth split by rows).
        groups = tiles // TILE_GROUP
        whole = groups - groups % workers
        w = stack_array((scratch_tiles_held, k, LANES))
        dm = stack_array((2, LANES))
        # With silu: the product's gate and up outputs [2, M, half, 16], so that a block
        # of rows takes its SiLU in one call (and, where a pass takes the whole group,
        # the group's product as that pass writes it).
        product = np.empty((2, m if silu else 0, half, LANES), dtype=np.float32)
        whole_group = np.empty((m if silu and not halves else 0, TILE_GROUP, LANES), np.float32)
        silu_scratch = np.empty((4 if silu else 0, scratch_rows * half * LANES), np.float32)
        tasks = whole + (groups - whole) * workers
        for task in range(worker, tasks, workers):
            group = _task_group(task, whole, workers)
            first_row, row_step = 0, scratch_rows
            if task >= whole:
                first_row, row_step = worker * scratch_rows, workers * scratch_rows
            weights, gate, up = group_weights(codes, scales, w, dm, group, tiles)
            first = group * half if silu else group * TILE_GROUP
            # Read in place, the first two passes ask for the worker's next group
            # meanwhile: its weights arrive while this group's passes compute from L2.
            ahead = -1
            if in_place and task + workers < tasks:
                later = _task_group(task + workers, whole, workers)
                if later > group:
                    ahead = (later - group) * (half if silu else TILE_GROUP)
            for r0 in range(first_row, m, row_step):
                rows = min(scratch_rows, m - r0)
                if r0 == first_row + 2 * row_step:  # asked twice: it is in L2 by now
                    ahead = -1
                if not silu:
                    tile_group = weights[gate : gate + TILE_GROUP]
                    over_scratch(
                        rows, x, r0, tile_group, scales, out, first, TILE_GROUP, add, ahead, 0, 1
                    )
                    continue
                if halves:
                    gates, ups = weights[gate : gate + half], weights[up : up + half]
                    over_scratch(
                        rows, x, r0, gates, scales, product[0], 0, half, False, ahead, 0, 1
                    )
                    over_scratch(rows, x, r0, ups, scales, product[1], 0, half, False, ahead, 0, 1)
                else:
                    tile_group = weights[gate : gate + TILE_GROUP]
                    over_scratch(
                        rows, x, r0, tile_group, scales, whole_group, 0, TILE_GROUP, False, -1, 0, 1
                    )
                    for r in range(r0, r0 + rows):
                        for b in range(half):
                            lanes_copy(product[0, r, b], whole_group[r, b], LANES)
                            lanes_copy(product[1, r, b], whole_group[r, half + b], LANES)
                _silu_rows(product, r0, rows, out, first, silu_scratch, gelu)

    return gemm


@jit(inline="always")
def _task_group(task: int, whole: int, workers: int) -> int:
    """The tile group of `gemm_all_rows`' task: a whole group, or one of the groups left
    over, which every worker takes a share of the rows of."""
    return task if task < whole else whole + (task - whole) // workers


@jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
def _silu_rows(
    product: np.ndarray,
    r0: int,
    rows: int,
    out: np.ndarray,
    first: int,
    scratch: np.ndarray,
    gelu: bool,
) -> None:
    """out[r, first + j] = silu(gate) * up for rows r0 .. r0 + rows - 1 of a tile group's
    product [2, M, TILE_GROUP / 2, 16] (its gate tiles' outputs, then the same tiles' of
    up), in one `layer_ops.silu_times` over the rows (gelu: its GELU). scratch: fp32 [4,
    rows * 32 or more]."""
    half = TILE_GROUP // 2
    n = rows * half * LANES
    result, negative, decay = scratch[0], scratch[1], scratch[2]
    bits = scratch[3].view(np.int32)
    gate = product[0, r0 : r0 + rows].reshape(n)
    up = product[1, r0 : r0 + rows].reshape(n)
    silu_times(gate, up, result, negative, decay, bits, gelu)
    for r in range(rows):
        for b in range(half):
            lanes_copy(out[r0 + r, first + b], result[(r * half + b) * LANES :], LANES)


@functools.cache
def _by_rows(
    kind: str,
    in_features: int,
    ends: tuple[int, ...],
    fused: bool,
    silu: bool = False,
    most: int = MAX_ROWS,
    group_tiles: int = 0,
    gelu: bool = False,
) -> Callable[..., None]:
    """run(rows, *args): `gemm_kernel`(kind, rows, ...)(*args) for 1 <= rows <= most (at
    most IN_PLACE_ROWS; the kernel compiled for that many rows, nothing for other counts).
    Kernels are shared with every other caller asking for the same rows and tiles."""

    def kernel(rows: int) -> Callable[..., None]:
        rows = min(rows, most)  # past `most`, the kernel for `most` (never called)
        tiles = group_tiles or tiles_per_group(rows, silu, kind)
        return gemm_kernel(kind, rows, in_features, ends, fused, silu, tiles, gelu)

    k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11, k12 = (
        kernel(rows) for rows in range(1, IN_PLACE_ROWS + 1)
    )

    @jit(nogil=True, error_model="numpy")
    def run(rows: int, *args: Any) -> None:
        # args: (x, r0, codes, scales, out, first, tiles, add, ahead, worker, workers)
        if rows > most:
            return
        if rows == 12:
            k12(*args)
        elif rows == 11:
            k11(*args)
        elif rows == 10:
            k10(*args)
        elif rows == 9:
            k9(*args)
        elif rows == 8:
            k8(*args)
        elif rows == 7:
            k7(*args)
        elif rows == 6:
            k6(*args)
        elif rows == 5:
            k5(*args)
        elif rows == 4:
            k4(*args)
        elif rows == 3:
            k3(*args)
        elif rows == 2:
            k2(*args)
        elif rows == 1:
            k1(*args)

    return run


def grid_linear(
    x: torch.Tensor,
    weight: GridWeight,
    order: SumOrder,
    out: torch.Tensor | None = None,
    add: bool = False,
) -> torch.Tensor:
    """x @ W.T on the worker threads, W held as `weight`, summed in `order` (x: fp32 [M,
    in_features], C contiguous). add: out += the product in place (out given)."""
    if add and out is None:
        raise ValueError("grid_linear: add needs out")
    if x.dim() != 2 or x.shape[1] != weight.in_features or not x.is_contiguous():
        raise ValueError(
            f"grid_linear: x must be contiguous [M, {weight.in_features}], got {tuple(x.shape)}"
        )
    if out is None:
        out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    elif out.shape != (x.shape[0], weight.out_features) or not out.is_contiguous():
        raise ValueError(
            f"grid_linear: out must be contiguous [{x.shape[0]}, {weight.out_features}], "
            f"got {tuple(out.shape)}"
        )
    view = out.numpy().reshape(x.shape[0], weight.out_features // LANES, LANES)
    gemm = gemm_all_rows(weight.kind, weight.in_features, order.ends, order.fused)
    args = (x.numpy(), weight.codes, weight.scales, view, add)
    run_jobs([Job(gemm, args, weight.out_features // LANES // TILE_GROUP)])
    return out


def fixed_order(in_features: int) -> SumOrder:
    """The order every grid GEMM sums in: one chain of fused multiply-adds over K. Fixed,
    so that a row comes out the same in a step of any size and through either path (the
    fused step or layer by layer), and nothing about the machine needs to be measured."""
    return SumOrder((in_features,), True)
