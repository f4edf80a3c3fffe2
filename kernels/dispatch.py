"""`write_kv` and `paged_attention`, the ops every backend matches: each call runs the
Triton kernels (CUDA tensors, or any with `TRITON_INTERPRET=1`) or the torch path.
Exported as `pagedinfer.kernels.write_kv` and `pagedinfer.kernels.paged_attention`."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from pagedinfer.kernels import torch_ops
from pagedinfer.kernels.validation import check_paged_attention, check_write_kv


def use_triton(t: torch.Tensor) -> bool:
    """Whether the ops run Triton kernels for tensors on t's device."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_ops() -> ModuleType:
    from pagedinfer.kernels import triton_ops

    return triton_ops


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    validate: bool = True,
) -> None:
    """Write the new tokens' keys and values into the paged cache, in place.

    key, value: `[num_tokens, num_kv_heads, head_dim]`, the cache's dtype, or fp32 over a
    bf16 cache on CPU (stored rounded to nearest bf16).
    slot_mapping: int64 (int32 accepted) `[num_tokens]`; -1 skips the token (padding).
    check_values=False skips the checks that read slot_mapping (a host sync on GPU).
    validate=False skips every check: for a caller that validated the same batch already
    (a model's later layers, whose tensors match the first layer's).
    Raises ValueError naming the argument on bad input.
    """
    if validate:
        check_write_kv(key, value, k_cache, v_cache, slot_mapping, check_values)
    same_dtype = key.dtype == k_cache.dtype  # fp32 rows over a bf16 cache: the torch path
    backend = _triton_ops() if use_triton(k_cache) and same_dtype else torch_ops
    backend.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    check_values: bool = True,
    validate: bool = True,
    plan: torch_ops.AttentionPlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the packed new tokens over their paged contexts; returns out.

    query: `[num_tokens, num_heads, head_dim]`, the cache's dtype (or fp32 over a bf16
    cache on CPU: computed in fp32); sequence i owns rows
    `query_start_loc[i]:query_start_loc[i + 1]`, the last positions of its context of
    `seq_lens[i]` tokens (the new tokens' K/V already written with `write_kv`), causal
    among the new tokens. One call covers decode, prefill, chunked prefill and prefill
    after a prefix-cache hit, mixed freely in one batch.
    block_tables: int32 `[num_seqs, max_blocks_per_seq]`; seq_lens: int32 `[num_seqs]`;
    query_start_loc: int32 `[num_seqs + 1]` (int64 accepted for all three).
    GQA: num_heads is a multiple of num_kv_heads; query head h reads KV head
    h // (num_heads // num_kv_heads). out, if given, has query's shape and dtype.
    check_values=False skips the checks that read the index tensors (a host sync on
    GPU); shape, dtype and device are checked unless validate=False, which skips every
    check (for a caller that validated the same batch already, as in `write_kv`).
    plan: for the torch path, `torch_ops.plan_attention` of this batch (for the same
    sliding_window), so that the layers of one forward share the batch's bookkeeping;
    the Triton kernels ignore it.
    sliding_window: None attends to the whole context; W attends, from position p, only
    to positions k with p - W < k <= p (transformers' sliding-window causal mask).
    Block-table columns wholly before the window of a sequence's earliest new token are
    never read, so they may hold anything (the blocks of a freed window: -1).
    Raises ValueError naming the argument on bad input.
    """
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if validate:
        check_paged_attention(*tensors, scale, out, check_values, sliding_window=sliding_window)
    args = (*tensors, float(scale), out)
    if use_triton(query) and query.dtype == k_cache.dtype:
        return _triton_ops().paged_attention(*args, sliding_window=sliding_window)
    return torch_ops.paged_attention(*args, plan=plan, sliding_window=sliding_window)
