"""Vectorised torch path for CPU: the backend the model uses when it runs without a GPU.

No Python loop per token or block. Sequences are grouped so that padding stays cheap:
decodes (one new token) apart from prefills; decodes cut by a padding budget, prefills
by geometric length buckets (a batch of decodes with contexts from 50 to 2000 tokens is
not all padded to 2000). Each group gathers its K/V blocks through the block tables in
one `index_select`, pads to the group's longest context with masked slots that cannot
hold another request's NaN (copies of the sequence's own full first block, else zeros;
a -inf score does not stop 0 * NaN), and runs one batched scaled_dot_product_attention:
- decodes fold the query heads of one KV head into the query-length dimension, so each
  K/V row is read once per KV head, not once per query head;
- prefills use SDPA's own GQA with a mask for the causal offset (the new tokens are
  the last positions of the context), or is_causal when no sequence has earlier
  context (a fresh prompt), which lets the kernel skip the masked half.
K/V are gathered in the cache's dtype (half the bytes of fp32 for a 16-bit cache). The
arithmetic runs in bf16 when query and cache are bf16 and the CPU has native bf16 matmul
(AMX or AVX512-BF16: SDPA accumulates in fp32 there), otherwise in fp32 (fp16, and bf16
elsewhere, are slow on CPU); the output takes query's dtype.

Where the caller allows it (a plan made with compiled=True: the CPU executor's, or the
one made for a call without a plan) and numba is installed, decodes over an fp32 cache
skip the gather: the compiled kernel of `paged_decode` reads their K/V in place, once.
So do sequences of more new tokens (a decode verifying a draft, a prompt):
`paged_verify` takes runs of their tokens, reading each block once for a whole run, and
`paged_decode` the rest, a row per token; both give a token the same bits, and one
dispatch to the threads runs both. Where the verify kernel does not take the shapes,
only sequences of up to COMPILED_MAX_QUERY new tokens go to `paged_decode`, and longer
prefills stay on SDPA. PAGEDINFER_CPU_KERNELS=torch keeps everything on the gather path.

The bookkeeping (groups, gather indices, padding, masks) depends only on the batch, not
on the layer: `plan_attention` computes it once, and a model passes the plan to every
layer's call. Without a plan, each call makes its own.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from pagedinfer.kernels.validation import first_visible_block


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value rows at their slots; slot -1 is padding and is skipped."""
    slots = slot_mapping.long()
    if key.dtype != k_cache.dtype:  # fp32 rows over a bf16 cache: rounded to nearest
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    # Token rows of the cache viewed as [num_slots, kv_heads * head_dim]: one index_copy_
    # each, cheaper than advanced indexing with (block, offset) pairs.
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        rows, width = k_cache.shape[0] * k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3]
        k_cache.view(rows, width).index_copy_(0, slots, key.reshape(-1, width))
        v_cache.view(rows, width).index_copy_(0, slots, value.reshape(-1, width))
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


