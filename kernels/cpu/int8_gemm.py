"""GEMMs that multiply a GGUF file's codes as stored by rows quantised to int8 (numba, CPU).

`grid_gemm`'s kernels rebuild every weight in fp32 and multiply in fp32: a decode step
of a quantised model is then bound by those instructions, not by reading the weights.
Here, as llama.cpp computes, the GEMM's input rows are quantised per block of 32 inputs
to int8 codes a with a scale s = max |x| / 127 (`quantize_rows`), and each run of the
weight's codes q (the file's: d and m per run, `grid_gemm.from_codes`) is multiplied by
them in 32-bit integers, 4 byte products an instruction lane (AVX2's vpmaddubsw then
vpmaddwd by ones: 32 a pair; AVX-512 VNNI's vpdpbusd: 64 in one):

    out = sum over runs of d * s * (q . a) + m * (s * sum(a))

vpmaddubsw multiplies unsigned bytes by signed ones and adds adjacent pairs in 16 bits:
4-bit codes (0..15) are the unsigned side as they are; signed 8-bit codes give it their
magnitudes, and their signs go to the row's codes (vpsignb). A pair then adds at most
2 * 128 * 127, which 16 bits hold.

A K-quant's weight (SUPER scales: d and dmin a super-block of 256 inputs, an integer
scale and min a run) takes rows quantised per super-block instead, as llama.cpp's q8_K,
and each run's integer scale multiplies its products in the widening (`_super_pass`):
d * s and dmin * s then scale two 32-bit sums once a super-block, not once a run.

A pass takes up to ROWS rows over a tile; each code word is unpacked once for all of them
(`dot_nibble_rows`, `dot_six_rows`, `dot_signed_rows`), and what is live at once fits
AVX2's 16 registers.

The weight keeps the file's values exactly; the products differ from fp32 ones by the
rows' rounding to int8, so this is a setting (`--gguf-activations int8`), not the exact
path. Each output's sum runs over the runs in K order, whatever the rows: a row gets the
same bits in a step of any size and on either path (fused or layer by layer).

Layouts: `grid_gemm.DOT4`, `DOT8`, `DOT8_FINE` and `DOT6_FINE` (`to_int8` makes them of a
grid). DOT6_FINE reads a Q6_K's codes in 6 bits, a quarter fewer bytes than 8: a decode
step's GEMMs are bound by the bytes they read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types

from pagedinfer.kernels.cpu import grid_gemm
from pagedinfer.kernels.cpu.greedy_argmax import fma_ints
from pagedinfer.kernels.cpu.layer_ops import silu_times
from pagedinfer.kernels.cpu.numba_support import (
    FASTMATH,
    avx2_madds,
    int_stack_array,
    intrinsic,
    jit,
    lanes_add,
    lanes_copy,
    lanes_fma,
    lanes_mul,
    prefetch,
    prefetch_all,
    stack_array,
)

LANES = grid_gemm.LANES
BLOCK = grid_gemm.GRID_BLOCK  # inputs sharing one scale of a row's int8 codes
CODE_MAX = 127
_FEATURES = llvm.get_host_cpu_features()
VNNI = bool(_FEATURES.get("avx512vnni", False))
AVX2 = bool(_FEATURES.get("avx2", False))
# Rows one pass over a tile takes (fewer left over go one at a time): each keeps 16 lanes
# of 32-bit sums and of fp32 totals, which AVX2's 16 registers hold for 4 rows at most.
ROWS = 4
SILU_VALUES = 2048  # gate outputs one SiLU call of a gate/up GEMM takes, at least a group's
# How far ahead of a pass's codes it asks for their cache lines (a line a word of 16
# lanes): a decode step's single row reads the weight once from memory, faster than
# the hardware prefetcher alone keeps up with.
AHEAD_WORDS = 96
# The grid kinds whose codes the integer products take, and the layout each becomes.
_DOT_OF = {
    grid_gemm.AFFINE4: grid_gemm.DOT4,
    grid_gemm.SCALED8: grid_gemm.DOT8,
    grid_gemm.FINE8: grid_gemm.DOT8_FINE,
    grid_gemm.FINE6: grid_gemm.DOT8_FINE,
}


def fast() -> bool:
    """Whether this CPU multiplies bytes into 32-bit sums in one or two instructions."""
    return VNNI or AVX2


def six_bits_fit(grid: grid_gemm.GridWeight) -> bool:
    """Whether a grid of runs of 16 has codes in -32..31 (a Q6_K's, or Q4_K rows beside
    them), which DOT6_FINE keeps in 6 bits."""
    if grid.kind == grid_gemm.FINE6:
        return True
    if grid.kind != grid_gemm.FINE8:
        return False
    codes = grid.codes.view(np.int8)
    return bool(codes.min() >= -grid_gemm.SIX_BIT_ZERO and codes.max() < grid_gemm.SIX_BIT_ZERO)


def five_bits_fit(grid: grid_gemm.GridWeight) -> bool:
    """Whether a grid of 8-bit codes has codes in 0..31 (a Q5_K's or Q5_1's), which DOT5
    keeps in 5 bits."""
    if grid.kind != grid_gemm.SCALED8:
        return False
    codes = grid.codes.view(np.int8)
    return bool(codes.min() >= 0 and codes.max() < 32)


def to_int8(
    grid: grid_gemm.GridWeight, six_bits: bool = True, five_bits: bool = True
) -> grid_gemm.GridWeight | None:
    """A grid's codes in the layout of its integer products (its scales as they are), or
    None for a kind they do not take (a weight on no grid, or LEVELS4). six_bits: runs of
    16 whose codes fit 6 bits become DOT6_FINE (else DOT8_FINE); five_bits: 8-bit codes
    that fit 5 bits become DOT5 (else DOT8)."""
    kind = _DOT_OF.get(grid.kind)
    if kind is None:
        return None
    if kind == grid_gemm.DOT8_FINE and six_bits and six_bits_fit(grid):
        kind = grid_gemm.DOT6_FINE
    if kind == grid_gemm.DOT8 and five_bits and five_bits_fit(grid):
        kind = grid_gemm.DOT5
    q = grid_gemm._codes(grid.kind, grid.codes)  # int8 [tiles, K, 16]
    tiles, k = q.shape[:2]
    if kind == grid_gemm.DOT5:
        c = q.view(np.uint8).reshape(tiles, k // 32, 4, 2, 4, LANES)  # [.., j, p, i, 16]
        words = np.empty((tiles, k // 32, 5, 4, LANES), dtype=np.uint8)
        words[:, :, :4] = (c[:, :, :, 0] & np.uint8(15)) | ((c[:, :, :, 1] & np.uint8(15)) << 4)
        words[:, :, 4] = 0
        for j in range(4):
            for p in range(2):
                fifth = (c[:, :, j, p] >> np.uint8(4)) & np.uint8(1)
                words[:, :, 4] |= fifth << np.uint8(2 * j + p)
        codes = np.ascontiguousarray(words.transpose(0, 1, 2, 4, 3)).view(np.int32)[..., 0]
        codes = codes.reshape(tiles, k // 32 * 5, LANES)
        return grid_gemm.GridWeight(kind, grid.out_features, grid.in_features, codes, grid.scales)
    if kind == grid_gemm.DOT6_FINE:
        c = (q.astype(np.int16) + grid_gemm.SIX_BIT_ZERO).astype(np.uint8)
        c = c.reshape(tiles, k // 16, 4, 4, LANES)  # [.., 4 inputs j, 4 bytes i, 16]: 4j + i
        words = np.empty((tiles, k // 16, 3, 4, LANES), dtype=np.uint8)
        low = c & np.uint8(15)
        words[:, :, 0] = low[:, :, 0] | (low[:, :, 1] << np.uint8(4))
        words[:, :, 1] = low[:, :, 2] | (low[:, :, 3] << np.uint8(4))
        words[:, :, 2] = 0
        for j in range(4):
            words[:, :, 2] |= (c[:, :, j] >> np.uint8(4)) << np.uint8(2 * j)
        codes = np.ascontiguousarray(words.transpose(0, 1, 2, 4, 3)).view(np.int32)[..., 0]
        codes = codes.reshape(tiles, k // 16 * 3, LANES)
        return grid_gemm.GridWeight(kind, grid.out_features, grid.in_features, codes, grid.scales)
    if kind == grid_gemm.DOT4:
        nibbles = q.view(np.uint8).reshape(tiles, k // 8, 2, 4, LANES)
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << np.uint8(4))  # [tiles, K / 8, 4, 16]
    else:
        packed = q.reshape(tiles, k // 4, 4, LANES)
    codes = np.ascontiguousarray(packed.transpose(0, 1, 3, 2)).view(np.int32)[..., 0]
    return grid_gemm.GridWeight(kind, grid.out_features, grid.in_features, codes, grid.scales)


@jit(nogil=True, error_model="numpy")
def quantize_rows(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, sums: np.ndarray) -> None:
    """Rows x (fp32 [M, K]) as int8 codes [M, K] per block of inputs (BLOCK, or a
    super-block's 256 for a K-quant's weight, as llama.cpp's q8_0 and q8_K), rounded as
    q8_0's AVX2 code rounds them: s = max |x| / 127 (scales [M, K / block], kept in
    fp32 where q8_0 keeps an fp16), a = x * (127 / max |x|) rounded to nearest, ties to
    even (0 where max |x| is 0). sums [M, K / run]: s * sum(a) of each run
    of inputs (runs of BLOCK or BLOCK / 2), the rows' share of a grid's offsets m."""
    m, k = x.shape
    run = k // sums.shape[1]
    block = k // scales.shape[1]
    for r in range(m):
        for b in range(k // block):
            largest = np.float32(0.0)
            for i in range(b * block, (b + 1) * block):
                largest = max(largest, abs(x[r, i]))
            s = largest / np.float32(CODE_MAX)
            inverse = np.float32(CODE_MAX) / largest if largest > 0 else np.float32(0.0)
            scales[r, b] = s
            for i in range(b * block, (b + 1) * block):
                a = min(max(np.rint(x[r, i] * inverse), -CODE_MAX), CODE_MAX)
                codes[r, i] = np.int8(a)
            for h in range(b * block // run, (b + 1) * block // run):
                total = 0
                for i in range(h * run, (h + 1) * run):
                    total += codes[r, i]
                sums[r, h] = s * np.float32(total)


@jit(nogil=True, error_model="numpy")
def run_code_sums(codes: np.ndarray, sums: np.ndarray) -> None:
    """sums [M, K / run]: each run's sum of the rows' int8 codes [M, K]."""
    m, runs = sums.shape
    run = codes.shape[1] // runs
    for r in range(m):
        for h in range(runs):
            total = 0
            for i in range(h * run, (h + 1) * run):
                total += codes[r, i]
            sums[r, h] = total


@functools.cache
def _pass(kind: str, rows: int, in_features: int) -> Callable[..., None]:
    """one_pass(words, row_scales, row_sums, row_ints, codes, scales, t, r0, out, o, add):
    rows r0
    .. r0 + rows - 1 times tile t of the weight into out[r, o] (+= with add): per run,
    the 32-bit sums of code products, times d * s, plus m * s * sum(a), in K order."""
    run = grid_gemm.block_of(kind)
    runs = in_features // run
    per_super = grid_gemm.SUPER_BLOCK // run  # runs a super-block of SUPER scales
    nibbles = kind == grid_gemm.DOT4
    six = kind == grid_gemm.DOT6_FINE
    five = kind == grid_gemm.DOT5
    code_words = run // 8 if nibbles else run // 4  # a run's words of a lane's codes
    run_words = 3 if six else 5 if five else code_words  # a run's words in the layout
    runs_per_block = BLOCK // run
    zero = grid_gemm.SIX_BIT_ZERO

    @jit(nogil=True, error_model="numpy", inline="always")
    def one_pass(
        words: np.ndarray,
        row_scales: np.ndarray,
        row_sums: np.ndarray,
        row_ints: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        t: int,
        r0: int,
        out: np.ndarray,
        o: int,
        add: bool,
    ) -> None:
        total = stack_array((rows, LANES))
        sums = int_stack_array((rows, LANES))
        dm = stack_array((2, LANES))
        scale = stack_array((LANES,))
        for r in range(rows):
            lanes_copy(total[r], np.float32(0.0), LANES)
        tile_words = codes.shape[1]
        for b in range(runs):
            ahead = t * tile_words + b * run_words + AHEAD_WORDS
            for w in range(run_words):
                prefetch(codes, (ahead + w) * LANES)
            prefetch(scales, (t * runs + b + AHEAD_WORDS // run_words) * 2 * LANES)
            grid_gemm._block_scales(dm, scales, (t * runs + b) * 2 * LANES, per_super)
            for r in range(rows):
                # DOT6_FINE's codes are offset by `zero`: their products start at -zero
                # times the run's sum of row codes, which leaves q . a exactly.
                start = -zero * row_ints[r0 + r, b] if six else 0
                for lane in range(LANES):
                    sums[r, lane] = start
            if six:
                dot_six_rows(sums, words, r0, codes, t, b, None, rows)
            elif five:
                dot_five_rows(sums, words, r0, codes, t, b, None, rows)
            elif nibbles:
                dot_nibble_rows(sums, words, r0, codes, t, b * code_words, code_words, None, rows)
            else:
                for r in range(rows):  # a row at a time: faster here than all the rows
                    dot_signed_rows(
                        sums[r : r + 1],
                        words,
                        r0 + r,
                        codes,
                        t,
                        b * code_words,
                        code_words,
                        None,
                        1,
                    )
            for r in range(rows):
                lanes_mul(scale, dm[0], row_scales[r0 + r, b // runs_per_block], LANES)
                fma_ints(total[r], sums[r], scale)
                lanes_fma(total[r], dm[1], row_sums[r0 + r, b], LANES)
        for r in range(rows):
            if add:
                lanes_add(out[r0 + r, o], total[r], LANES)
            else:
                lanes_copy(out[r0 + r, o], total[r], LANES)

    return one_pass


@functools.cache
def _super_pass(kind: str, rows: int, in_features: int) -> Callable[..., None]:
    """one_pass(words, row_scales, row_ints, codes, scales, t, r0, out, o, add), as
    `_pass`'s for a weight of SUPER scales, with rows quantised per super-block
    (row_scales [M, K / 256]; row_ints [M, K / run]: each run's sum of row codes): per
    super-block, the runs' code products times their integer scales summed in 32 bits
    (less 32 * scale * sum(a) a run for DOT6_FINE's offset codes), and the mins' products
    sum(min * sum(a)); then total += fp32(that) * (d * s) and fp32(the mins') * (dmin * -s)."""
    run = grid_gemm.block_of(kind)
    runs = grid_gemm.SUPER_BLOCK // run  # runs a super-block
    supers = in_features // grid_gemm.SUPER_BLOCK
    nibbles = kind == grid_gemm.DOT4
    six = kind == grid_gemm.DOT6_FINE
    five = kind == grid_gemm.DOT5
    code_words = run // 8 if nibbles else run // 4
    run_words = 3 if six else 5 if five else code_words
    zero = grid_gemm.SIX_BIT_ZERO

    @jit(nogil=True, error_model="numpy", inline="always")
    def one_pass(
        words: np.ndarray,
        row_scales: np.ndarray,
        row_ints: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        t: int,
        r0: int,
        out: np.ndarray,
        o: int,
        add: bool,
    ) -> None:
        total = stack_array((rows, LANES))
        sums = int_stack_array((rows, LANES))
        least = int_stack_array((rows, LANES))
        pairs = int_stack_array((runs, LANES))
        plain = int_stack_array((runs, LANES))
        mins = int_stack_array((runs, LANES))
        heads = stack_array((2, LANES))
        factor = stack_array((LANES,))
        with_mins = scale_layout(scales) == SUPER_MINS
        for r in range(rows):
            lanes_copy(total[r], np.float32(0.0), LANES)
        for sb in range(supers):
            super_scales(pairs, plain, mins, heads, scales, t, sb, runs)
            sums[:] = 0
            least[:] = 0
            for j in range(runs):
                b = sb * runs + j
                ahead = t * codes.shape[1] + b * run_words + AHEAD_WORDS
                for w in range(run_words):
                    prefetch(codes, (ahead + w) * LANES)
                if nibbles:
                    dot_nibble_rows(
                        sums, words, r0, codes, t, b * code_words, code_words, pairs[j], rows
                    )
                elif six:
                    dot_six_rows(sums, words, r0, codes, t, b, pairs[j], rows)
                elif five:
                    dot_five_rows(sums, words, r0, codes, t, b, pairs[j], rows)
                else:
                    dot_signed_rows(
                        sums, words, r0, codes, t, b * code_words, code_words, pairs[j], rows
                    )
                for r in range(rows):
                    if six:
                        int_lanes_fma(sums[r], plain[j], -zero * row_ints[r0 + r, b])
                    if with_mins:
                        int_lanes_fma(least[r], mins[j], row_ints[r0 + r, b])
            for r in range(rows):
                s = row_scales[r0 + r, sb]
                lanes_mul(factor, heads[0], s, LANES)
                fma_ints(total[r], sums[r], factor)
                if with_mins:
                    lanes_mul(factor, heads[1], -s, LANES)
                    fma_ints(total[r], least[r], factor)
        for r in range(rows):
            if add:
                lanes_add(out[r0 + r, o], total[r], LANES)
            else:
                lanes_copy(out[r0 + r, o], total[r], LANES)

    return one_pass


@functools.cache
def gemm_all_rows(
    kind: str, in_features: int, silu: bool = False, gelu: bool = False
) -> Callable[..., None]:
    """gemm(x, codes, scales, out, add, worker, workers), as `grid_gemm.gemm_all_rows`
    gives for a grid's kinds, for the DOTS kinds: each worker quantises the rows
    (`quantize_rows`: a small share of its work, and no barrier), then takes its share of
    the groups of TILE_GROUP tiles, side by side (one stream for the hardware prefetcher:
    a decode step reads each weight once, from memory), and runs ROWS rows a pass over
    each tile. silu:
    out [M, out_features / 32, 16] gets silu(gate) * up (gelu: gelu_tanh(gate) * up)."""
    k = in_features
    run = grid_gemm.block_of(kind)
    six = kind == grid_gemm.DOT6_FINE
    many, one = _pass(kind, ROWS, k), _pass(kind, 1, k)
    super_many, super_one = _super_pass(kind, ROWS, k), _super_pass(kind, 1, k)
    group_tiles, half = grid_gemm.TILE_GROUP, grid_gemm.TILE_GROUP // 2
    paired_tile = grid_gemm._paired_tile

    @jit(nogil=True, error_model="numpy")
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
        m = given.shape[0]
        folded = scale_layout(scales) != NO_SUPER  # a constant of the scales' type
        block = grid_gemm.SUPER_BLOCK if folded else BLOCK
        row_codes = np.empty((m, k), dtype=np.int8)
        row_scales = np.empty((m, k // block), dtype=np.float32)
        row_sums = np.empty((m, k // run), dtype=np.float32)
        quantize_rows(given, row_codes, row_scales, row_sums)
        row_ints = np.zeros((m, k // run if six or folded else 0), dtype=np.int32)
        if six or folded:
            run_code_sums(row_codes, row_ints)
        words = row_codes.view(np.int32)
        tiles = codes.shape[0]
        # silu: the gate/up products of a chunk of tile groups go through one SiLU (a call
        # of fixed cost that a group of one row's 32 values would not repay).
        batch, product, silu_scratch = silu_buffers(m, half, silu)
        groups = tiles // group_tiles
        first, end = groups * worker // workers, groups * (worker + 1) // workers
        step = batch if silu else max(end - first, 1)  # without silu, one chunk
        for chunk in range(first, end, step):
            chunk_end = min(end, chunk + step)
            for group in range(chunk, chunk_end):
                for r0 in range(0, m, ROWS):
                    rows = min(ROWS, m - r0)
                    for b in range(group_tiles):
                        if silu:
                            t = paired_tile(group, b, half, tiles)
                            side, o = b // half, (group - chunk) * half + b % half
                            target, add_here = product[side], False
                        else:
                            t = o = group * group_tiles + b
                            target, add_here = out, add
                        if folded:
                            if rows == ROWS:
                                super_many(
                                    words,
                                    row_scales,
                                    row_ints,
                                    codes,
                                    scales,
                                    t,
                                    r0,
                                    target,
                                    o,
                                    add_here,
                                )
                            else:
                                for r in range(r0, r0 + rows):
                                    super_one(
                                        words,
                                        row_scales,
                                        row_ints,
                                        codes,
                                        scales,
                                        t,
                                        r,
                                        target,
                                        o,
                                        add_here,
                                    )
                        elif rows == ROWS:
                            many(
                                words,
                                row_scales,
                                row_sums,
                                row_ints,
                                codes,
                                scales,
                                t,
                                r0,
                                target,
                                o,
                                add_here,
                            )
                        else:
                            for r in range(r0, r0 + rows):
                                one(
                                    words,
                                    row_scales,
                                    row_sums,
                                    row_ints,
                                    codes,
                                    scales,
                                    t,
                                    r,
                                    target,
                                    o,
                                    add_here,
                                )
            if silu:
                silu_chunk(
                    product, out, chunk * half, (chunk_end - chunk) * half, silu_scratch, gelu
                )

    return gemm


@jit(inline="always")
def silu_buffers(m: int, half: int, silu: bool) -> tuple[int, np.ndarray, np.ndarray]:
    """For a gate/up GEMM of m rows whose tile groups hold `half` gate tiles (silu): the
    groups a SiLU call takes (enough for SILU_VALUES outputs), the products [2, m, batch *
    half, 16] they collect and `silu_chunk`'s scratch; without silu, 0 and empty arrays."""
    batch = max(1, SILU_VALUES // (m * half * LANES)) if silu else 0
    product = np.zeros((2, m if silu else 0, batch * half, LANES), dtype=np.float32)
    scratch = np.empty((4, m * batch * half * LANES if silu else 0), np.float32)
    return batch, product, scratch


@jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
def silu_chunk(
    product: np.ndarray,
    out: np.ndarray,
    first: int,
    width: int,
    scratch: np.ndarray,
    gelu: bool,
) -> None:
    """out[r, first + j] = silu(gate) * up (gelu: gelu_tanh) for j < width, every row r,
    of a chunk's products [2, M, W >= width, 16] (gate tiles, then the same tiles of up):
    one `layer_ops.silu_times` over the whole chunk, compiled as `silu_mul` is, so that
    both give the same bits. scratch: fp32 [4, M * W * 16]."""
    m, tiles = product.shape[1], product.shape[2]
    n = m * tiles * LANES
    result, negative, decay = scratch[0], scratch[1], scratch[2]
    bits = scratch[3].view(np.int32)
    silu_times(product[0].reshape(n), product[1].reshape(n), result, negative, decay, bits, gelu)
    for r in range(m):
        for j in range(width):
            lanes_copy(out[r, first + j], result[(r * tiles + j) * LANES :], LANES)


# -- super-block scales folded into the integer sums ---------------------------------------
# A GGUF K-quant's weight is d * scale * q - dmin * min in each run, with d and dmin shared
# by a super-block of 256 inputs and integer scale and min per run. With rows quantised per
# super-block (one s per 256 inputs, as llama.cpp's q8_K), each run's byte products are
# multiplied by their integer scale in the widening (vpmaddwd) and summed in 32 bits over
# the super-block; d * s and -dmin * s multiply two integer sums once per super-block.

NO_SUPER, SUPER_SCALES, SUPER_MINS = 0, 1, 2


def _layout_of(scales: Any) -> int:
    if isinstance(scales, types.Array) and scales.ndim == 3:
        if scales.dtype == types.uint8:
            return SUPER_MINS
        if scales.dtype == types.int8:
            return SUPER_SCALES
    return NO_SUPER


@intrinsic
def scale_layout(typingctx: Any, scales: Any) -> Any:
    """NO_SUPER, SUPER_SCALES or SUPER_MINS (`grid_gemm.super_layout`), a constant of the
    scales' type that the compiled branches on it fold away."""
    layout = _layout_of(scales)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return ir.Constant(ir.IntType(64), layout)

    return types.int64(scales), codegen


@intrinsic
def int_lanes_fma(typingctx: Any, acc: Any, x: Any, n: Any) -> Any:
    """acc[:16] += x[:16] * n, in int32 (acc, x: int32 lanes; n an integer)."""
    if not (_int_lanes(acc) and _int_lanes(x) and isinstance(n, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vector = ir.VectorType(ir.IntType(32), LANES)
        target = _lanes_pointer(context, builder, signature.args[0], args[0])
        x_ = builder.load(_lanes_pointer(context, builder, signature.args[1], args[1]), align=4)
        one = context.cast(builder, args[2], signature.args[2], types.int32)
        spread = builder.shuffle_vector(
            builder.insert_element(ir.Constant(vector, ir.Undefined), one, ir.IntType(32)(0)),
            ir.Constant(vector, ir.Undefined),
            ir.Constant(vector, [0] * LANES),
        )
        total = builder.add(builder.load(target, align=4), builder.mul(x_, spread))
        builder.store(total, target, align=4)
        return context.get_dummy_value()

    return types.void(acc, x, n), codegen


@intrinsic
def super_scales(
    typingctx: Any,
    pairs: Any,
    plain: Any,
    mins: Any,
    heads: Any,
    scales: Any,
    t: Any,
    sb: Any,
    runs: Any,
) -> Any:
    """Super-block sb of tile t of SUPER scales, for each of its `runs` runs j (a
    compile-time constant): plain[j] the 16 lanes'
    integer scales, pairs[j] each in both 16-bit halves of its lane (as vpmaddwd takes it),
    mins[j] the lanes' mins (SUPER_MINS only); heads[0] the lanes' d and heads[1] their
    dmin (0 without mins), fp32. Nothing for scales of another layout."""
    layout = _layout_of(scales)
    if not (
        all(isinstance(a, types.Array) and a.dtype == types.int32 for a in (pairs, plain, mins))
        and isinstance(heads, types.Array)
        and heads.dtype == types.float32
        and isinstance(runs, types.IntegerLiteral)
    ):
        return None
    run_count = runs.literal_value

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if layout == NO_SUPER:
            return context.get_dummy_value()
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        bytes16 = ir.VectorType(i8, LANES)
        ints = ir.VectorType(i32, LANES)
        floats = ir.VectorType(ir.FloatType(), LANES)
        scales_type = signature.args[4]
        array = context.make_array(scales_type)(context, builder, args[4])
        t_, sb_ = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (5, 6))
        base = cgutils.get_item_pointer(context, builder, scales_type, array, [t_, sb_, i64(0)])
        base = builder.bitcast(base, ir.IntType(8).as_pointer())
        head, per_run = (4 * LANES, 2 * LANES) if layout == SUPER_MINS else (2 * LANES, LANES)

        def at(offset: int, element: ir.Type) -> Any:
            pointer = builder.gep(base, [i64(offset)])
            return builder.load(builder.bitcast(pointer, element.as_pointer()), align=1)

        def row_of(index: int, j: int) -> Any:
            data = context.make_array(signature.args[index])(context, builder, args[index]).data
            return builder.bitcast(builder.gep(data, [i64(j * LANES)]), ints.as_pointer())

        def half_floats(offset: int) -> Any:
            raw = builder.bitcast(
                at(offset, ir.VectorType(i16, LANES)), ir.VectorType(ir.HalfType(), LANES)
            )
            return builder.fpext(raw, floats)

        heads_data = context.make_array(signature.args[3])(context, builder, args[3]).data
        d_at = builder.bitcast(heads_data, floats.as_pointer())
        builder.store(half_floats(0), d_at, align=4)
        dmin = half_floats(2 * LANES) if layout == SUPER_MINS else ir.Constant(floats, None)
        builder.store(dmin, builder.gep(d_at, [i64(1)]), align=4)
        sixteen = ir.Constant(ints, [16] * LANES)
        mask = ir.Constant(ints, [0xFFFF] * LANES)
        for j in range(run_count):
            scale = builder.sext(at(head + j * per_run, bytes16), ints)
            builder.store(scale, row_of(1, j), align=4)
            pair = builder.or_(builder.and_(scale, mask), builder.shl(scale, sixteen))
            builder.store(pair, row_of(0, j), align=4)
            if layout == SUPER_MINS:
                least = builder.zext(at(head + j * per_run + LANES, bytes16), ints)
                builder.store(least, row_of(2, j), align=4)
        return context.get_dummy_value()

    return types.void(pairs, plain, mins, heads, scales, t, sb, runs), codegen


# -- byte products ------------------------------------------------------------------------


def _int_lanes(t: Any) -> bool:
    return isinstance(t, types.Array) and t.dtype == types.int32 and t.ndim == 1


def _lanes_pointer(context: Any, builder: Any, array_type: Any, array: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(data, ir.VectorType(ir.IntType(32), LANES).as_pointer())


def _spread(context: Any, builder: Any, word: Any, word_type: Any) -> Any:
    """A 32-bit word in every lane of 16, as 64 bytes."""
    i32 = ir.IntType(32)
    vector = ir.VectorType(i32, LANES)
    one = context.cast(builder, word, word_type, types.int32)
    lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), one, i32(0))
    spread = builder.shuffle_vector(
        lane0, ir.Constant(vector, ir.Undefined), ir.Constant(vector, [0] * LANES)
    )
    return builder.bitcast(spread, ir.VectorType(ir.IntType(8), 4 * LANES))


def _madd(builder: Any, acc: Any, *pairs: tuple[Any, Any], scales: Any = None) -> Any:
    """acc (16 int32 lanes) + the sums of each lane's 4 products of unsigned bytes by signed
    bytes (64 each) of every pair (unsigned, signed), times the lane's scale where scales
    (16 int32 lanes, each scale in both 16-bit halves: `super_scales`) is given:
    vpdpbusd with AVX-512 VNNI, else vpmaddubsw and vpmaddwd by ones (or the scales) on
    AVX2's 256-bit halves (all the pairs' 16-bit sums added before one vpmaddwd: the
    callers keep them in 16 bits, as a run of 4-bit codes, 8 * 2 * 15 * 127 at most), else
    plain integer vector code."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    vector = ir.VectorType(i32, LANES)
    if VNNI or not AVX2:
        sum_of = ir.Constant(vector, None) if scales is not None else acc
        if VNNI:
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(vector, [vector] * 3),
                "llvm.x86.avx512.vpdpbusd.512",
            )
            for unsigned, signed in pairs:
                sum_of = builder.call(
                    function,
                    [sum_of, builder.bitcast(unsigned, vector), builder.bitcast(signed, vector)],
                )
        else:
            wide = ir.VectorType(i32, 4 * LANES)
            for unsigned, signed in pairs:
                products = builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide))
                for i in range(4):
                    part = ir.Constant(vector, list(range(i, 4 * LANES, 4)))
                    sum_of = builder.add(sum_of, builder.shuffle_vector(products, products, part))
        if scales is None:
            return sum_of
        sixteen = ir.Constant(vector, [16] * LANES)
        scale = builder.ashr(builder.shl(scales, sixteen), sixteen)
        return builder.add(acc, builder.mul(sum_of, scale))
    half_words = ir.VectorType(i16, LANES)
    pair_sums, quads = avx2_madds(builder)
    ones = ir.Constant(half_words, [1] * LANES)
    halves = []
    for h in range(2):
        part = ir.Constant(
            ir.VectorType(i32, 2 * LANES), list(range(h * 2 * LANES, (h + 1) * 2 * LANES))
        )
        if scales is not None:
            lanes = ir.Constant(ir.VectorType(i32, LANES // 2), list(range(h * 8, h * 8 + 8)))
            ones = builder.bitcast(builder.shuffle_vector(scales, scales, lanes), half_words)
        products = None
        for unsigned, signed in pairs:
            product = builder.call(
                pair_sums,
                [
                    builder.shuffle_vector(unsigned, unsigned, part),
                    builder.shuffle_vector(signed, signed, part),
                ],
            )
            products = product if products is None else builder.add(products, product)
        halves.append(builder.call(quads, [products, ones]))
    whole = builder.shuffle_vector(halves[0], halves[1], ir.Constant(vector, list(range(LANES))))
    return builder.add(acc, whole)


def _with_signs(builder: Any, row: Any, q: Any) -> Any:
    """row's bytes with the signs of q's (0 where q is 0): vpsignb on AVX2's halves."""
    zero = ir.Constant(q.type, None)
    if VNNI or not AVX2:
        negative = builder.icmp_signed("<", q, zero)
        kept = builder.select(builder.icmp_signed("==", q, zero), zero, row)
        return builder.select(negative, builder.sub(zero, row), kept)
    half = ir.VectorType(ir.IntType(8), 2 * LANES)
    sign = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(half, [half, half]), "llvm.x86.avx2.psign.b"
    )
    i32 = ir.IntType(32)
    parts = []
    for h in range(2):
        part = ir.Constant(
            ir.VectorType(i32, 2 * LANES), list(range(h * 2 * LANES, (h + 1) * 2 * LANES))
        )
        parts.append(
            builder.call(
                sign, [builder.shuffle_vector(row, row, part), builder.shuffle_vector(q, q, part)]
            )
        )
    return builder.shuffle_vector(
        parts[0], parts[1], ir.Constant(ir.VectorType(i32, 4 * LANES), list(range(4 * LANES)))
    )


@intrinsic
def dot_signed_rows(
    typingctx: Any,
    sums: Any,
    words: Any,
    r0: Any,
    codes: Any,
    t: Any,
    g0: Any,
    count: Any,
    scales: Any,
    rows: Any,
) -> Any:
    """sums[r, l] += a run's products of signed 8-bit codes (words g0 .. g0 + count - 1 of
    tile t of codes: int32 [tiles, K / 4, 16], each 4 inputs' codes of a lane) by row
    r0 + r of a rows' int8 codes (words: int32 [M, K / 4]), for each of `rows` rows;
    count and rows compile-time constants. Each product: a code's magnitude (unsigned:
    -128 gives 128) times the row's byte with the code's sign (0 where the code is 0);
    each word widens on its own (a pair of products fills 16 bits). A word's magnitudes
    are taken once for all the rows. scales: None, or each lane's scale of the run
    (`_madd`)."""
    if not (
        isinstance(sums, types.Array)
        and sums.ndim == 2
        and sums.dtype == types.int32
        and _int_arrays(words, 2)
        and _int_arrays(codes, 3)
        and all(isinstance(i, types.Integer) for i in (r0, t, g0))
        and isinstance(count, types.IntegerLiteral)
        and _scales_or_none(scales)
        and isinstance(rows, types.IntegerLiteral)
    ):
        return None
    words_count, row_count = count.literal_value, rows.literal_value

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        bytes_type = ir.VectorType(ir.IntType(8), 4 * LANES)
        vector = ir.VectorType(ir.IntType(32), LANES)
        zero = ir.Constant(bytes_type, None)
        read = _RunReader(context, builder, signature, args)
        lane_scales = _load_scales(context, builder, signature.args[7], args[7])
        sums_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        targets = [
            builder.bitcast(builder.gep(sums_data, [i64(r * LANES)]), vector.as_pointer())
            for r in range(row_count)
        ]
        acc = [builder.load(target, align=4) for target in targets]
        for j in range(words_count):
            q = read.codes(j)
            negative = builder.icmp_signed("<", q, zero)
            magnitude = builder.select(negative, builder.sub(zero, q), q)
            for r in range(row_count):
                row = read.row(read.g(j), r)
                pair = (magnitude, _with_signs(builder, row, q))
                acc[r] = _madd(builder, acc[r], pair, scales=lane_scales)
        for r in range(row_count):
            builder.store(acc[r], targets[r], align=4)
        return context.get_dummy_value()

    return types.void(sums, words, r0, codes, t, g0, count, scales, rows), codegen


def _scales_or_none(t: Any) -> bool:
    return isinstance(t, types.NoneType) or _int_lanes(t)


def _load_scales(context: Any, builder: Any, array_type: Any, array: Any) -> Any:
    """A run's lane scales (16 int32 lanes) from an array, or None for None."""
    if isinstance(array_type, types.NoneType):
        return None
    return builder.load(_lanes_pointer(context, builder, array_type, array), align=4)


def _int_arrays(t: Any, ndim: int) -> bool:
    return isinstance(t, types.Array) and t.ndim == ndim and t.dtype == types.int32


class _RunReader:
    """In an intrinsic's code (args: sums, words, r, codes, t, g0, ...): word g0 + j of
    tile t's codes as 64 bytes, and row r's word w in every lane."""

    def __init__(self, context: Any, builder: Any, signature: Any, args: Any) -> None:
        self.context, self.builder = context, builder
        self.words_type, self.codes_type = signature.args[1], signature.args[3]
        self.words = context.make_array(self.words_type)(context, builder, args[1])
        self.codes_array = context.make_array(self.codes_type)(context, builder, args[3])
        self.r, self.t, self.g0 = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 4, 5)
        )

    def g(self, j: int) -> Any:
        """The index of the run's word j (g0 + j)."""
        return self.builder.add(self.g0, ir.IntType(64)(j))

    def codes(self, j: int) -> Any:
        """Word g0 + j of the tile's codes: 64 bytes."""
        builder, i64 = self.builder, ir.IntType(64)
        at = cgutils.get_item_pointer(
            self.context, builder, self.codes_type, self.codes_array, [self.t, self.g(j), i64(0)]
        )
        lanes = builder.bitcast(at, ir.VectorType(ir.IntType(32), LANES).as_pointer())
        return builder.bitcast(
            builder.load(lanes, align=4), ir.VectorType(ir.IntType(8), 4 * LANES)
        )

    def row(self, w: Any, offset: int = 0) -> Any:
        """Row r + offset's word w (an i64 value) in every lane, as 64 bytes."""
        row = self.builder.add(self.r, ir.IntType(64)(offset))
        pointer = cgutils.get_item_pointer(
            self.context, self.builder, self.words_type, self.words, [row, w]
        )
        return _spread(self.context, self.builder, self.builder.load(pointer), types.int32)


@intrinsic
def dot_five_rows(
    typingctx: Any,
    sums: Any,
    words: Any,
    r0: Any,
    codes: Any,
    t: Any,
    b: Any,
    scales: Any,
    rows: Any,
) -> Any:
    """sums[r, l] += the products of run b's 32 inputs' 5-bit codes (DOT5's five words
    5b .. 5b + 4 of lane l of tile t: four DOT4 words of low 4 bits, one of fifth bits)
    by row r0 + r's int8 codes (words 8b .. 8b + 7 of words: int32 [M, K / 4]), for each
    of `rows` rows (a compile-time constant): the codes unpacked once for all the rows.
    Four words' pairs add in 16 bits before each widening, at most 8 * 31 * 127. scales:
    None, or each lane's scale of the run (`_madd`)."""
    if not (
        isinstance(sums, types.Array)
        and sums.ndim == 2
        and sums.dtype == types.int32
        and _int_arrays(words, 2)
        and _int_arrays(codes, 3)
        and all(isinstance(i, types.Integer) for i in (r0, t, b))
        and _scales_or_none(scales)
        and isinstance(rows, types.IntegerLiteral)
    ):
        return None
    row_count = rows.literal_value

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        bytes_type = ir.VectorType(ir.IntType(8), 4 * LANES)
        vector = ir.VectorType(ir.IntType(32), LANES)
        words_type, codes_type = signature.args[1], signature.args[3]
        words = context.make_array(words_type)(context, builder, args[1])
        code_words = context.make_array(codes_type)(context, builder, args[3])
        r0_, t_, b_ = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 4, 5)
        )
        sums_data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def lanes(value: int) -> Any:
            return ir.Constant(vector, [value] * LANES)

        def codes_at(i: int) -> Any:
            at = builder.add(builder.mul(b_, i64(5)), i64(i))
            pointer = cgutils.get_item_pointer(
                context, builder, codes_type, code_words, [t_, at, i64(0)]
            )
            return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=4)

        def fifth(high: Any, bit: int) -> Any:
            """Each byte's bit `bit` of high, moved to its bit 4 (16)."""
            moved = (
                builder.shl(high, lanes(4 - bit))
                if bit <= 4
                else builder.lshr(high, lanes(bit - 4))
            )
            return builder.and_(moved, lanes(0x10101010))

        high = codes_at(4)
        codes = []
        for j in range(4):
            q = codes_at(j)
            for p in range(2):
                nibble = builder.and_(q if p == 0 else builder.lshr(q, lanes(4)), lanes(0x0F0F0F0F))
                codes.append(
                    builder.bitcast(builder.or_(nibble, fifth(high, 2 * j + p)), bytes_type)
                )

        def row_word(row: Any, w: int) -> Any:
            at = builder.add(builder.mul(b_, i64(8)), i64(w))
            pointer = cgutils.get_item_pointer(context, builder, words_type, words, [row, at])
            return _spread(context, builder, builder.load(pointer), types.int32)

        lane_scales = _load_scales(context, builder, signature.args[6], args[6])
        for r in range(row_count):
            row = builder.add(r0_, i64(r))
            rows_ = [row_word(row, w) for w in range(8)]
            target = builder.bitcast(builder.gep(sums_data, [i64(r * LANES)]), vector.as_pointer())
            acc = builder.load(target, align=4)
            for half in range(2):
                pairs = [(codes[w], rows_[w]) for w in range(4 * half, 4 * half + 4)]
                acc = _madd(builder, acc, *pairs, scales=lane_scales)
            builder.store(acc, target, align=4)
        return context.get_dummy_value()

    return types.void(sums, words, r0, codes, t, b, scales, rows), codegen


@intrinsic
def dot_six_rows(
    typingctx: Any,
    sums: Any,
    words: Any,
    r0: Any,
    codes: Any,
    t: Any,
    b: Any,
    scales: Any,
    rows: Any,
) -> Any:
    """sums[r, l] += the products of run b's 16 inputs' 6-bit codes (DOT6_FINE's three
    words 3b .. 3b + 2 of lane l of tile t: two of low nibbles, one of high 2 bits;
    unsigned 0..63) by row r0 + r's int8 codes (words 4b .. 4b + 3 of words: int32
    [M, K / 4]), for each of `rows` rows (a compile-time constant): the codes unpacked
    once for all the rows. Two inputs' pairs add in 16 bits before each widening, at most
    4 * 63 * 127. scales: None, or each lane's scale of the run (`_madd`)."""
    if not (
        isinstance(sums, types.Array)
        and sums.ndim == 2
        and sums.dtype == types.int32
        and _int_arrays(words, 2)
        and _int_arrays(codes, 3)
        and all(isinstance(i, types.Integer) for i in (r0, t, b))
        and _scales_or_none(scales)
        and isinstance(rows, types.IntegerLiteral)
    ):
        return None
    row_count = rows.literal_value

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        bytes_type = ir.VectorType(ir.IntType(8), 4 * LANES)
        vector = ir.VectorType(ir.IntType(32), LANES)
        words_type, codes_type = signature.args[1], signature.args[3]
        words = context.make_array(words_type)(context, builder, args[1])
        code_words = context.make_array(codes_type)(context, builder, args[3])
        r0_, t_, b_ = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 4, 5)
        )
        sums_data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def splat(value: int) -> Any:
            return ir.Constant(bytes_type, [value] * (4 * LANES))

        def codes_at(i: int) -> Any:
            at = builder.add(builder.mul(b_, i64(3)), i64(i))
            pointer = cgutils.get_item_pointer(
                context, builder, codes_type, code_words, [t_, at, i64(0)]
            )
            lanes = builder.load(builder.bitcast(pointer, vector.as_pointer()), align=4)
            return builder.bitcast(lanes, bytes_type)

        low = [codes_at(0), codes_at(1)]
        high = codes_at(2)
        top = splat(0x30)
        codes = [
            builder.or_(
                builder.and_(low[0], splat(15)), builder.and_(builder.shl(high, splat(4)), top)
            ),
            builder.or_(
                builder.lshr(low[0], splat(4)), builder.and_(builder.shl(high, splat(2)), top)
            ),
            builder.or_(builder.and_(low[1], splat(15)), builder.and_(high, top)),
            builder.or_(
                builder.lshr(low[1], splat(4)), builder.and_(builder.lshr(high, splat(2)), top)
            ),
        ]
        lane_scales = _load_scales(context, builder, signature.args[6], args[6])

        def row_word(row: Any, j: int) -> Any:
            w = builder.add(builder.mul(b_, i64(4)), i64(j))
            pointer = cgutils.get_item_pointer(context, builder, words_type, words, [row, w])
            return _spread(context, builder, builder.load(pointer), types.int32)

        for r in range(row_count):
            rows_ = [row_word(builder.add(r0_, i64(r)), j) for j in range(4)]
            target = builder.bitcast(builder.gep(sums_data, [i64(r * LANES)]), vector.as_pointer())
            acc = builder.load(target, align=4)
            acc = _madd(
                builder, acc, (codes[0], rows_[0]), (codes[1], rows_[1]), scales=lane_scales
            )
            acc = _madd(
                builder, acc, (codes[2], rows_[2]), (codes[3], rows_[3]), scales=lane_scales
            )
            builder.store(acc, target, align=4)
        return context.get_dummy_value()

    return types.void(sums, words, r0, codes, t, b, scales, rows), codegen


@intrinsic
def dot_nibble_rows(
    typingctx: Any,
    sums: Any,
    words: Any,
    r0: Any,
    codes: Any,
    t: Any,
    g0: Any,
    count: Any,
    scales: Any,
    rows: Any,
) -> Any:
    """sums[r, l] += a run's products (DOT4 words g0 .. g0 + count - 1 of tile t of codes:
    int32 [tiles, K / 8, 16]; count a compile-time constant, at most 4) by row r0 + r of
    a rows' int8 codes (words: int32 [M, K / 4]), for each of `rows` rows (a compile-time
    constant). Each code word is unpacked once for all the rows, then every row's products
    of it are taken, so that what is live at once fits AVX2's 16 registers. A lane's
    byte-pair sums, 2 a word, add in 16 bits over the run (at most 8 * 2 * 15 * 127)
    before one widening. scales: None, or each lane's scale of the run (`_madd`)."""
    if not (
        isinstance(sums, types.Array)
        and sums.ndim == 2
        and sums.dtype == types.int32
        and _int_arrays(words, 2)
        and _int_arrays(codes, 3)
        and all(isinstance(i, types.Integer) for i in (r0, t, g0))
        and isinstance(count, types.IntegerLiteral)
        and count.literal_value <= 4
        and _scales_or_none(scales)
        and isinstance(rows, types.IntegerLiteral)
    ):
        return None
    words_count, row_count = count.literal_value, rows.literal_value

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        read = _RunReader(context, builder, signature, args)
        lane_scales = _load_scales(context, builder, signature.args[7], args[7])
        sums_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        vector = ir.VectorType(i32, LANES)
        bytes_type = ir.VectorType(i8, 4 * LANES)
        mask = ir.Constant(bytes_type, [15] * (4 * LANES))
        four = ir.Constant(bytes_type, [4] * (4 * LANES))
        words_type = signature.args[1]

        def row_word(r: int, w: Any) -> Any:
            pointer = cgutils.get_item_pointer(
                context, builder, words_type, read.words, [builder.add(read.r, i64(r)), w]
            )
            return _spread(context, builder, builder.load(pointer), types.int32)

        def target(r: int) -> Any:
            return builder.bitcast(builder.gep(sums_data, [i64(r * LANES)]), vector.as_pointer())

        if VNNI or not AVX2:
            # The run's codes unpacked once; each row's products of them summed in one
            # chain, times the lanes' scales once (`_madd`).
            unpacked = []
            for j in range(words_count):
                q = read.codes(j)
                low_word = builder.mul(read.g(j), i64(2))
                unpacked.append((builder.and_(q, mask), low_word))
                unpacked.append((builder.lshr(q, four), builder.add(low_word, i64(1))))
            for r in range(row_count):
                pairs = [(codes, row_word(r, w)) for codes, w in unpacked]
                total = _madd(builder, builder.load(target(r), align=4), *pairs, scales=lane_scales)
                builder.store(total, target(r), align=4)
            return context.get_dummy_value()
        half_words, half_ints = ir.VectorType(i16, LANES), ir.VectorType(i32, LANES // 2)
        pair_sums, quads = avx2_madds(builder)

        def half(v: Any, h: int) -> Any:
            part = ir.Constant(
                ir.VectorType(i32, 2 * LANES), list(range(h * 2 * LANES, (h + 1) * 2 * LANES))
            )
            return builder.shuffle_vector(v, v, part)

        acc = [[None, None] for _ in range(row_count)]
        for j in range(words_count):
            q = read.codes(j)
            low, high = builder.and_(q, mask), builder.lshr(q, four)
            low_word = builder.mul(read.g(j), i64(2))
            high_word = builder.add(low_word, i64(1))
            for r in range(row_count):
                a_low, a_high = row_word(r, low_word), row_word(r, high_word)
                for h in range(2):
                    product = builder.add(
                        builder.call(pair_sums, [half(low, h), half(a_low, h)]),
                        builder.call(pair_sums, [half(high, h), half(a_high, h)]),
                    )
                    acc[r][h] = product if acc[r][h] is None else builder.add(acc[r][h], product)
        ones = ir.Constant(half_words, [1] * LANES)
        for r in range(row_count):
            parts = []
            for h in range(2):
                weights = ones
                if lane_scales is not None:
                    lanes = ir.Constant(half_ints, list(range(h * 8, h * 8 + 8)))
                    weights = builder.bitcast(
                        builder.shuffle_vector(lane_scales, lane_scales, lanes), half_words
                    )
                parts.append(builder.call(quads, [acc[r][h], weights]))
            whole = builder.shuffle_vector(
                parts[0], parts[1], ir.Constant(vector, list(range(LANES)))
            )
            builder.store(builder.add(builder.load(target(r), align=4), whole), target(r), align=4)
        return context.get_dummy_value()

    return types.void(sums, words, r0, codes, t, g0, count, scales, rows), codegen
