"""Paged attention for CPU of runs of new tokens of one sequence, compiled with numba: a
run per task, each K/V block read once for all of its tokens.

A decode verifying a draft of k tokens brings k + 1 new tokens of one sequence, token i
seeing the context up to and including itself; a prompt chunk brings many more, taken
here in runs. `paged_decode` would serve them as k + 1
rows that each walk the same blocks and compute every score as a dot product ending in a
horizontal sum. This kernel serves up to `rows_per_run` of them from each block it loads:

- The run's query vectors (its tokens x the query heads of one KV head) lie side by side
  in the 16 lanes of one vector: lane r * group + i is head i of the group for token r
  (SmolLM2, 9 heads on 3 KV heads: 5 tokens x 3 heads, one lane spare).
- Scores, 2 positions at a time: vector FMAs of K[t, j] (broadcast) and the lanes' query
  values at dim j accumulate in 16 registers; no horizontal sums.
- Softmax online across blocks, elementwise over the lanes: a running max, rescale and
  denominator per lane, one vectorised exp per block for probabilities and rescales.
- Value sums, 8 head dims at a time: acc[j, lanes] += V[t, j] (broadcast) * p[t, lanes].
The accumulators are stack tiles written only through `numba_support`'s lane ops, so they
live in vector registers (zmm on AVX-512).

Each lane does `paged_decode`'s operations in `paged_decode`'s order (the same score parts,
the same halving sums, each step rounded once), so every token gets the bits a decode of
its own would: speculative decoding gives exactly what decoding one token at a time does.

Token r of a run sees positions below seq_len + r (seq_len: its first token's). Only
positions below the last token's length are read, so a stale slot (possibly another
request's NaN) never is. In the block that holds the run's own tokens, a lane's scores
past its length become -inf and its probabilities exactly 0, and its value sums skip
those positions (a later token's NaN reaches only the tokens that see it); a block past
all of a lane's positions leaves it as it was, bit for bit.

A sliding window W (0: none) hides from token r the positions before its own window,
length + r - W: their scores are -inf and probabilities exactly 0, as `paged_decode`
gives them; a block wholly before a lane's window leaves that lane's state as it began
(a decode never reads that block), and blocks before the first token's window are never
read.

Every lane is computed whether a token fills it or not: a task costs about the same per
position with 1 token as with a full run. `torch_ops.plan_attention` sends only runs of
at least half `rows_per_run` tokens here, the rest to `paged_decode`, a row per token.

Importing this module imports numba: `torch_ops` and the CPU executor import it only where
numba is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedinfer.kernels.cpu.numba_support import (
    FASTMATH,
    Job,
    attention_job,
    exp_into,
    fp32_positions,
    jit,
    lanes_add,
    lanes_copy,
    lanes_div,
    lanes_fma,
    lanes_fma_where,
    lanes_max,
    lanes_mul,
    prefetch,
    run_jobs,
    snake_task,
    stack_array,
)
from pagedinfer.kernels.cpu.paged_decode import DOT_PARTS, sum_slots

LANES = 16  # query vectors per task and KV head: one 512-bit vector of fp32
# Register tiles: the DOT_PARTS partial scores of 2 positions (16 accumulators), the
# value sums of 8 head dims.
SCORE_POSITIONS = 2
VALUE_DIMS = 8


def rows_per_run(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """How many new tokens of one sequence one task serves at most: the tokens whose query
    heads of one KV head fit in the lanes. 0 where that is below 2 (nothing to share) or
    head_dim is not a multiple of 8 (the tiles')."""
    rows = LANES // (num_heads // num_kv_heads)
    return rows if rows >= 2 and head_dim % max(DOT_PARTS, VALUE_DIMS) == 0 else 0


def verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: np.ndarray,
    counts: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """Attention of runs of consecutive new tokens of one sequence, into `out` (window:
    the sliding window, 0 for none).

    query, out: [num_tokens, num_heads, head_dim] fp32 (strided views allowed); k_cache,
    v_cache contiguous, fp32 or bf16 (`paged_decode.supports` says which tensors
    qualify). Run i is query rows rows[i] .. rows[i] + counts[i] - 1, token r of it
    seeing positions below seq_lens[i] + r through block_tables[i]; it writes those rows
    of out and no others.
    rows: int64 [n]; counts: int32 [n], 1 to `rows_per_run`; block_tables: int32
    [n, max_blocks]; seq_lens: int32 [n], at least 1: numpy arrays built once per batch
    and shared by every layer. Nothing is bounds-checked: the rows must lie in query and
    the block ids the runs need in the cache.
    """
    job = verify_job(
        query, k_cache, v_cache, rows, counts, block_tables, seq_lens, scale, out, window
    )
    run_jobs([job])


def verify_job(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: np.ndarray,
    counts: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> Job:
    """`verify_attention`'s kernel call, for `numba_support.run_jobs` alongside others."""
    tasks = (rows, counts, block_tables, seq_lens)
    return attention_job(compiled_kernel, query, k_cache, v_cache, tasks, scale, out, window)


@functools.cache
def compiled_kernel(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., Any]:
    """The kernel for one model shape (compiled, or loaded from the cache, on first call)."""
    bs, nh, nkv, d = block_size, num_heads, num_kv_heads, head_dim
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim  # one position's K (or V) row
    padded = (bs + SCORE_POSITIONS - 1) // SCORE_POSITIONS * SCORE_POSITIONS  # whole tiles
    slots = sum_slots(block_size)
    rows_needed = max(bs + 1, slots)
    halvings = tuple(DOT_PARTS >> i for i in range(1, DOT_PARTS.bit_length()))  # 4, 2, 1

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def block_scores(kb: np.ndarray, kh: int, n: int, qt: np.ndarray, scores: np.ndarray) -> None:
        """scores[t] = sum over j of kb[t, kh, j] * qt[j] for t < n (qt: [d, LANES]), as
        `paged_decode` sums. Rows n to the tile's end repeat row n - 1: no slot past n is read."""
        tile = stack_array((SCORE_POSITIONS, DOT_PARTS, LANES))
        for t0 in range(0, n, SCORE_POSITIONS):
            for i in range(SCORE_POSITIONS):
                for k in range(DOT_PARTS):
                    lanes_copy(tile[i, k], 0.0, LANES)
            for j0 in range(0, d, DOT_PARTS):
                for k in range(DOT_PARTS):
                    q_j = qt[j0 + k]
                    for i in range(SCORE_POSITIONS):
                        lanes_fma(tile[i, k], q_j, kb[min(t0 + i, n - 1), kh, j0 + k], LANES)
            for i in range(SCORE_POSITIONS):
                for half in halvings:
                    for k in range(half):
                        lanes_add(tile[i, k], tile[i, k + half], LANES)
                lanes_copy(scores[t0 + i], tile[i, 0], LANES)

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def add_values(
        vb: np.ndarray,
        kh: int,
        n: int,
        n_all: int,
        probs: np.ndarray,
        rescale: np.ndarray,
        acc: np.ndarray,
    ) -> None:
        """acc[j] = acc[j] * rescale, then + vb[t, kh, j] * probs[t] for t < n in order;
        positions from n_all on are masked in some lanes (probability 0), which never
        read them."""
        tile = stack_array((VALUE_DIMS, LANES))
        for j0 in range(0, d, VALUE_DIMS):
            for i in range(VALUE_DIMS):
                lanes_mul(tile[i], acc[j0 + i], rescale, LANES)
            for t in range(n_all):
                p_t = probs[t]
                for i in range(VALUE_DIMS):
                    lanes_fma(tile[i], p_t, vb[t, kh, j0 + i], LANES)
            for t in range(n_all, n):
                p_t = probs[t]
                for i in range(VALUE_DIMS):
                    lanes_fma_where(tile[i], p_t, vb[t, kh, j0 + i], LANES)
            for i in range(VALUE_DIMS):
                lanes_copy(acc[j0 + i], tile[i], LANES)

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def kernel(
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        rows: np.ndarray,
        counts: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        scale: np.float32,
        window: int,
        out: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        # Scratch on the stack (about 32 * num_kv_heads * head_dim floats: 27 KB for
        # SmolLM2): LLVM knows that no other array aliases it, and it is 64-byte aligned,
        # each 16-lane row one cache line.
        qt = stack_array((nkv, d, LANES))  # scaled queries, lanes last
        acc = stack_array((nkv, d, LANES))
        m, den = stack_array((nkv, LANES)), stack_array((nkv, LANES))
        top, rescale = stack_array((LANES,)), stack_array((LANES,))
        scores = stack_array((padded, LANES))
        # Rows below n: scores minus the new max, then probabilities (0 up to slots);
        # row n: old max minus new, then the rescale factor. One exp for both.
        shifted = stack_array((rows_needed, LANES))
        probs = stack_array((rows_needed, LANES))
        shifted_flat = shifted.reshape(rows_needed * LANES)
        probs_flat = probs.reshape(rows_needed * LANES)
        bits = np.empty(rows_needed * LANES, dtype=np.int32)
        # A bf16 cache's block, widened (`fp32_positions`); unused with an fp32 cache.
        k_wide, v_wide = stack_array((bs, nkv, d)), stack_array((bs, nkv, d))
        per_line = 64 // k_cache.itemsize  # cache elements in one 64-byte line
        length_of = np.empty(LANES, dtype=np.int64)  # lane -> its token's length
        lo_of = np.zeros(LANES, dtype=np.int64)  # lane -> its window's first position
        num_runs = rows.shape[0]
        for turn in range((num_runs + workers - 1) // workers):
            run = snake_task(turn, worker, workers)
            if run >= num_runs:
                continue
            following = snake_task(turn + 1, worker, workers)  # this worker's next task
            first, count, length = rows[run], counts[run], seq_lens[run]
            for kh in range(nkv):
                for j in range(d):
                    lanes_copy(qt[kh, j], 0.0, LANES)
                    lanes_copy(acc[kh, j], 0.0, LANES)
                lanes_copy(m[kh], -np.inf, LANES)
                lanes_copy(den[kh], 0.0, LANES)
            for r in range(count):
                for h in range(nh):
                    lane = r * group + h % group
                    for j in range(d):
                        qt[h // group, j, lane] = q[first + r, h, j] * scale
            for lane in range(LANES):  # spare lanes: the last token's (never written out)
                length_of[lane] = length + min(lane // group, count - 1)
                if window > 0:
                    lo_of[lane] = max(0, length_of[lane] - window)
            lo_last = lo_of[LANES - 1]  # the latest window's start: the last token's
            following_block = 0
            if window > 0 and following < num_runs:
                following_block = max(0, seq_lens[following] - window) // bs
            end = length + count - 1
            num_blocks = (end + bs - 1) // bs
            for b in range(lo_of[0] // bs, num_blocks):
                block = block_tables[run, b]
                start = b * bs
                n = min(bs, end - start)
                # Some lane's window starts inside or after this block; some lane's after it.
                windowed = start < lo_last
                before = start + bs <= lo_last
                # The block read next (this run's, else the first of the next run this
                # worker takes) is fetched while this one is computed, a KV head at a time.
                upcoming = block
                if b + 1 < num_blocks:
                    upcoming = block_tables[run, b + 1]
                elif following < num_runs:
                    upcoming = block_tables[following, following_block]
                k_next, v_next = k_cache[upcoming], v_cache[upcoming]
                kb = fp32_positions(k_cache[block], k_wide, n)
                vb = fp32_positions(v_cache[block], v_wide, n)
                # Positions every lane sees; the rest are the run's own later tokens.
                n_all = max(0, min(n, length - start))
                masked = n_all < n or windowed
                for kh in range(nkv):
                    for t in range(bs):
                        row = t * width + kh * d
                        for line in range(row, row + d, per_line):
                            prefetch(k_next, line)
                            prefetch(v_next, line)
                    block_scores(kb, kh, n, qt[kh], scores)
                    if masked:
                        for t in range(n):
                            for lane in range(LANES):
                                p = start + t
                                if p >= length_of[lane] or p < lo_of[lane]:
                                    scores[t, lane] = -np.inf
                    lanes_copy(top, m[kh], LANES)
                    for t in range(n):
                        lanes_max(top, scores[t], LANES)
                    if before:  # a lane that sees nothing yet: 0, not -inf - -inf = NaN
                        for lane in range(LANES):
                            if start + bs <= lo_of[lane]:
                                top[lane] = 0.0
                    for t in range(n):  # score - top, rounded once
                        lanes_copy(shifted[t], scores[t], LANES)
                        lanes_fma(shifted[t], top, -1.0, LANES)
                    # 0 on the first block (m = -inf; exp_into gives 1.6e-38, times 0)
                    lanes_copy(shifted[n], m[kh], LANES)
                    lanes_fma(shifted[n], top, -1.0, LANES)
                    size = (n + 1) * LANES
                    exp_into(shifted_flat[:size], probs_flat[:size], bits)
                    lanes_copy(rescale, probs[n], LANES)
                    if masked:  # exp_into gives 1.6e-38 for -inf: an exact 0 instead
                        for t in range(n):
                            for lane in range(LANES):
                                p = start + t
                                if p >= length_of[lane] or p < lo_of[lane]:
                                    probs[t, lane] = 0.0
                    for t in range(n, slots):
                        lanes_copy(probs[t], 0.0, LANES)
                    add_values(vb, kh, n, n_all, probs, rescale, acc[kh])
                    # den * rescale + the probabilities summed by halving over the slots
                    half = slots // 2
                    while half > 0:
                        for t in range(half):
                            lanes_add(probs[t], probs[t + half], LANES)
                        half //= 2
                    lanes_mul(den[kh], den[kh], rescale, LANES)
                    lanes_add(den[kh], probs[0], LANES)
                    lanes_copy(m[kh], top, LANES)
                    if before:  # as a decode: nothing read before the lane's window
                        for lane in range(LANES):
                            if start + bs <= lo_of[lane]:
                                m[kh, lane] = -np.inf
                                den[kh, lane] = 0.0
                                for j in range(d):
                                    acc[kh, j, lane] = 0.0
            for kh in range(nkv):
                for j in range(d):
                    lanes_div(acc[kh, j], acc[kh, j], den[kh], LANES)
            for r in range(count):
                for h in range(nh):
                    kh, lane = h // group, r * group + h % group
                    for j in range(d):
                        out[first + r, h, j] = acc[kh, j, lane]

    return kernel
