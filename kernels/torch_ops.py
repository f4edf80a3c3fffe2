"""Vectorised torch path for CPU: the backend the model uses when it runs without a GPU.

No Python loop per token or block. Sequences are split into two groups, decodes (one
new token) and prefills (more than one), so a long prefill chunk does not pad every
decode to its query length. Each group gathers its K/V blocks through the block
tables in one `index_select`, pads to the group's longest context, zeroes the padding
(unwritten slots may hold NaN, and a -inf score does not stop 0 * NaN), and runs one
batched scaled_dot_product_attention with a causal mask. GQA runs without repeating
K/V: the query heads of one KV head are folded into the query-length dimension.
Arithmetic is fp32 (bf16/fp16 matmuls are slow on CPU); the output takes query's dtype.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value rows at their slots; slot -1 is padding and is skipped."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the packed new tokens over their paged contexts (see the package doc)."""
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    qsl = query_start_loc.long()
    seq_lens = seq_lens.long()
    query_lens = qsl[1:] - qsl[:-1]
    groups = (query_lens == 1, query_lens > 1)
    for members in groups:
        seq_ids = members.nonzero().flatten()
        if seq_ids.numel() > 0:
            _attend_group(
                query,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                qsl,
                query_lens,
                seq_ids,
                scale,
                out,
            )
    return out


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qsl: torch.Tensor,
    query_lens: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    lens = seq_lens[seq_ids]
    qlens = query_lens[seq_ids]
    num_seqs = seq_ids.numel()
    max_q = int(qlens.max())
    num_ctx_blocks = (int(lens.max()) + block_size - 1) // block_size
    ctx = num_ctx_blocks * block_size

    # K/V: whole blocks in one gather; table entries past a sequence's end may be
    # anything, so they are redirected to block 0 and zeroed with the other padding.
    table = block_tables[seq_ids, :num_ctx_blocks].long()
    cols = torch.arange(num_ctx_blocks, device=table.device)
    used = cols[None, :] * block_size < lens[:, None]
    table = torch.where(used, table, 0).flatten()
    key = _gather_blocks(k_cache, table, "key").view(num_seqs * ctx, num_kv_heads * head_dim)
    value = _gather_blocks(v_cache, table, "value").view(num_seqs * ctx, num_kv_heads * head_dim)
    positions = torch.arange(ctx, device=table.device)
    padding = (positions[None, :] >= lens[:, None]).flatten().nonzero().flatten()
    key.index_fill_(0, padding, 0.0)
    value.index_fill_(0, padding, 0.0)
    key = key.view(num_seqs, ctx, num_kv_heads, head_dim)
    value = value.view(num_seqs, ctx, num_kv_heads, head_dim)
    key = key.transpose(1, 2)  # [seqs, kv_heads, ctx, head_dim]
    value = value.transpose(1, 2)

    # Queries: rows (query head in group, token) of one KV head share its K/V.
    q_offsets = torch.arange(max_q, device=table.device)
    q_valid = q_offsets[None, :] < qlens[:, None]
    tokens = torch.where(q_valid, qsl[seq_ids][:, None] + q_offsets, 0)
    q = query[tokens]  # [seqs, max_q, heads, head_dim]
    if q.dtype != torch.float32:
        q = q.float()
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * max_q, head_dim)

    # Causal mask: query i of a sequence sits at position len - qlen + i.
    q_pos = (lens - qlens)[:, None] + q_offsets
    mask = positions[None, None, :] <= q_pos[:, :, None]  # [seqs, max_q, ctx]
    mask = (
        mask[:, None].expand(num_seqs, group, max_q, ctx).reshape(num_seqs, 1, group * max_q, ctx)
    )

    o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    o = o.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_seqs, max_q, num_heads, head_dim)
    out[tokens[q_valid]] = o[q_valid].to(out.dtype)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, name: str) -> torch.Tensor:
    """cache[table] in fp32, as [len(table), block_size, kv_heads, head_dim], in scratch."""
    shape = (table.numel(), *cache.shape[1:])
    if cache.dtype == torch.float32 and cache[0].is_contiguous():
        buffer = _scratch.get(name, shape, cache.device)
        return torch.index_select(
            cache.view(cache.shape[0], -1), 0, table, out=buffer.view(shape[0], -1)
        )
    return _scratch.get(name, shape, cache.device).copy_(cache[table])


class _Scratch(threading.local):
    """Grow-only fp32 buffers for the gathered K/V, one set per thread.

    Reusing them matters: a fresh tensor of tens of MB comes from mmap, and touching its
    pages for the first time costs more page faults (a kernel zeroing each 4 KiB page)
    than the gather itself. The buffers never escape a call, and threads do not share them.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.buffers.get((name, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel + numel // 4, dtype=torch.float32, device=device)
            self.buffers[name, device] = buffer
        return buffer[:numel].view(shape)


_scratch = _Scratch()
