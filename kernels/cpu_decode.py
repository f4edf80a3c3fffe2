"""Paged decode attention for CPU, compiled with numba: K/V are read in place.

The torch path gathers each decode's K/V blocks into a padded copy and then runs SDPA
over it, so every context position's K/V crosses memory three times per layer (gather
read, gather write, SDPA read). This kernel walks each sequence's block table and reads
every K/V row once, with an online softmax across blocks. Only slots below a sequence's
length are read: stale slots of its last block, which may hold another request's NaN,
never enter the sums.

One kernel is compiled per (block size, heads, KV heads, head dim): with those fixed,
LLVM unrolls and vectorises the head-dim loops. Compiling takes a few seconds on first
use; the result is cached on disk where the package directory (or NUMBA_CACHE_DIR) is
writable. The kernel releases the GIL: the decodes, which the caller sorts by length,
are dealt round-robin to as many threads as torch uses, so each gets a similar share.

Blocks lie anywhere in memory, so the hardware prefetcher loses the stream at every block
boundary: while the kernel computes on one block it asks for the next block's rows
(`cpu_numba.prefetch`). On SmolLM2's shapes (32 decodes of 40-300 tokens, 30 layers, K/V
from memory) that took one thread from 199 to 152 ns per context position and layer,
two threads from 118 to 94; with K/V already in cache it costs nothing (111 and 119 ns).

Measured on SmolLM2's shapes, 2 threads, 32 decodes of 40-300 tokens, 30 layers, before
the prefetch: 28-39 ms against 54-71 ms for gather + SDPA on their own. Inside a forward
pass the gain shrinks (a step of 32 decodes 5-10% faster, of 100-128 decodes 13.5%;
steps alternated between the two paths in one engine), because torch's OpenMP workers
spin for a while after each GEMM and compete with this kernel's threads. The prefetch
took a further 7% off a 32-decode step (96.2 to 89.1 ms) and 11% off a 100-decode one
(206.6 to 184.3 ms), steps alternating between the two kernels.

Importing this module imports numba: `torch_ops` imports it only where numba is installed.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pagedinfer.kernels.cpu_numba import FASTMATH, exp_into, fp32_cpu, jit, prefetch


def supports(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether `decode_attention` serves these tensors: all fp32, on CPU, the caches
    contiguous, none of them tracked by autograd (the kernel has no backward).

    A bf16 cache stays on the torch path: where the CPU has native bf16 its SDPA reads half
    the bytes, and widening in this kernel measured slower (110 vs 105 ms per 32-decode
    step of SmolLM2).
    """
    tensors = (query, k_cache, v_cache) if out is None else (query, k_cache, v_cache, out)
    return fp32_cpu(*tensors) and k_cache.is_contiguous() and v_cache.is_contiguous()


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of one new token per sequence over its paged context, into `out`.

    query, out: [num_tokens, num_heads, head_dim] fp32 (strided views allowed): decode i
    reads query row rows[i] and writes out row rows[i]; no other row is touched.
    rows: int64 [n]; block_tables: int32 [n, max_blocks]; seq_lens: int32 [n]: numpy
    arrays built once per batch and shared by every layer. The kernel does not check
    bounds: every row must lie in query, every seq_len must be at least 1 and every block
    id its length needs must lie in the cache.
    """
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    kernel = _kernel(block_size, query.shape[1], num_kv_heads, head_dim)
    args = (
        query.numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        rows,
        block_tables,
        seq_lens,
        np.float32(scale),
        out.numpy(),
    )
    workers = max(1, min(torch.get_num_threads(), num_seqs))
    others = [_pool(workers).submit(kernel, *args, w, workers) for w in range(1, workers)]
    kernel(*args, 0, workers)
    for other in others:
        other.result()


_pool_lock = threading.Lock()


@functools.cache
def _pool_of(size: int, pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(size, thread_name_prefix="pagedinfer-attention")


def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads for the workers beyond the caller's own, one pool per size in use. Keyed by
    process too: a forked child inherits the pool object but none of its threads."""
    with _pool_lock:
        return _pool_of(workers - 1, os.getpid())


@functools.cache
def _kernel(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., Any]:
    """The kernel for one model shape (compiled, or loaded from the cache, on first call)."""
    bs, nh, d = block_size, num_heads, head_dim
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim  # one position's K (or V) row

    @jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
    def kernel(
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        rows: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        scale: np.float32,
        out: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        m = np.empty(nh, dtype=np.float32)
        den = np.empty(nh, dtype=np.float32)
        acc = np.empty((nh, d), dtype=np.float32)
        scores = np.empty((nh, bs), dtype=np.float32)
        shifted = np.empty(bs, dtype=np.float32)
        bits = np.empty(bs, dtype=np.int32)
        qs = np.empty((nh, d), dtype=np.float32)
        num_seqs = rows.shape[0]
        for s in range(worker, num_seqs, workers):
            length = seq_lens[s]
            query_row = rows[s]
            for h in range(nh):
                m[h] = -np.inf
                den[h] = 0.0
                for j in range(d):
                    acc[h, j] = 0.0
                    qs[h, j] = q[query_row, h, j] * scale
            num_blocks = (length + bs - 1) // bs
            for b in range(num_blocks):
                block = block_tables[s, b]
                n = min(bs, length - b * bs)
                # The block read next (this sequence's, else the first of the next one
                # this worker takes) is fetched row by row while this one is computed.
                upcoming = block
                if b + 1 < num_blocks:
                    upcoming = block_tables[s, b + 1]
                elif s + workers < num_seqs:
                    upcoming = block_tables[s + workers, 0]
                kb, vb = k_cache[block], v_cache[block]
                k_next, v_next = k_cache[upcoming], v_cache[upcoming]
                for t in range(n):
                    for line in range(0, width, 16):  # 16 floats: one 64-byte line
                        prefetch(k_next, t * width + line)
                    for h in range(nh):
                        kh = h // group
                        dot = np.float32(0.0)
                        for j in range(d):
                            dot += qs[h, j] * kb[t, kh, j]
                        scores[h, t] = dot
                for h in range(nh):
                    top = m[h]
                    for t in range(n):
                        top = max(top, scores[h, t])
                    rescale = np.exp(m[h] - top)  # 0 on the first block (m = -inf)
                    m[h] = top
                    for t in range(n):
                        shifted[t] = scores[h, t] - top
                    exp_into(shifted[:n], scores[h, :n], bits)
                    total = den[h] * rescale
                    for t in range(n):
                        total += scores[h, t]
                    den[h] = total
                    for j in range(d):
                        acc[h, j] *= rescale
                for t in range(n):
                    for line in range(0, width, 16):
                        prefetch(v_next, t * width + line)
                    for h in range(nh):
                        kh = h // group
                        p = scores[h, t]
                        for j in range(d):
                            acc[h, j] += p * vb[t, kh, j]
            for h in range(nh):
                inv = np.float32(1.0) / den[h]
                for j in range(d):
                    out[query_row, h, j] = acc[h, j] * inv

    return kernel
