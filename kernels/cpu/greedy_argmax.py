"""The argmax of the LM head's logits, computed without most of them (numba, CPU): the
token a greedy row samples, bit for bit the one the full fp32 logits give.

Greedy decoding needs one number from the LM head: which of its outputs is largest. With
a large vocabulary the LM head is a large share of a decode token's work. Here it runs
in three phases over rows of final-normed hidden states:

1. `quantize`: each block of 32 inputs of a row becomes 8-bit codes (7-bit without
   VNNI: `ROW_CODE_MAX`) with a scale s = max |h| / ROW_CODE_MAX; the norm of what that
   rounding left out, and the block's own norm, are kept per block.
2. `approximate`: every logit from 8-bit codes of the LM head (w = d * q + f per block of
   32 inputs: an 8-bit grid such as GGUF's Q8_0 as it is, f = 0; any other LM head
   rounded to one, f what that left out), each block summed exactly in 32-bit integers
   (AVX-512 VNNI: 64 byte products per instruction; AVX2: 32 per vpmaddubsw and
   vpmaddwd pair; an fp32 FMA does 16 or 8), then scaled by d * s.
3. `pick`: a logit differs from its approximation by at most the bound
   sum_b |d_b| ||q_b|| ||e_b|| + ||f_b|| ||h_b|| (Cauchy-Schwarz per block, e the row's
   rounding left out) plus a margin for fp32 rounding. Only outputs whose approximation
   lies within the bounds of the best one can be the argmax (a small share of the
   vocabulary). Those are computed exactly, with the GEMM that computes the full logits
   (`grid_gemm.gemm_kernel` of the LM head's kind, one row, the tiles of its pass), in
   the same order, and the first largest wins, as numpy's argmax picks.

A row whose hidden state is not finite, or has more than CANDIDATES outputs to check,
is not picked here (token -1): its logits must be computed in full.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types

from pagedinfer.kernels.cpu import grid_gemm
from pagedinfer.kernels.cpu.numba_support import (
    Job,
    avx2_madds,
    barrier,
    int_stack_array,
    intrinsic,
    jit,
    lanes_copy,
    lanes_max,
    lanes_mul,
    prefetch,
    run_jobs,
    stack_array,
)

LANES = grid_gemm.LANES
BLOCK = grid_gemm.GRID_BLOCK
# Whether this CPU multiplies bytes into 32-bit sums in one instruction (AVX-512 VNNI),
# or in two (AVX2's vpmaddubsw and vpmaddwd). With neither the approximation runs on
# plain integer vector code: correct, but no faster than the full LM head, so the CPU
# executor does not use it (`fast`).
_FEATURES = llvm.get_host_cpu_features()
VNNI = bool(_FEATURES.get("avx512vnni", False))
AVX2 = bool(_FEATURES.get("avx2", False))
# The largest row code: vpmaddubsw adds two byte products in 16 bits, which products of
# 8-bit codes (up to 255 * 127 each, offset) would overflow; 7-bit ones cannot.
ROW_CODE_MAX = 127 if VNNI else 63
# Rows per pass over a group of tiles, and tiles per group (the tiles left over past whole
# groups go one at a time): the shape that ran fastest of those tried, each pass keeping
# ROWS x TILES vectors of 32-bit sums (AVX2's 16 registers hold 6 x 1 of them).
ROWS = 6
TILES = 3 if VNNI else 1
# The most outputs a row may have to bound before its logits are computed in full: well
# above what the first, loose test lets through for real rows.
CANDIDATES = 16384
_HUGE = np.float32(1e18)  # a row with a larger value is left for its logits: no overflow
# The fp32 rounding of the exact logits (at most K * 2^-24 of sum |w h|, 3.4e-5 for
# K = 576) and of the approximation (about 40 roundings), as a share of ||h|| * max ||w||.
_ROUNDING = np.float32(2.0**-12)
_UP = np.float32(1.0 + 2.0**-10)  # room for the fp32 rounding of the bounds themselves


def fast() -> bool:
    """Whether picking the argmax here beats computing the logits on this CPU."""
    return VNNI or AVX2


@dataclass(frozen=True)
class ArgmaxWeights:
    """An LM head's 8-bit codes as the three phases read them ([tiles, ...] as in the
    grid), with the bounds of what they leave out."""

    codes: np.ndarray  # int32 [tiles, K / 4, 16]: the codes of inputs 4i .. 4i + 3 of a lane
    offsets: np.ndarray  # int32 [tiles, blocks, 16]: -(ROW_CODE_MAX + 1) * a block's code sum
    scales: np.ndarray  # fp32 [tiles, blocks, 16]: d
    # fp32 [vocab, 2 * blocks]: each output block's |d| * ||q|| (times the row's ||e||),
    # then its ||f|| (times the row's ||h||; all zero for an 8-bit grid), rounded up
    bounds: np.ndarray
    bounds_max: np.ndarray  # fp32 [2 * blocks]: the largest of each column of bounds
    norm_max: np.float32  # the largest ||w|| of an output (or of its d * q), rounded up
    grid: grid_gemm.GridWeight  # the exact logits' weight
    order: grid_gemm.SumOrder  # ... and order
    pool: ScratchPool = field(compare=False, repr=False)

    @classmethod
    def of(cls, grid: grid_gemm.GridWeight, order: grid_gemm.SumOrder) -> ArgmaxWeights:
        """From the LM head's weight (any kind) and the order its logits are summed in: an
        8-bit grid with fp16 scales and no offsets gives its own codes; any other weight
        is rounded to 8-bit codes per block of 32 inputs."""
        tiles, k = grid.out_features // LANES, grid.in_features
        blocks = k // BLOCK
        exact = (
            grid.kind == grid_gemm.SCALED8
            and grid.scales.dtype == np.uint16
            and not grid.scales[:, :, 1].view(np.float16).any()
        )
        if exact:
            q = grid.codes  # int8 [tiles, K, 16]
            d = grid.scales[:, :, 0, :].view(np.float16).astype(np.float32)  # [tiles, blocks, 16]
            left = np.zeros((grid.out_features, blocks), np.float32)
            norm_max = np.float64(0.0)
        else:
            q, d, left, norm_max = _rounded_to_codes(grid)
        codes = q.reshape(tiles, k // 4, 4, LANES).transpose(0, 1, 3, 2)
        by_block = (tiles, blocks, BLOCK, LANES)
        sums = q.reshape(by_block).sum(axis=2, dtype=np.int32)
        squares = np.square(q, dtype=np.int16).reshape(by_block).sum(axis=2, dtype=np.int32)
        norms = np.abs(d.astype(np.float64)) * np.sqrt(squares)
        coded = norms.transpose(0, 2, 1).reshape(grid.out_features, blocks)
        bounds = np.concatenate((_rounded_up(coded), left), axis=1)
        # ||d q_j||^2 = sum_b d^2 ||q_b||^2
        norm_max = max(norm_max, np.sqrt((norms**2).sum(axis=1)).max())
        return cls(
            codes=np.ascontiguousarray(codes).view(np.int32)[..., 0],
            offsets=-(ROW_CODE_MAX + 1) * sums,
            scales=np.ascontiguousarray(d, dtype=np.float32),
            bounds=bounds,
            bounds_max=np.ascontiguousarray(bounds.max(axis=0)),
            norm_max=_rounded_up(np.array([norm_max]))[0],
            grid=grid,
            order=order,
            pool=ScratchPool(k, grid.out_features),
        )


def _rounded_to_codes(
    grid: grid_gemm.GridWeight, chunk: int = 4096
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.float64]:
    """Any weight as 8-bit codes q (int8 [tiles, K, 16]) and fp32 scales d = max |w| / 127
    per block of 32 inputs ([tiles, blocks, 16]); the norm of each output block's w - d * q
    (fp32 [vocab, blocks], rounded up); and the largest ||w|| of an output. A chunk of
    outputs at a time, so that the fp64 copies stay small."""
    tiles, k = grid.out_features // LANES, grid.in_features
    blocks = k // BLOCK
    q = np.empty((tiles, k, LANES), np.int8)
    d = np.empty((tiles, blocks, LANES), np.float32)
    left = np.empty((grid.out_features, blocks), np.float32)
    norm_max = np.float64(0.0)
    step = chunk // LANES
    for t0 in range(0, tiles, step):
        t1 = min(t0 + step, tiles)
        part = grid_gemm.GridWeight(
            grid.kind, (t1 - t0) * LANES, k, grid.codes[t0:t1], grid.scales[t0:t1]
        )
        w = part.dense().numpy().astype(np.float64)  # [outputs, K]
        w = w.reshape(-1, blocks, BLOCK)
        scale = (np.abs(w).max(axis=2) / 127).astype(np.float32)  # [outputs, blocks]
        wide = scale.astype(np.float64)[:, :, None]
        codes = np.clip(
            np.rint(np.divide(w, wide, out=np.zeros_like(w), where=wide > 0)), -127, 127
        )
        rest = np.sqrt(np.square(w - wide * codes).sum(axis=2))
        left[t0 * LANES : t1 * LANES] = _rounded_up(rest * (1.0 + 2.0**-20))
        norm_max = max(norm_max, np.sqrt(np.square(w).sum(axis=(1, 2))).max())
        n = t1 - t0
        q[t0:t1] = codes.reshape(n, LANES, k).transpose(0, 2, 1)
        d[t0:t1] = scale.reshape(n, LANES, blocks).transpose(0, 2, 1)
    return q, d, left, norm_max


def _rounded_up(x: np.ndarray) -> np.ndarray:
    """x (float64) as fp32, never below it."""
    single = x.astype(np.float32)
    return np.where(single < x, np.nextafter(single, np.float32(np.inf)), single)


@dataclass
class Scratch:
    """What the phases pass on, for `rows` rows and `workers` workers."""

    codes: np.ndarray  # uint8 [rows, K]: the rows' codes, offset by ROW_CODE_MAX + 1
    words: np.ndarray  # int32 [rows, K / 4]: the same bytes, 4 to a word
    scales: np.ndarray  # fp32 [rows, blocks]: s
    errors: np.ndarray  # fp32 [rows, 2 * blocks]: ||e|| of each block, then ||h||, rounded up
    margins: np.ndarray  # fp32 [rows]: the fp32 rounding's share; < 0: the row is not picked
    approx: np.ndarray  # fp32 [rows, tiles, 16]
    maxima: np.ndarray  # fp32 [workers, rows, 16]: each worker's largest approximations
    found: np.ndarray  # int64 [workers, CANDIDATES]: a worker's candidates
    found_bounds: np.ndarray  # fp32 [workers, CANDIDATES]
    exact: np.ndarray  # fp32 [workers, 1, 4, 16]: one group's exact logits

    @classmethod
    def of(
        cls, rows: int, hidden: int, vocab: int, workers: int, candidates: int = CANDIDATES
    ) -> Scratch:
        codes = np.empty((rows, hidden), np.uint8)
        return cls(
            codes=codes,
            words=codes.view(np.int32),
            scales=np.empty((rows, hidden // BLOCK), np.float32),
            errors=np.empty((rows, 2 * (hidden // BLOCK)), np.float32),
            margins=np.empty(rows, np.float32),
            approx=np.empty((rows, vocab // LANES, LANES), np.float32),
            maxima=np.empty((workers, rows, LANES), np.float32),
            found=np.empty((workers, candidates), np.int64),
            found_bounds=np.empty((workers, candidates), np.float32),
            exact=np.empty((workers, 1, grid_gemm.TILE_GROUP, LANES), np.float32),
        )

    def rows(self, rows: int) -> Scratch:
        """The first `rows` rows of this scratch (views)."""
        return Scratch(
            codes=self.codes[:rows],
            words=self.words[:rows],
            scales=self.scales[:rows],
            errors=self.errors[:rows],
            margins=self.margins[:rows],
            approx=self.approx[:rows],
            maxima=self.maxima,  # whole: a worker's share stays contiguous
            found=self.found,
            found_bounds=self.found_bounds,
            exact=self.exact,
        )

    def args(self) -> tuple[np.ndarray, ...]:
        return (
            self.codes,
            self.words,
            self.scales,
            self.errors,
            self.margins,
            self.approx,
            self.maxima,
            self.found,
            self.found_bounds,
            self.exact,
        )


class ScratchPool:
    """One growing scratch per thread, reused from step to step: a fresh one of a few MB
    would pay for its page faults in every step."""

    def __init__(self, hidden: int, vocab: int) -> None:
        self.hidden, self.vocab = hidden, vocab
        self._local = threading.local()

    def get(self, rows: int, workers: int) -> Scratch:
        held: Scratch | None = getattr(self._local, "scratch", None)
        if held is None or held.codes.shape[0] < rows or held.found.shape[0] < workers:
            size = max(rows, 2 * held.codes.shape[0] if held is not None else rows)
            held = Scratch.of(size, self.hidden, self.vocab, workers)
            self._local.scratch = held
        return held.rows(rows)


def lm_head_argmax(
    hidden: torch.Tensor, weights: ArgmaxWeights, scratch: Scratch | None = None
) -> torch.Tensor:
    """The argmax of each row's logits hidden @ W.T (hidden: fp32 [S, K], final-normed)
    on the worker threads: int64 [S], -1 for a row whose logits must be computed in full.
    scratch: for S rows and the threads (else the weights' pool gives one)."""
    if hidden.dim() != 2 or hidden.shape[1] != weights.grid.in_features:
        raise ValueError(
            f"lm_head_argmax: hidden must be [S, {weights.grid.in_features}], "
            f"got {tuple(hidden.shape)}"
        )
    rows = hidden.shape[0]
    tokens = np.empty(rows, np.int64)
    if rows:
        workers = torch.get_num_threads()
        if scratch is None:
            scratch = weights.pool.get(rows, workers)
        kernel = argmax_kernel(weights.grid.in_features, weights.order, weights.grid.kind)
        sync = np.zeros(2, np.int64)
        x = np.ascontiguousarray(hidden.detach().numpy(), dtype=np.float32)
        args = (x, *weights_args(weights), *scratch.args(), tokens, sync)
        run_jobs([Job(kernel, args, workers)])
    return torch.from_numpy(tokens)


def weights_args(weights: ArgmaxWeights) -> tuple[Any, ...]:
    return (
        weights.codes,
        weights.offsets,
        weights.scales,
        weights.bounds,
        weights.bounds_max,
        weights.norm_max,
        weights.grid.codes,
        weights.grid.scales,
    )


def no_args(codes: np.ndarray, scales: np.ndarray) -> tuple[Any, ...]:
    """`weights_args` and `Scratch.args` of no argmax weights, for a step with no greedy
    rows over an LM head of these codes and scales (`grid_gemm.GridWeight`)."""
    f32, i32 = np.float32, np.int32
    return (
        np.zeros((0, 0, LANES), i32),
        np.zeros((0, 0, LANES), i32),
        np.zeros((0, 0, LANES), f32),
        np.zeros((0, 0), f32),
        np.zeros(0, f32),
        f32(0),
        np.zeros((0,) * codes.ndim, codes.dtype),
        np.zeros((0,) * scales.ndim, scales.dtype),
        *Scratch.of(0, 0, 0, 0).args(),
    )


@functools.cache
def argmax_kernel(in_features: int, order: grid_gemm.SumOrder, kind: str) -> Callable[..., None]:
    """argmax(x, *weights_args, *Scratch.args, tokens, sync, worker, workers): the three
    phases over every row of x, the workers meeting at a barrier between them."""
    quantize, approximate, pick = phase_kernels(in_features, order, kind)

    @jit(nogil=True, error_model="numpy")
    def argmax(
        x: np.ndarray,
        codes: np.ndarray,
        offsets: np.ndarray,
        scales: np.ndarray,
        bounds: np.ndarray,
        bounds_max: np.ndarray,
        norm_max: np.float32,
        grid_codes: np.ndarray,
        grid_scales: np.ndarray,
        row_codes: np.ndarray,
        words: np.ndarray,
        row_scales: np.ndarray,
        errors: np.ndarray,
        margins: np.ndarray,
        approx: np.ndarray,
        maxima: np.ndarray,
        found: np.ndarray,
        found_bounds: np.ndarray,
        exact: np.ndarray,
        tokens: np.ndarray,
        sync: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        quantize(x, norm_max, row_codes, row_scales, errors, margins, worker, workers)
        passed = barrier(sync, workers, 0)
        approximate(
            words, row_scales, codes, offsets, scales, approx, maxima[worker], worker, workers
        )
        passed = barrier(sync, workers, passed)
        pick(
            x,
            approx,
            maxima,
            errors,
            margins,
            bounds,
            bounds_max,
            grid_codes,
            grid_scales,
            found[worker],
            found_bounds[worker],
            exact[worker],
            tokens,
            worker,
            workers,
        )

    return argmax


@functools.cache
def phase_kernels(
    in_features: int, order: grid_gemm.SumOrder, kind: str
) -> tuple[Callable[..., Any], Callable[..., None], Callable[..., None]]:
    """The three phases for rows of in_features inputs whose exact logits are summed in
    `order` over an LM head of `kind`, each taking (..., worker, workers) and doing its
    worker's share: quantize and pick a share of the rows, approximate a share of the
    tile groups."""
    k, blocks = in_features, in_features // BLOCK
    exact_group = grid_gemm.gemm_kernel(kind, 1, k, order.ends, order.fused)
    # Plain Python numbers: the kernels' disk-cache keys pickle their closures.
    code_max, offset = float(ROW_CODE_MAX), ROW_CODE_MAX + 1
    # A candidate's exact logit comes with those of the tiles one pass takes: one tile
    # where a pass takes one (AVX2), else a group of TILE_GROUP.
    exact_tiles = grid_gemm.tiles_per_group(1)
    group_outputs = exact_tiles * LANES
    by_rows = [_approx_rows(rows, k) for rows in range(1, ROWS + 1)]
    a1, a2, a3, a4, a5, a6 = by_rows
    single = _approx_rows(1, k, tiles=1)  # a tile left over, a row at a time

    @jit(nogil=True, error_model="numpy")
    def quantize(
        x: np.ndarray,
        norm_max: np.float32,
        row_codes: np.ndarray,
        row_scales: np.ndarray,
        errors: np.ndarray,
        margins: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        rows = x.shape[0]
        for r in range(rows * worker // workers, rows * (worker + 1) // workers):
            square = 0.0  # float64: ||h||^2
            finite = True
            for i in range(k):
                v = x[r, i]
                if not abs(v) <= _HUGE:  # NaN too
                    finite = False
                square += np.float64(v) * np.float64(v)
            if not finite:
                margins[r] = -1.0
                continue
            for b in range(blocks):
                largest = np.float32(0.0)
                for i in range(b * BLOCK, (b + 1) * BLOCK):
                    largest = max(largest, abs(x[r, i]))
                s = largest / np.float32(code_max)
                left = 0.0  # float64: ||e||^2 of the block
                whole = 0.0  # float64: ||h||^2 of the block
                for i in range(b * BLOCK, (b + 1) * BLOCK):
                    q = 0.0
                    if s > 0:
                        q = min(max(np.rint(x[r, i] / s), -code_max), code_max)
                    e = np.float64(x[r, i]) - np.float64(s) * q
                    left += e * e
                    whole += np.float64(x[r, i]) * np.float64(x[r, i])
                    row_codes[r, i] = np.uint8(np.int64(q) + offset)
                row_scales[r, b] = s
                errors[r, b] = np.float32(np.sqrt(left) * (1.0 + 2.0**-20))
                errors[r, blocks + b] = np.float32(np.sqrt(whole) * (1.0 + 2.0**-20))
            margins[r] = np.float32(np.sqrt(square) * np.float64(norm_max) * _ROUNDING * _UP)

    @jit(nogil=True, error_model="numpy")
    def approximate(
        words: np.ndarray,
        row_scales: np.ndarray,
        codes: np.ndarray,
        offsets: np.ndarray,
        scales: np.ndarray,
        approx: np.ndarray,
        maxima: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        rows = words.shape[0]
        for r in range(rows):
            lanes_copy(maxima[r], -np.inf, LANES)
        groups = codes.shape[0] // TILES
        # A worker's groups lie side by side: one stream for the hardware prefetcher.
        first, end = groups * worker // workers, groups * (worker + 1) // workers
        for group in range(first, end):
            t0 = group * TILES
            # Each pass asks for the worker's next group, so that its codes arrive while
            # this one computes; a single row computes too little to hide that wait.
            ahead = (group + 1) * TILES if group + 1 < end and rows > 1 else t0
            r0 = 0
            while r0 + ROWS <= rows:
                a6(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
                r0 += ROWS
            left = rows - r0
            if left == 5:
                a5(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
            elif left == 4:
                a4(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
            elif left == 3:
                a3(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
            elif left == 2:
                a2(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
            elif left == 1:
                a1(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, ahead)
        whole = groups * TILES
        for t0 in range(whole + worker, codes.shape[0], workers):
            for r0 in range(rows):
                single(words, row_scales, codes, offsets, scales, approx, maxima, r0, t0, t0)

    @jit(nogil=True, error_model="numpy")
    def pick(
        x: np.ndarray,
        approx: np.ndarray,
        maxima: np.ndarray,
        errors: np.ndarray,
        margins: np.ndarray,
        bounds: np.ndarray,
        bounds_max: np.ndarray,
        grid_codes: np.ndarray,
        grid_scales: np.ndarray,
        found: np.ndarray,
        found_bounds: np.ndarray,
        exact: np.ndarray,
        tokens: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        rows = x.shape[0]
        vocab = approx.shape[1] * LANES
        for r in range(rows * worker // workers, rows * (worker + 1) // workers):
            tokens[r] = -1
            if margins[r] < 0:
                continue
            logits = approx[r].reshape(vocab)
            best = maxima[0, r, 0]
            for w in range(workers):  # (a larger scratch has stale rows past them)
                for lane in range(LANES):
                    best = max(best, maxima[w, r, lane])
            # Every output's bound is at most `widest`: an output more than twice that
            # below the best approximation is below the best one's logit.
            widest = np.float32(0.0)
            for b in range(2 * blocks):
                widest += bounds_max[b] * errors[r, b]
            widest = widest * _UP + margins[r]
            floor = best - 2 * widest
            count = 0
            for t in range(approx.shape[1]):
                mask = lanes_at_least(approx[r, t], floor)
                while mask and count >= 0:
                    if count == found.shape[0]:
                        count = -1
                        break
                    lane = trailing_zeros(mask)
                    found[count] = t * LANES + lane
                    count += 1
                    mask &= mask - 1
                if count < 0:
                    break
            if count < 0:
                continue
            # The largest logit is at least `low`; an output can reach it only if its
            # approximation plus its own bound does.
            low = -np.inf
            for c in range(count):
                j = found[c]
                bound = np.float32(0.0)
                for b in range(2 * blocks):
                    bound += bounds[j, b] * errors[r, b]
                bound = bound * _UP + margins[r]
                found_bounds[c] = bound
                low = max(low, logits[j] - bound)
            token, top, group = -1, np.float32(0.0), -1
            for c in range(count):  # in output order: the first largest wins
                j = found[c]
                if logits[j] + found_bounds[c] < low:
                    continue
                if j // group_outputs != group:
                    group = j // group_outputs
                    t0 = group * exact_tiles
                    exact_group(
                        x[r : r + 1],
                        0,
                        grid_codes[t0 : t0 + exact_tiles],
                        grid_scales[t0 : t0 + exact_tiles],
                        exact,
                        0,
                        exact_tiles,
                        False,
                        -1,
                        0,
                        1,
                    )
                value = exact[0, (j % group_outputs) // LANES, j % LANES]
                if token < 0 or value > top:
                    token, top = j, value
            tokens[r] = token

    return quantize, approximate, pick


def _approx_rows(rows: int, in_features: int, tiles: int = TILES) -> Callable[..., None]:
    """approx(words, row_scales, codes, offsets, scales, out, maxima, r0, t0, ahead): the
    approximate logits of rows r0 .. r0 + rows - 1 for tiles t0 .. t0 + tiles - 1: per
    block, the 32-bit sum of code products (the row's codes offset by 128, hence the
    block's offset), times d * s, summed over the blocks in fp32; maxima[r]: the largest
    so far in each lane. Each block also prefetches the same block of tiles ahead ..
    ahead + tiles - 1."""
    words_per_block = BLOCK // 4
    words_per_tile = in_features // 4
    blocks = in_features // BLOCK

    @jit(nogil=True, error_model="numpy", inline="always")
    def approx(
        words: np.ndarray,
        row_scales: np.ndarray,
        codes: np.ndarray,
        offsets: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        maxima: np.ndarray,
        r0: int,
        t0: int,
        ahead: int,
    ) -> None:
        total = stack_array((rows, tiles, LANES))
        sums = int_stack_array((rows, tiles, LANES))
        scale = stack_array((LANES,))
        for r in range(rows):
            for t in range(tiles):
                lanes_copy(total[r, t], np.float32(0.0), LANES)
        for b in range(blocks):
            for r in range(rows):
                for t in range(tiles):
                    int_lanes_copy(sums[r, t], offsets[t0 + t, b])
            for t in range(tiles):
                for i in range(b * words_per_block, (b + 1) * words_per_block):
                    prefetch(codes, ((ahead + t) * words_per_tile + i) * LANES)
            for i in range(b * words_per_block, (b + 1) * words_per_block):
                for r in range(rows):
                    word = words[r0 + r, i]
                    for t in range(tiles):
                        dot_bytes(sums[r, t], word, codes[t0 + t, i])
            for r in range(rows):
                s = row_scales[r0 + r, b]
                for t in range(tiles):
                    lanes_mul(scale, scales[t0 + t, b], s, LANES)
                    fma_ints(total[r, t], sums[r, t], scale)
        for r in range(rows):
            for t in range(tiles):
                lanes_copy(out[r0 + r, t0 + t], total[r, t], LANES)
                lanes_max(maxima[r0 + r], total[r, t], LANES)

    return approx


# -- integer lane ops ---------------------------------------------------------------------


def _int_lanes(t: Any) -> bool:
    return isinstance(t, types.Array) and t.dtype == types.int32 and t.ndim == 1 and t.layout == "C"


def _lanes_pointer(context: Any, builder: Any, array_type: Any, array: Any, element: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(data, ir.VectorType(element, LANES).as_pointer())


@intrinsic
def int_lanes_copy(typingctx: Any, y: Any, x: Any) -> Any:
    """y[:16] = x[:16] (int32 lanes)."""
    if not (_int_lanes(y) and _int_lanes(x)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        source = _lanes_pointer(context, builder, signature.args[1], args[1], i32)
        target = _lanes_pointer(context, builder, signature.args[0], args[0], i32)
        builder.store(builder.load(source, align=4), target, align=4)
        return context.get_dummy_value()

    return types.void(y, x), codegen


@intrinsic
def dot_bytes(typingctx: Any, sums: Any, word: Any, codes: Any) -> Any:
    """sums[l] += sum over i < 4 of byte i of `word` (unsigned) times byte i of codes[l]
    (signed), for the 16 int32 lanes l: AVX-512 VNNI's vpdpbusd where the CPU has it; on
    AVX2, vpmaddubsw (byte pairs into 16 bits: exact for the words' bytes of at most
    127, `ROW_CODE_MAX`) then vpmaddwd by ones."""
    if not (_int_lanes(sums) and isinstance(word, types.Integer) and _int_lanes(codes)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        vector = ir.VectorType(i32, LANES)
        target = _lanes_pointer(context, builder, signature.args[0], args[0], i32)
        acc = builder.load(target, align=4)
        one = context.cast(builder, args[1], signature.args[1], types.int32)
        lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), one, i32(0))
        spread = builder.shuffle_vector(
            lane0, ir.Constant(vector, ir.Undefined), ir.Constant(vector, [0] * LANES)
        )
        weights = builder.load(
            _lanes_pointer(context, builder, signature.args[2], args[2], i32), align=4
        )
        if VNNI:
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(vector, [vector] * 3),
                "llvm.x86.avx512.vpdpbusd.512",
            )
            result = builder.call(function, [acc, spread, weights])
        elif AVX2:
            result = _madd_bytes_avx2(builder, acc, spread, weights)
        else:
            bytes_type = ir.VectorType(ir.IntType(8), 4 * LANES)
            wide = ir.VectorType(i32, 4 * LANES)
            products = builder.mul(
                builder.zext(builder.bitcast(spread, bytes_type), wide),
                builder.sext(builder.bitcast(weights, bytes_type), wide),
            )
            result = acc
            for i in range(4):
                part = ir.Constant(vector, list(range(i, 4 * LANES, 4)))
                result = builder.add(result, builder.shuffle_vector(products, products, part))
        builder.store(result, target, align=4)
        return context.get_dummy_value()

    return types.void(sums, word, codes), codegen


def _madd_bytes_avx2(builder: Any, acc: Any, spread: Any, weights: Any) -> Any:
    """`dot_bytes` on 16 int32 lanes as two 256-bit halves of AVX2 code."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    half_words = ir.VectorType(i16, LANES)
    pairs, quads = avx2_madds(builder)
    ones = ir.Constant(half_words, [1] * LANES)
    row = builder.bitcast(spread, ir.VectorType(i8, 4 * LANES))
    codes = builder.bitcast(weights, ir.VectorType(i8, 4 * LANES))
    halves = []
    for h in range(2):
        part = ir.Constant(
            ir.VectorType(i32, 2 * LANES), list(range(h * 2 * LANES, (h + 1) * 2 * LANES))
        )
        products = builder.call(
            pairs,
            [builder.shuffle_vector(row, row, part), builder.shuffle_vector(codes, codes, part)],
        )
        halves.append(builder.call(quads, [products, ones]))
    whole = builder.shuffle_vector(
        halves[0], halves[1], ir.Constant(ir.VectorType(i32, LANES), list(range(LANES)))
    )
    return builder.add(acc, whole)


@intrinsic
def fma_ints(typingctx: Any, total: Any, sums: Any, scale: Any) -> Any:
    """total[:16] = fp32(sums[:16]) * scale[:16] + total[:16], rounded once."""
    if not (_int_lanes(sums)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        vector = ir.VectorType(f32, LANES)
        total_at = _lanes_pointer(context, builder, signature.args[0], args[0], f32)
        ints = builder.load(
            _lanes_pointer(context, builder, signature.args[1], args[1], ir.IntType(32)), align=4
        )
        scale = builder.load(
            _lanes_pointer(context, builder, signature.args[2], args[2], f32), align=4
        )
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{LANES}f32"
        )
        value = builder.call(
            function, [builder.sitofp(ints, vector), scale, builder.load(total_at, align=4)]
        )
        builder.store(value, total_at, align=4)
        return context.get_dummy_value()

    return types.void(total, sums, scale), codegen


@intrinsic
def lanes_at_least(typingctx: Any, x: Any, floor: Any) -> Any:
    """The lanes l of x[:16] (fp32) with x[l] >= floor, as the bits 1 << l of an int64."""
    if not (
        isinstance(x, types.Array) and x.dtype == types.float32 and isinstance(floor, types.Float)
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        vector = ir.VectorType(f32, LANES)
        values = builder.load(
            _lanes_pointer(context, builder, signature.args[0], args[0], f32), align=4
        )
        one = context.cast(builder, args[1], signature.args[1], types.float32)
        lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), one, ir.IntType(32)(0))
        spread = builder.shuffle_vector(
            lane0,
            ir.Constant(vector, ir.Undefined),
            ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES),
        )
        bits = builder.bitcast(builder.fcmp_ordered(">=", values, spread), ir.IntType(LANES))
        return builder.zext(bits, ir.IntType(64))

    return types.int64(x, floor), codegen


@intrinsic
def trailing_zeros(typingctx: Any, x: Any) -> Any:
    """The number of zero bits below the lowest set bit of x (an int64, not 0)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        value = context.cast(builder, args[0], signature.args[0], types.int64)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64"
        )
        return builder.call(function, [value, ir.IntType(1)(1)])

    return types.int64(x), codegen
