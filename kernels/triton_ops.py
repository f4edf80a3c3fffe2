"""Triton kernels for the paged KV cache: `write_kv` and one unified `paged_attention`.

paged_attention is one kernel for decode, prefill, chunked prefill and prefill after a
prefix-cache hit (the design follows vLLM's unified attention kernel):
- GQA packing: one program owns a tile of BLOCK_M rows, each a (new token, query head)
  pair of the same sequence and KV head, so every K/V tile is loaded once per KV head
  and shared by the whole query group.
- The grid is over query blocks of all sequences at once, laid out so that the host
  never reads the index tensors (no device sync): sequence i owns the programs from
  `query_start_loc[i] // BLOCK_Q + i`, and a program finds its sequence by binary
  search. Surplus programs exit at once.
- The block table is read per KV tile and per position, so any block size works.
- Online softmax in base 2, causal masking of the new tokens, K/V loads masked beyond
  the causal limit (unwritten slots may hold NaN; masked loads never read them), and
  int64 offsets (a large cache overflows int32).
- Sliding window (SLIDING): a program starts at the tile holding the first position its
  earliest row sees, masks loads before that position (block-table entries there may
  be freed: -1) and masks each row to its own window, p - W < k <= p.
- Split-KV (flash decoding): a third grid axis cuts each sequence's context into
  NUM_SPLITS parts that write partial results, merged by `_reduce_splits_kernel`.
  Chosen for decode batches with too few (sequence, KV head) pairs to fill the GPU.

Tile sizes come from heuristics, not `triton.autotune` (multi-config autotuning fails
without a GPU driver, and the interpreter needs the same code path). In the
interpreter, inputs of tl.dot are upcast to fp32 (bf16 dot is wrong there, triton
issue 11584).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# --------------------------------------------------------------------------- write_kv


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    # The (head, dim) pairs of a token form one flat row, so a program moves TOKENS rows.
    j = tl.arange(0, BLOCK_HD)
    head = j // HEAD_DIM
    dim = j % HEAD_DIM
    mask = ((token < num_tokens) & (slot >= 0))[:, None] & (j < NUM_KV_HEADS * HEAD_DIM)[None, :]
    src_k = token[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd
    src_v = token[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd
    dst_k = (
        block[:, None] * stride_kcb
        + offset[:, None] * stride_kco
        + head[None, :] * stride_kch
        + dim[None, :] * stride_kcd
    )
    dst_v = (
        block[:, None] * stride_vcb
        + offset[:, None] * stride_vco
        + head[None, :] * stride_vch
        + dim[None, :] * stride_vcd
    )
    tl.store(k_cache_ptr + dst_k, tl.load(key_ptr + src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst_v, tl.load(value_ptr + src_v, mask=mask), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton write of key/value rows into their slots; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    meta = write_kv_meta(num_kv_heads, head_dim)
    _write_kv_kernel[(triton.cdiv(num_tokens, meta["TOKENS"]),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        **meta,
    )


def write_kv_meta(num_kv_heads: int, head_dim: int) -> dict:
    """Compile-time constants of `_write_kv_kernel`: about 4096 elements per program."""
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "TOKENS": max(1, min(16, 4096 // block_hd)),
        "BLOCK_HD": block_hd,
    }


# ---------------------------------------------------------------------- attention


@triton.jit
def _find_sequence(query_start_loc_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query block, qsl[i] // BLOCK_Q + i, is <= program."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    scale_log2,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_block = program - (q_begin // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return  # surplus program
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens before the new ones

    # Rows: (token within the block, head within the group), the head varying fastest.
    rows = tl.arange(0, BLOCK_M)
    q_offset = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_offset < query_len)
    token = (q_begin + q_offset).to(tl.int64)
    row_position = context_len + q_offset
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        query_ptr
        + token[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Causal limit of the whole tile: the last valid row's position, plus one.
    last_offset = tl.minimum((q_block + 1) * BLOCK_Q, query_len) - 1
    kv_end = context_len + last_offset + 1
    if SLIDING:
        # The first position the tile's earliest row sees: tiles before it are skipped.
        kv_begin = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    else:
        kv_begin = context_len * 0
    first_tile = kv_begin // TILE
    num_tiles = tl.cdiv(kv_end, TILE) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_k = k_cache_ptr + kv_head.to(tl.int64) * stride_kch
    head_v = v_cache_ptr + kv_head.to(tl.int64) * stride_vch

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for tile in range(tile_begin, tile_end):
        positions = tile * TILE + tl.arange(0, TILE)
        in_context = (positions < kv_end) & (positions >= kv_begin)
        physical = tl.load(table_row + positions // BLOCK_SIZE, mask=in_context, other=0)
        slot_k = physical.to(tl.int64) * stride_kcb + (positions % BLOCK_SIZE) * stride_kco
        slot_v = physical.to(tl.int64) * stride_vcb + (positions % BLOCK_SIZE) * stride_vco
        kv_mask = in_context[:, None] & dim_valid[None, :]
        k = tl.load(head_k + slot_k[:, None] + dims[None, :] * stride_kcd, mask=kv_mask, other=0.0)
        v = tl.load(head_v + slot_v[:, None] + dims[None, :] * stride_vcd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = (positions[None, :] <= row_position[:, None]) & in_context[None, :]
        if SLIDING:
            visible = visible & (positions[None, :] > row_position[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen nothing yet keeps -inf; shift by 0 to avoid inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max

    if NUM_SPLITS == 1:
        result = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # Partials are [num_tokens, num_heads, NUM_SPLITS] (+ HEAD_DIM_P), contiguous.
        partial = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + partial, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, row_sum, mask=row_valid)
        tl.store(
            partial_out_ptr + partial[:, None] * HEAD_DIM_P + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    split_valid = splits < NUM_SPLITS
    maxes = tl.load(partial_max_ptr + base + splits, mask=split_valid, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + base + splits, mask=split_valid, other=0.0)
    accs = tl.load(
        partial_out_ptr + (base + splits)[:, None] * HEAD_DIM_P + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    top = tl.max(maxes, axis=0)
    # Splits that saw no position have max -inf and contribute weight 0.
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - top))
    total = tl.sum(weights * sums, axis=0)
    result = tl.sum(weights[:, None] * accs, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def reduce_meta(num_heads: int, head_dim: int, num_splits: int) -> dict:
    """Compile-time constants of `_reduce_splits_kernel`."""
    return {
        "NUM_HEADS": num_heads,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": max(16, triton.next_power_of_2(head_dim)),
        "NUM_SPLITS": num_splits,
        "SPLITS_P": triton.next_power_of_2(num_splits),
    }


def choose_num_splits(
    num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Heuristic: split the context only for decode batches too small to fill the GPU.

    Everything here is known from tensor shapes, so choosing costs no device sync.
    """
    if num_tokens != num_seqs or max_context < 1024:
        return 1  # prefill work, or short contexts: one pass is enough
    programs = num_seqs * num_kv_heads
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    by_length = max_context // 512  # keep each split at least 512 positions long
    return max(1, min(triton.cdiv(target, programs), by_length, 64))


