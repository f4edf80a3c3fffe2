"""Vectorised torch path for CPU: the backend the model uses when it runs without a GPU.

No Python loop per token or block. Sequences are grouped so that padding stays cheap:
decodes (one new token) apart from prefills, and lengths in power-of-two buckets (a
batch of decodes with contexts from 50 to 2000 tokens is not all padded to 2000). Each
group gathers its K/V blocks through the block tables in one `index_select`, pads to
the group's longest context, zeroes the padding (unwritten slots may hold NaN, and a
-inf score does not stop 0 * NaN), and runs one batched scaled_dot_product_attention:
- decodes fold the query heads of one KV head into the query-length dimension, so each
  K/V row is read once per KV head, not once per query head;
- prefills use SDPA's own GQA with a mask for the causal offset (the new tokens are
  the last positions of the context), or is_causal when no sequence has earlier
  context (a fresh prompt), which lets the kernel skip the masked half.
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
    starts = query_start_loc.long()
    seq_lens = seq_lens.long()
    query_lens = starts[1:] - starts[:-1]
    for seq_ids in _length_groups(query_lens, seq_lens):
        lens, qlens = seq_lens[seq_ids], query_lens[seq_ids]
        key, value = _gather_context(k_cache, v_cache, block_tables[seq_ids], lens)
        # tokens[s, i]: the query row of new token i of sequence s (0 where s has fewer).
        offsets = torch.arange(int(qlens.max()), device=lens.device)
        valid = offsets[None, :] < qlens[:, None]
        tokens = torch.where(valid, starts[seq_ids][:, None] + offsets, 0)
        q = query[tokens].float()  # [seqs, max_new, heads, head_dim]
        if offsets.numel() == 1:
            o = _decode(q, key, value, lens, scale)
        else:
            o = _prefill(q, key, value, lens, qlens, scale)
        out[tokens[valid]] = o[valid].to(out.dtype)
    return out


def _length_groups(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Sequence ids in groups that pad cheaply: decodes apart from prefills, and within
    each, lengths in the same power-of-two bucket, so padding to the group's longest
    at most doubles the work. Short lengths share one bucket: a group costs a few
    hundred microseconds of fixed overhead. Sequences with no new tokens are dropped.
    """
    context_bucket = _log2_bucket(seq_lens, smallest=256)
    query_bucket = torch.where(query_lens == 1, 0, _log2_bucket(query_lens, smallest=64))
    key = torch.where(query_lens > 0, query_bucket * 64 + context_bucket, -1)
    return [(key == k).nonzero().flatten() for k in key.unique().tolist() if k >= 0]


def _log2_bucket(lengths: torch.Tensor, smallest: int) -> torch.Tensor:
    """ceil(log2(length)), with every length up to `smallest` in one bucket."""
    return torch.log2(lengths.clamp(min=smallest).double()).ceil().long()


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence, fp32 [seqs, ctx, kv_heads, head_dim], zero past its end."""
    num_seqs = lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_ctx_blocks = (int(lens.max()) + block_size - 1) // block_size
    ctx = num_ctx_blocks * block_size
    # Whole blocks in one gather. Table entries past a sequence's end may hold anything,
    # so they are redirected to block 0, whose rows are then zeroed with the padding.
    table = block_tables[:, :num_ctx_blocks].long()
    used = torch.arange(num_ctx_blocks, device=lens.device)[None, :] * block_size < lens[:, None]
    table = torch.where(used, table, 0).flatten()
    key = _gather_blocks(k_cache, table, "key").view(num_seqs * ctx, -1)
    value = _gather_blocks(v_cache, table, "value").view(num_seqs * ctx, -1)
    padding = (
        (torch.arange(ctx, device=lens.device)[None, :] >= lens[:, None])
        .flatten()
        .nonzero()
        .flatten()
    )
    key.index_fill_(0, padding, 0.0)
    value.index_fill_(0, padding, 0.0)
    shape = (num_seqs, ctx, num_kv_heads, head_dim)
    return key.view(shape), value.view(shape)


def _decode(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [seqs, 1, heads, head_dim] -> the same shape."""
    num_seqs, _, num_heads, head_dim = q.shape
    ctx, num_kv_heads = key.shape[1], key.shape[2]
    # The group's heads become the query rows of their KV head: K/V are read once per
    # KV head. (SDPA's enable_gqa reads them once per query head: slower here.)
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    visible = (torch.arange(ctx, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=visible, scale=scale
    )
    return o.reshape(num_seqs, 1, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: torch.Tensor,
    qlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [seqs, max_new, heads, head_dim] -> the same shape."""
    ctx = key.shape[1]
    q, key, value = q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if bool((qlens == lens).all()):
        # Fresh prompts: new token i sees positions <= i. Padding rows (i >= qlen) see
        # zeroed K/V and are discarded.
        o = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # New token i of a sequence sits at position len - qlen + i.
        positions = (lens - qlens)[:, None] + torch.arange(q.shape[2], device=lens.device)
        visible = (torch.arange(ctx, device=lens.device)[None, None, :] <= positions[:, :, None])[
            :, None
        ]
        o = F.scaled_dot_product_attention(
            q, key, value, attn_mask=visible, scale=scale, enable_gqa=True
        )
    return o.transpose(1, 2)


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
