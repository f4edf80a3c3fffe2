"""Deliberately simple reference for the kernel ops, used only by tests.

One Python loop per sequence, per context position (to fetch K/V through the block
table), per new token and per head: slow, but each line follows the contract's
definitions directly, so it is easy to check by reading.
Arithmetic is float64.

Sliding window W (as transformers' `sliding_window_causal_mask_function`): the token at
position p attends to the positions k with p - W < k <= p. Only positions some new token
can see are fetched, so block-table entries wholly before every window (freed blocks)
are never read.
"""

from __future__ import annotations

import math

import torch


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token]
        v_cache[slot // block_size, slot % block_size] = value[token]


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[seq].tolist()
        num_new = starts[seq + 1] - starts[seq]
        if num_new == 0:
            continue
        # The first position the earliest new token sees; nothing before it is fetched.
        first = 0
        if sliding_window is not None:
            first = max(0, seq_len - num_new - sliding_window + 1)
        # Context position p of this sequence lives at slot table[p // B], p % B.
        seen = range(first, seq_len)
        keys = torch.stack([k_cache[table[p // block_size], p % block_size] for p in seen])
        values = torch.stack([v_cache[table[p // block_size], p % block_size] for p in seen])
        keys, values = keys.double(), values.double()
        for i in range(num_new):
            token = starts[seq] + i
            position = seq_len - num_new + i  # the new tokens are the last positions
            lo = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            for head in range(num_heads):
                kv_head = head // group
                scores = keys[:, kv_head] @ query[token, head].double() * scale
                scores[position + 1 - first :] = -math.inf  # causal: nothing after this token
                scores[: max(lo - first, 0)] = -math.inf  # nothing before its window
                weights = torch.softmax(scores, dim=0)
                out[token, head] = (weights @ values[:, kv_head]).to(query.dtype)
    return out