def attention_meta(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    decode_only: bool,
    num_splits: int,
    sliding: bool = False,
) -> dict:
    """Compile-time constants and launch options of `_paged_attention_kernel` (heuristics)."""
    group = num_heads // num_kv_heads
    # Rows per program: at least tl.dot's minimum of 16, more for prefill to reuse K/V.
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    return {
        "NUM_HEADS": num_heads,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": head_dim_p,
        "BLOCK_SIZE": block_size,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE": 64 if head_dim_p <= 64 else 32,
        "NUM_SPLITS": num_splits,
        "UPCAST": _INTERPRETED,
        # fp32 inputs get exact fp32 products (tf32 would cost ~1e-3 of accuracy).
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "SLIDING": sliding,
        # Prefill tiles need 8 warps to stay in registers (ptxas spills at 4 on sm_90).
        "num_warps": 4 if decode_only else 8,
        "num_stages": 2,
    }


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton paged attention; `num_splits` overrides the split-KV heuristic (tests).
    sliding_window: see `pagedinfer.kernels.paged_attention`."""
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    decode_only = num_tokens == num_seqs
    max_context = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)  # a decode reads at most its window
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tokens, num_seqs, num_kv_heads, max_context, query.device
        )

    meta = attention_meta(
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        query.dtype,
        decode_only,
        num_splits,
        sliding=sliding_window is not None,
    )
    grid = (num_tokens // meta["BLOCK_Q"] + num_seqs, num_kv_heads, num_splits)

    if num_splits > 1:
        shape = (num_tokens, num_heads, num_splits)
        partial_max = torch.empty(shape, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty(shape, dtype=torch.float32, device=query.device)
        partial_out = torch.empty(
            (*shape, meta["HEAD_DIM_P"]), dtype=torch.float32, device=query.device
        )
    else:
        partial_max = partial_sum = partial_out = out  # unused

    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale * 1.4426950408889634,  # log2(e): the softmax runs in base 2
        sliding_window or 0,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        **meta,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            *out.stride(),
            **reduce_meta(num_heads, head_dim, num_splits),
        )
    return out