@dataclass
class _Group:
    """Sequences that run as one padded SDPA call, and the indices that get them there."""

    num_seqs: int
    max_new: int  # query rows per sequence (1 for decodes)
    ctx: int  # padded context: whole blocks
    table: torch.Tensor  # int64 [num_seqs * ctx / block_size], block ids (unused -> 0)
    unused_blocks: torch.Tensor  # int64, rows of the gathered [seqs * blocks] past the end
    tail_rows: torch.Tensor  # int64, token rows of the gathered [seqs * ctx] past the end
    query_rows: torch.Tensor  # int64 [num_seqs * max_new], query row of each (0 = padding)
    out_rows: torch.Tensor  # int64, query rows of the valid entries, in order
    valid: torch.Tensor | None  # int64, which of the num_seqs * max_new entries are real
    mask: torch.Tensor | None  # fp32 additive mask, or None with is_causal
    decode: bool
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # mask, converted

    def mask_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask in `dtype` (SDPA wants the query's), converted once per plan."""
        if self.mask is None or dtype == self.mask.dtype:
            return self.mask
        if dtype not in self.masks:
            self.masks[dtype] = self.mask.to(dtype)
        return self.masks[dtype]


@dataclass
class _Decodes:
    """The decodes that the compiled kernel serves, longest context first."""

    query_rows: np.ndarray  # int64 [n]
    block_tables: np.ndarray  # int32 [n, blocks]
    seq_lens: np.ndarray  # int32 [n]


@dataclass
class _Runs:
    """Runs of new tokens of one sequence that the compiled verify kernel serves, the
    longest context first (see `paged_verify.verify_attention`)."""

    query_rows: np.ndarray  # int64 [n], query row of the run's first token
    counts: np.ndarray  # int32 [n], tokens in the run
    block_tables: np.ndarray  # int32 [n, blocks]
    seq_lens: np.ndarray  # int32 [n], the first token's context, up to and including it


@dataclass
class AttentionPlan:
    """The per-batch bookkeeping of `paged_attention`, shared by every layer's call."""

    groups: list[_Group]
    block_size: int
    decodes: _Decodes | None = None  # None: every decode is in a group
    runs: _Runs | None = None  # None: no verify kernel
    verify_rows: int = 0  # the longest run
    sliding_window: int | None = None  # the window its masks and gathers were built for


# Where the verify kernel takes runs of new tokens, every sequence goes to the compiled
# kernels, prompts too: reading each K/V block once per run beat SDPA over gathered K/V
# at every prompt size tried. Without it, a row per token is no faster than SDPA, so only
# sequences with up to this many new tokens go there: a decode verifying the longest
# draft (16 tokens).
COMPILED_MAX_QUERY = 17


def compiled_kernels() -> bool:
    """Whether the numba-compiled CPU kernels (`kernels.cpu`) may run: numba is installed
    and PAGEDINFER_CPU_KERNELS is not `torch` (the opt-out)."""
    return os.environ.get("PAGEDINFER_CPU_KERNELS", "compiled") != "torch" and _numba_installed()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def compiled_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decodes on these tensors take the compiled kernel (see the module doc)."""
    if not compiled_kernels():
        return False
    module = _paged_decode()
    return module is not None and module.supports(query, k_cache, v_cache)


@functools.cache
def _paged_decode() -> ModuleType | None:
    """The compiled decode kernel's module, or None where numba is not installed."""
    if not _numba_installed():
        return None
    from pagedinfer.kernels.cpu import paged_decode

    return paged_decode


def compiled_verify_rows(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The most new tokens of one sequence that the compiled verify kernel serves in one
    run for these shapes, 0 for none (`paged_verify.rows_per_run`). Meaningful only where
    `compiled_decode` holds: it checks nothing else."""
    module = _paged_verify()
    if module is None:
        return 0
    return module.rows_per_run(query.shape[1], k_cache.shape[2], k_cache.shape[3])


@functools.cache
def _paged_verify() -> ModuleType | None:
    """The compiled verify kernel's module, or None where numba is not installed."""
    if not _numba_installed():
        return None
    from pagedinfer.kernels.cpu import paged_verify

    return paged_verify


def plan_for(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    compiled: bool = True,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """The plan `paged_attention` makes when given none: the compiled kernels wherever
    these tensors allow them (compiled=False: plain torch ops only), for a sliding window
    too (the kernels take it as an argument)."""
    compiled = compiled and compiled_decode(query, k_cache, v_cache)
    verify_rows = compiled_verify_rows(query, k_cache) if compiled else 0
    return plan_attention(
        block_tables,
        seq_lens,
        query_start_loc,
        k_cache.shape[1],
        compiled,
        verify_rows,
        sliding_window=sliding_window,
    )


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    compiled: bool = False,
    verify_rows: int = 0,
    *,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Group the sequences and build every index and mask the layers will need.

    compiled: sequences go to the compiled kernels (`compiled_decode` says whether the
    tensors allow it) instead of padded groups: all of them with verify_rows, else those
    with up to COMPILED_MAX_QUERY new tokens. verify_rows: with compiled, the verify
    kernel takes their tokens in runs of up to this many (`compiled_verify_rows`); 0
    gives every token a row of its own.
    sliding_window: new token at position p sees positions p - W < k <= p; each sequence
    gathers only the blocks from the first one its earliest new token sees, and the
    compiled kernels read none before it either.
    """
    decodes = runs = None
    if compiled:
        # The compiled kernels' share in numpy: a few dozen small ops, each a fraction of
        # a torch call's cost, which matters in a step of a few tokens.
        starts_np = query_start_loc.numpy().astype(np.int64)
        lens_np = seq_lens.numpy().astype(np.int64)
        tables_np = block_tables.numpy()
        qlens_np = starts_np[1:] - starts_np[:-1]
        short = qlens_np >= 1
        if not verify_rows:
            short &= qlens_np <= COMPILED_MAX_QUERY
        ids = np.flatnonzero(short)
        in_runs = _tokens_in_runs(qlens_np[ids], verify_rows)
        decodes = _plan_rows(ids, in_runs, tables_np, lens_np, qlens_np, starts_np)
        if verify_rows:
            runs = _plan_runs(ids, in_runs, verify_rows, tables_np, lens_np, qlens_np, starts_np)
    verify = verify_rows if runs is not None else 0
    if compiled and short.all():  # nothing left for the padded groups
        return AttentionPlan([], block_size, decodes, runs, verify, sliding_window)
    starts = query_start_loc.long()
    seq_lens = seq_lens.long()
    query_lens = starts[1:] - starts[:-1]
    if compiled:
        query_lens = torch.where(torch.from_numpy(short), 0, query_lens)  # no group of their own
    first_block = first_visible_block(seq_lens, query_lens, block_size, sliding_window)
    window = _Window(sliding_window, first_block) if sliding_window is not None else None
    # Grouped by the context each sequence gathers: from its first visible block on.
    gathered = seq_lens - first_block * block_size
    groups = [
        _plan_group(seq_ids, block_tables, seq_lens, query_lens, starts, block_size, window)
        for seq_ids in _length_groups(query_lens, gathered)
    ]
    return AttentionPlan(groups, block_size, decodes, runs, verify, sliding_window)


@dataclass
class _Window:
    """A sliding window of `size` tokens, and per sequence the first block it gathers."""

    size: int
    first_block: torch.Tensor  # int64 [num_seqs]


def _tokens_in_runs(query_lens: np.ndarray, verify_rows: int) -> np.ndarray:
    """How many of each sequence's first new tokens the verify kernel takes: whole runs of
    verify_rows, then a last run of the rest if it is at least half as long (and at least
    2). A run costs about the same whatever its length, so shorter ones, and plain decodes,
    are cheaper a row per token."""
    if not verify_rows:
        return np.zeros_like(query_lens)
    whole = query_lens // verify_rows * verify_rows
    rest = query_lens - whole
    return whole + np.where(rest >= max(2, (verify_rows + 1) // 2), rest, 0)


def _plan_rows(
    ids: np.ndarray,
    in_runs: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    starts: np.ndarray,
) -> _Decodes:
    """A row per new token of sequences `ids` past their first in_runs: token i of q new
    ones sees len - q + i + 1 positions. Longest context first (ties in batch order)."""
    qlens = query_lens[ids]
    seq_of_row = np.repeat(ids, qlens)
    first_row = np.repeat(np.cumsum(qlens) - qlens, qlens)
    offset = np.arange(seq_of_row.shape[0]) - first_row
    keep = offset >= np.repeat(in_runs, qlens)
    seq_of_row, offset = seq_of_row[keep], offset[keep]
    lens = seq_lens[seq_of_row] - query_lens[seq_of_row] + 1 + offset
    order = np.argsort(-lens, kind="stable")
    seq_of_row = seq_of_row[order]
    return _Decodes(
        query_rows=starts[seq_of_row] + offset[order],
        block_tables=block_tables[seq_of_row].astype(np.int32, copy=False),
        seq_lens=lens[order].astype(np.int32),
    )


def _plan_runs(
    ids: np.ndarray,
    in_runs: np.ndarray,
    verify_rows: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    starts: np.ndarray,
) -> _Runs:
    """The first in_runs new tokens of sequences `ids`, in runs of up to verify_rows.
    Longest context first (ties in batch order): every run costs about the same per
    position."""
    num_runs = (in_runs + verify_rows - 1) // verify_rows
    seq_of_run = np.repeat(ids, num_runs)
    first_run = np.repeat(np.cumsum(num_runs) - num_runs, num_runs)
    offset = (np.arange(seq_of_run.shape[0]) - first_run) * verify_rows
    counts = np.minimum(np.repeat(in_runs, num_runs) - offset, verify_rows)
    lens = seq_lens[seq_of_run] - query_lens[seq_of_run] + 1 + offset
    order = np.argsort(-(lens + counts), kind="stable")
    seq_of_run = seq_of_run[order]
    return _Runs(
        query_rows=starts[seq_of_run] + offset[order],
        counts=counts[order].astype(np.int32),
        block_tables=block_tables[seq_of_run].astype(np.int32, copy=False),
        seq_lens=lens[order].astype(np.int32),
    )


def _plan_group(
    seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    starts: torch.Tensor,
    block_size: int,
    window: _Window | None = None,
) -> _Group:
    device = seq_lens.device
    lens, qlens = seq_lens[seq_ids], query_lens[seq_ids]
    num_seqs = lens.shape[0]
    blocks_needed = (lens + block_size - 1) // block_size
    # Each sequence gathers its blocks from `first` on (0 without a window): blocks wholly
    # before the window of its earliest new token are neither read nor padded for.
    if window is None:
        first = torch.zeros_like(lens)
        num_blocks = int(blocks_needed.max())
        cols = torch.arange(num_blocks, device=device)[None, :].expand(num_seqs, -1)
        table = block_tables[seq_ids, :num_blocks].long()
    else:
        first = window.first_block[seq_ids]
        num_blocks = int((blocks_needed - first).max())
        cols = first[:, None] + torch.arange(num_blocks, device=device)[None, :]
        width = block_tables.shape[1]
        table = block_tables[seq_ids].long().gather(1, cols.clamp(max=width - 1))
    ctx = num_blocks * block_size
    begin = first * block_size  # context position of each sequence's first gathered slot
    # Whole blocks in one gather. Table entries past a sequence's end may hold anything.
    # They are redirected to the sequence's own first gathered block when that one is
    # full: every slot of it was written by the sequence, so the masked copies hold
    # nothing its visible positions do not (no other request's NaN can leak in) and need
    # no zeroing. Sequences whose first gathered block is not full have no such block:
    # theirs point at block 0 and are zeroed after the gather.
    used = cols < blocks_needed[:, None]
    first_full = lens >= begin + block_size
    own = torch.where(first_full, table[:, 0], 0)
    table = torch.where(used, table, own[:, None]).flatten()
    unused_blocks = (~used & ~first_full[:, None]).flatten().nonzero().flatten()
    # Context position of each gathered slot, and the unwritten end of each last block.
    last_block_end = blocks_needed * block_size
    position = begin[:, None] + torch.arange(ctx, device=device)[None, :]
    tail = (position >= lens[:, None]) & (position < last_block_end[:, None])
    tail_rows = tail.flatten().nonzero().flatten()
    # query_rows[s, i]: the query row of new token i of sequence s (0 where s has fewer).
    max_new = int(qlens.max())
    offsets = torch.arange(max_new, device=device)
    valid = offsets[None, :] < qlens[:, None]
    query_rows = torch.where(valid, starts[seq_ids][:, None] + offsets, 0).flatten()
    all_valid = bool(valid.all())
    valid_index = None if all_valid else valid.flatten().nonzero().flatten()
    out_rows = query_rows if all_valid else query_rows[valid_index]
    decode = max_new == 1
    # A window binds only where some new token has more than `size` positions before it.
    windowed = window is not None and int(lens.max()) > window.size
    if decode:
        visible = position < lens[:, None]
        if windowed:
            visible &= position > (lens - 1 - window.size)[:, None]
        visible = visible[:, None, None, :]
    elif bool((qlens == lens).all()) and not windowed:
        visible = None  # fresh prompts: is_causal
    else:
        # New token i of a sequence sits at position len - qlen + i.
        query_pos = (lens - qlens)[:, None] + offsets
        visible = position[:, None, :] <= query_pos[:, :, None]
        if windowed:
            visible &= position[:, None, :] > (query_pos - window.size)[:, :, None]
        visible = visible[:, None]
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    return _Group(
        num_seqs=num_seqs,
        max_new=max_new,
        ctx=ctx,
        table=table,
        unused_blocks=unused_blocks,
        tail_rows=tail_rows,
        query_rows=query_rows,
        out_rows=out_rows,
        valid=valid_index,
        mask=mask,
        decode=decode,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of the packed new tokens over their paged contexts (see the package doc).

    plan: from `plan_attention` on the same block_tables, seq_lens, query_start_loc and
    sliding_window (with compiled decodes only where `compiled_decode` allows them); made
    here when not given.
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if plan is None:
        plan = plan_for(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            sliding_window=sliding_window,
        )
    elif plan.sliding_window != sliding_window:
        raise ValueError(
            f"plan: made for sliding_window={plan.sliding_window}, called with {sliding_window}"
        )
    _run_compiled(plan, query, k_cache, v_cache, scale, out)
    num_heads, head_dim = query.shape[1], query.shape[2]
    dtype = compute_dtype(query.dtype, k_cache.dtype)
    for g in plan.groups:
        key, value = _gather_context(k_cache, v_cache, g, dtype)
        q = query.index_select(0, g.query_rows)
        if q.dtype != dtype:  # a no-op .to() still costs a dispatch: skipped per layer
            q = q.to(dtype)
        q = q.view(g.num_seqs, g.max_new, num_heads, head_dim)
        mask = g.mask_in(dtype)
        if g.decode:
            o = _decode(q, key, value, mask, scale)
        else:
            o = _prefill(q, key, value, mask, scale)
        o = o.reshape(g.num_seqs * g.max_new, num_heads, head_dim)
        if g.valid is not None:
            o = o.index_select(0, g.valid)
        out.index_copy_(0, g.out_rows, o if o.dtype == out.dtype else o.to(out.dtype))
    return out


def _run_compiled(
    plan: AttentionPlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The plan's compiled decodes and verify runs, in one dispatch to the threads."""
    jobs = []
    d, r = plan.decodes, plan.runs
    if d is not None and d.query_rows.size:
        decode = _paged_decode()
        if decode is None or not decode.supports(query, k_cache, v_cache, out):
            raise ValueError("plan: compiled decodes, but these tensors cannot take them")
        jobs.append(
            decode.decode_job(
                query,
                k_cache,
                v_cache,
                d.query_rows,
                d.block_tables,
                d.seq_lens,
                scale,
                out,
                plan.sliding_window or 0,
            )
        )
    if r is not None and r.query_rows.size:
        verify = _paged_verify()
        if (
            verify is None
            or not _paged_decode().supports(query, k_cache, v_cache, out)
            or compiled_verify_rows(query, k_cache) < plan.verify_rows
        ):
            raise ValueError("plan: compiled verify runs, but these tensors cannot take them")
        jobs.append(
            verify.verify_job(
                query,
                k_cache,
                v_cache,
                r.query_rows,
                r.counts,
                r.block_tables,
                r.seq_lens,
                scale,
                out,
                plan.sliding_window or 0,
            )
        )
    if jobs:
        from pagedinfer.kernels.cpu.numba_support import run_jobs  # imports numba: only here

        run_jobs(jobs)


# A group has a fixed cost (a dozen small ops and one SDPA launch per layer) and each
# padded context slot a small one (gathered, zeroed and attended to). A decode joins the
# current group while its padding stays within this many slots: the value that beat both
# one group per sequence and a single padded group on decodes of spread-out contexts.
DECODE_PAD_SLOTS = 128


def _length_groups(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Sequence ids in groups that pad cheaply. Sequences with no new tokens are dropped.

    Decodes are sorted by context and cut wherever the padding to the group's longest
    context would exceed DECODE_PAD_SLOTS, so a batch of similar contexts runs as one
    SDPA call. Prefills (whose padding is multiplied by their query rows) group by
    geometric buckets of query length (ratio 2) and context (ratio 1.25).
    """
    groups = []
    decodes = (query_lens == 1).nonzero().flatten()
    if decodes.numel():
        lens, order = torch.sort(seq_lens[decodes], descending=True)
        decodes = decodes[order]
        lengths, first = lens.tolist(), 0
        for i, length in enumerate(lengths):
            if lengths[first] - length > DECODE_PAD_SLOTS:
                groups.append(decodes[first:i])
                first = i
        groups.append(decodes[first:])
    prefill = query_lens > 1
    if bool(prefill.any()):
        context_bucket = _log_bucket(seq_lens, smallest=64, ratio=1.25)
        query_bucket = _log_bucket(query_lens, smallest=64, ratio=2)
        key = torch.where(prefill, query_bucket * 1024 + context_bucket, -1)
        groups.extend((key == k).nonzero().flatten() for k in key.unique().tolist() if k >= 0)
    return groups


def _log_bucket(lengths: torch.Tensor, smallest: int, ratio: float) -> torch.Tensor:
    """ceil(log_ratio(length)), with every length up to `smallest` in one bucket."""
    return (torch.log(lengths.clamp(min=smallest).double()) / math.log(ratio)).ceil().long()


def compute_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU attention computes in: bf16 only where the CPU runs it natively."""
    if query_dtype == cache_dtype == torch.bfloat16 and native_bf16():
        return torch.bfloat16
    return torch.float32


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AMX tiles or AVX512-BF16)."""
    return any(
        bool(getattr(torch.cpu, probe, lambda: False)())
        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence in `dtype`, [seqs, ctx, kv_heads, head_dim], zero past its end."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    shape = (g.num_seqs, g.ctx, num_kv_heads, head_dim)
    gathered = []
    for cache, name in ((k_cache, "key"), (v_cache, "value")):
        blocks = _gather_blocks(cache, g.table, name, dtype)
        if g.unused_blocks.numel():
            blocks.view(g.table.numel(), -1).index_fill_(0, g.unused_blocks, 0.0)
        if g.tail_rows.numel():
            blocks.view(g.num_seqs * g.ctx, -1).index_fill_(0, g.tail_rows, 0.0)
        gathered.append(blocks.view(shape))
    return gathered[0], gathered[1]


def _decode(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [seqs, 1, heads, head_dim] -> the same shape."""
    num_seqs, _, num_heads, head_dim = q.shape
    num_kv_heads = key.shape[2]
    # The group's heads become the query rows of their KV head: K/V are read once per
    # KV head. (SDPA's enable_gqa reads them once per query head: slower here.)
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.reshape(num_seqs, 1, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q [seqs, max_new, heads, head_dim] -> the same shape. mask None: fresh prompts,
    new token i sees positions <= i (padding rows see zeroed K/V and are discarded)."""
    q, key, value = q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)


def _gather_blocks(
    cache: torch.Tensor, table: torch.Tensor, name: str, dtype: torch.dtype
) -> torch.Tensor:
    """cache[table] in `dtype`, as [len(table), block_size, kv_heads, head_dim], in scratch.

    One index_select in the cache's own dtype (a strided cache is made contiguous per
    block by advanced indexing instead); a conversion, when needed, is a second pass.
    """
    shape = (table.numel(), *cache.shape[1:])
    if cache[0].is_contiguous():
        raw = _scratch.get(name, shape, cache.dtype, cache.device)
        torch.index_select(cache.view(cache.shape[0], -1), 0, table, out=raw.view(shape[0], -1))
    else:
        raw = cache[table]
    if raw.dtype == dtype:
        return raw
    return _scratch.get(name, shape, dtype, cache.device).copy_(raw)


class _Scratch(threading.local):
    """Grow-only buffers for the gathered K/V, per name and dtype, one set per thread.

    Reusing them matters: a fresh tensor of tens of MB comes from mmap, and touching its
    pages for the first time costs more page faults (a kernel zeroing each 4 KiB page)
    than the gather itself. The buffers never escape a call, and threads do not share them.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self.buffers[key] = buffer
        return buffer[:numel].view(shape)


_scratch = _Scratch()
