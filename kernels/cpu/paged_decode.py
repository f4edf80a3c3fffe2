"""Paged decode attention for CPU, compiled with numba: K/V are read in place.

The torch path gathers each decode's K/V blocks into a padded copy and then runs SDPA
over it, so every context position's K/V crosses memory three times per layer (gather
read, gather write, SDPA read). This kernel walks each sequence's block table and reads
every K/V row once, with an online softmax across blocks. Only slots below a sequence's
length are read: stale slots of its last block, which may hold another request's NaN,
never enter the sums.

One kernel is compiled per (block size, heads, KV heads, head dim): with those fixed,
LLVM unrolls and vectorises the head-dim loops. It is cached on disk (`numba_support.jit`).
The kernel releases the GIL: the decodes, which the caller sorts by length, are dealt in
a snake (`numba_support.snake_task`) to as many threads as torch uses, so each gets a
similar share.

Blocks lie anywhere in memory, so the hardware prefetcher loses the stream at every block
boundary: while the kernel computes on one block it asks for the next block's rows
(`numba_support.prefetch`).

Its arithmetic is spelled out with `numba_support`'s exact lane ops, not left to LLVM's
fast-math choices: a score sums its products in DOT_PARTS interleaved parts, each in
order, then the parts by halving; a block's probabilities are summed by halving over
`sum_slots` slots; each step is rounded once.

A sliding window W (a Gemma 3 local layer's, Mistral's) is an argument, 0 for none: the
token at position p sees p - W < k <= p. Blocks wholly before its window are never read
(their table entries may be -1, their blocks another request's); in the block the window
starts in, the positions before it get probability exactly 0, as `paged_verify` gives
them. `paged_verify`, which serves runs of new
tokens of one sequence, does the same operations in the same order, so a token gets the
same bits either way and speculative decoding stays exactly what decoding one token at a
time gives.

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
    fp32_cpu,
    jit,
    lanes_add,
    lanes_copy,
    lanes_div,
    lanes_fma,
    lanes_mul,
    lanes_sum,
    prefetch,
    run_jobs,
    snake_task,
    stack_array,
)

# A score's products are summed in this many parts (part i: dims i, i + DOT_PARTS, ...).
DOT_PARTS = 8


def sum_slots(block_size: int) -> int:
    """The slots a block's probabilities are summed over: the power of 2 from block_size
    up (the slots past the block, and past a sequence's length, hold 0)."""
    return 1 << (block_size - 1).bit_length()


def supports(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether `decode_attention` serves these tensors: query and out fp32, the caches
    both fp32 or both bf16 (read widened to fp32, exactly), all on CPU, the caches
    contiguous, none of them tracked by autograd (the kernel has no backward), head_dim a
    multiple of DOT_PARTS.

    bf16 queries stay on the torch path: where the CPU has native bf16, SDPA computes in
    bf16, which widening to fp32 here does not beat.
    """
    tensors = (query,) if out is None else (query, out)
    return (
        fp32_cpu(*tensors)
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and all(c.device.type == "cpu" and not c.requires_grad for c in (k_cache, v_cache))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[-1] % DOT_PARTS == 0
    )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """Attention of one new token per sequence over its paged context, into `out`
    (window: the sliding window, 0 for none).

    query, out: [num_tokens, num_heads, head_dim] fp32 (strided views allowed): decode i
    reads query row rows[i] and writes out row rows[i]; no other row is touched.
    rows: int64 [n]; block_tables: int32 [n, max_blocks]; seq_lens: int32 [n]: numpy
    arrays built once per batch and shared by every layer. The kernel does not check
    bounds: every row must lie in query, every seq_len must be at least 1 and every block
    id its length needs must lie in the cache.
    """
    run_jobs(
        [decode_job(query, k_cache, v_cache, rows, block_tables, seq_lens, scale, out, window)]
    )


def decode_job(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> Job:
    """`decode_attention`'s kernel call, for `numba_support.run_jobs` alongside others."""
    tasks = (rows, block_tables, seq_lens)
    return attention_job(compiled_kernel, query, k_cache, v_cache, tasks, scale, out, window)


@functools.cache
def compiled_kernel(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., Any]:
    """The kernel for one model shape (compiled, or loaded from the cache, on first call)."""
    bs, nh, d = block_size, num_heads, head_dim
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim  # one position's K (or V) row
    slots = sum_slots(block_size)
    heads = (num_heads + 15) // 16 * 16  # per-head state in whole 16-lane vectors

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def kernel(
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        rows: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        scale: np.float32,
        window: int,
        out: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        # Scratch on the stack: LLVM knows that no other array aliases it (and it is
        # 64-byte aligned), which heap scratch is not: the kernel ran slower with it.
        # Per head (the spare lanes past num_heads stay 0): the running max, denominator
        # and a block's max, max change, rescale factor and sum of probabilities.
        m, den = stack_array((heads,)), stack_array((heads,))
        top, diff = stack_array((heads,)), stack_array((heads,))
        rescale, sums = stack_array((heads,)), stack_array((heads,))
        for state in (m, den, top, diff, rescale, sums):
            lanes_copy(state, 0.0, heads)
        acc = stack_array((nh, d))
        qs = stack_array((nh, d))
        probs = stack_array((nh, slots))  # scores, then probabilities
        shifted = stack_array((slots,))
        row_out = stack_array((d,))
        bits = np.empty(max(slots, heads), dtype=np.int32)
        part = stack_array((DOT_PARTS,))
        per_line = 64 // k_cache.itemsize  # cache elements in one 64-byte line
        num_seqs = rows.shape[0]
        for turn in range((num_seqs + workers - 1) // workers):
            s = snake_task(turn, worker, workers)
            if s >= num_seqs:
                continue
            following = snake_task(turn + 1, worker, workers)  # this worker's next task
            length = seq_lens[s]
            query_row = rows[s]
            # The first position the window shows, and the first block of the next task's.
            lo = max(0, length - window) if window > 0 else 0
            following_block = 0
            if window > 0 and following < num_seqs:
                following_block = max(0, seq_lens[following] - window) // bs
            lanes_copy(m[:nh], -np.inf, nh)
            lanes_copy(den[:nh], 0.0, nh)
            for h in range(nh):
                lanes_copy(acc[h], 0.0, d)
                for j in range(d):
                    qs[h, j] = q[query_row, h, j] * scale
            num_blocks = (length + bs - 1) // bs
            for b in range(lo // bs, num_blocks):
                block = block_tables[s, b]
                n = min(bs, length - b * bs)
                hidden = max(0, lo - b * bs)  # leading slots before the window
                # The block read next (this sequence's, else the first of the next one
                # this worker takes) is fetched row by row while this one is computed.
                upcoming = block
                if b + 1 < num_blocks:
                    upcoming = block_tables[s, b + 1]
                elif following < num_seqs:
                    upcoming = block_tables[following, following_block]
                # A bf16 cache's values are widened to fp32 as the lane ops load them.
                kb, vb = k_cache[block], v_cache[block]
                k_next, v_next = k_cache[upcoming], v_cache[upcoming]
                for t in range(n):
                    for line in range(0, width, per_line):
                        prefetch(k_next, t * width + line)
                    if t < hidden:
                        for h in range(nh):
                            probs[h, t] = -np.inf
                        continue
                    for h in range(nh):
                        kh = h // group
                        lanes_copy(part, 0.0, DOT_PARTS)
                        for j in range(0, d, DOT_PARTS):
                            lanes_fma(
                                part,
                                qs[h, j : j + DOT_PARTS],
                                kb[t, kh, j : j + DOT_PARTS],
                                DOT_PARTS,
                            )
                        probs[h, t] = lanes_sum(part, DOT_PARTS)
                for h in range(nh):
                    highest = m[h]
                    for t in range(n):
                        highest = max(highest, probs[h, t])
                    top[h] = highest
                    diff[h] = m[h] - highest  # one rounding, as paged_verify's FMA by -1
                exp_into(diff[:nh], rescale[:nh], bits)  # 0 on the first block (m = -inf)
                for h in range(nh):
                    for t in range(n):
                        shifted[t] = probs[h, t] - top[h]
                    exp_into(shifted[:n], probs[h, :n], bits)
                    for t in range(hidden):  # exp_into gives 1.6e-38 for -inf: an exact 0
                        probs[h, t] = 0.0
                    for t in range(n, slots):
                        probs[h, t] = 0.0
                    sums[h] = lanes_sum(probs[h], slots)
                    lanes_mul(acc[h], acc[h], rescale[h], d)
                lanes_mul(den, den, rescale, heads)
                lanes_add(den, sums, heads)
                lanes_copy(m, top, heads)
                for t in range(n):
                    for line in range(0, width, per_line):
                        prefetch(v_next, t * width + line)
                    for h in range(nh):
                        lanes_fma(acc[h], vb[t, h // group], probs[h, t], d)
            for h in range(nh):
                lanes_div(row_out, acc[h], den[h], d)
                for j in range(d):
                    out[query_row, h, j] = row_out[j]

    return kernel
