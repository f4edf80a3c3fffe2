"""Argument checks shared by every backend.

Every problem raises ValueError naming the offending argument, before any kernel runs.
Shape, dtype and device checks read only tensor metadata. Value checks (query spans,
block-table width, block ids in range for the blocks some new token reads: with a
sliding window, not those wholly before it) read the index tensors; on a GPU that costs one
host sync, which callers that build the metadata themselves can skip with
`check_values=False`.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(name, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(name, f"dtype {t.dtype} not supported (expected one of {list(dtypes)})")


def _check_rows_dtype(name: str, t: torch.Tensor, cache_name: str, cache: torch.Tensor) -> None:
    """New tokens' rows are the cache's dtype, or fp32 over a bf16 cache on CPU (a model
    served with bf16 products keeps bf16 K/V and computes in fp32)."""
    mixed = t.dtype == torch.float32 and cache.dtype == torch.bfloat16
    if t.dtype != cache.dtype and not (mixed and cache.device.type == "cpu"):
        _fail(name, f"dtype {t.dtype} != {cache_name} dtype {cache.dtype}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        _fail(name, f"is on {t.device}, but the KV cache is on {device}")


def check_cache_pair(k_cache: object, v_cache: object) -> None:
    """k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same everything."""
    _check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        _fail("v_cache", f"is on {v_cache.device}, but k_cache is on {k_cache.device}")
    if min(k_cache.shape) == 0 and k_cache.shape[0] != 0:
        _fail("k_cache", f"has an empty dimension: {tuple(k_cache.shape)}")


def check_write_kv(
    key: object,
    value: object,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: object,
    check_values: bool = True,
) -> None:
    """Validate the arguments of `write_kv`."""
    check_cache_pair(k_cache, v_cache)
    _check_tensor("key", key, 3, FLOAT_DTYPES)
    _check_tensor("value", value, 3, FLOAT_DTYPES)
    _check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    assert isinstance(slot_mapping, torch.Tensor)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim):
        _fail(
            "key",
            f"shape {tuple(key.shape)} does not match the cache's "
            f"[num_tokens, {num_kv_heads}, {head_dim}]",
        )
    if value.shape != key.shape:
        _fail("value", f"shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _check_rows_dtype("key", key, "k_cache", k_cache)
    _check_rows_dtype("value", value, "v_cache", v_cache)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail("slot_mapping", f"has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        _check_device(name, t, k_cache.device)
    if check_values and slot_mapping.numel() > 0:
        num_slots = num_blocks * block_size
        lo, hi = slot_mapping.aminmax()
        if int(lo) < -1 or int(hi) >= num_slots:
            _fail(
                "slot_mapping", f"slots must lie in [-1, {num_slots}), got [{int(lo)}, {int(hi)}]"
            )


def check_paged_attention(
    query: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    query_start_loc: object,
    scale: object,
    out: object,
    check_values: bool = True,
    sliding_window: object = None,
) -> None:
    """Validate the arguments of `paged_attention`."""
    check_sliding_window(sliding_window)
    check_cache_pair(k_cache, v_cache)
    _check_tensor("query", query, 3, FLOAT_DTYPES)
    _check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    _check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    assert isinstance(query, torch.Tensor) and isinstance(k_cache, torch.Tensor)
    assert isinstance(block_tables, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
    assert isinstance(query_start_loc, torch.Tensor)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        _fail("query", f"head_dim {q_head_dim} != the cache's head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        _fail("query", f"{num_heads} heads is not a multiple of the {num_kv_heads} KV heads")
    _check_rows_dtype("query", query, "k_cache", k_cache)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc.shape[0] != num_seqs + 1:
        _fail(
            "query_start_loc",
            f"has {query_start_loc.shape[0]} entries, expected num_seqs + 1 = {num_seqs + 1}",
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail("scale", f"expected a Python float, got {type(scale).__name__}")
    names = ("query", "block_tables", "seq_lens", "query_start_loc")
    for name, t in zip(names, (query, block_tables, seq_lens, query_start_loc), strict=True):
        _check_device(name, t, k_cache.device)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail("out", f"expected a torch.Tensor, got {type(out).__name__}")
        assert isinstance(out, torch.Tensor)
        if out.shape != query.shape:
            _fail("out", f"shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
        if out.dtype != query.dtype:
            _fail("out", f"dtype {out.dtype} != query dtype {query.dtype}")
        _check_device("out", out, k_cache.device)
    if check_values:
        _check_paged_values(
            num_tokens,
            num_blocks,
            block_size,
            block_tables,
            seq_lens,
            query_start_loc,
            sliding_window if isinstance(sliding_window, int) else None,
        )


def check_sliding_window(sliding_window: object) -> None:
    """sliding_window: None (full attention) or a positive int, the window in tokens."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        _fail(
            "sliding_window",
            f"expected a positive int or None, got {type(sliding_window).__name__}",
        )
    if sliding_window < 1:
        _fail("sliding_window", f"must be at least 1, got {sliding_window}")


def first_visible_block(
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """int64 per sequence: the first block-table column any of its new tokens reads.

    0 without a window; with window W, the block of position len - qlen - W + 1, the
    earliest new token's first visible position. Columns before it may hold anything
    (the blocks of a freed window) and are never read.
    """
    if sliding_window is None:
        return torch.zeros_like(seq_lens, dtype=torch.long)
    first = (seq_lens.long() - query_lens.long() - sliding_window + 1).clamp(min=0)
    return first // block_size


def _check_paged_values(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sliding_window: int | None,
) -> None:
    # Everything is folded into one small CPU tensor so a GPU pays a single sync.
    qsl = query_start_loc.long()
    lens = seq_lens.long()
    query_lens = qsl[1:] - qsl[:-1]
    blocks_needed = (lens + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    needed = cols[None, :] < blocks_needed[:, None]
    if sliding_window is not None:
        first = first_visible_block(lens, query_lens, block_size, sliding_window)
        needed &= cols[None, :] >= first[:, None]
    bad_ids = needed & ((block_tables < 0) | (block_tables >= num_blocks))
    zero = torch.zeros((), dtype=torch.long, device=qsl.device)
    flags = torch.stack(
        [
            qsl[0] if qsl.numel() else zero,
            qsl[-1] if qsl.numel() else zero,
            (query_lens < 0).any().long(),
            (query_lens > lens).any().long(),
            (lens < 0).any().long(),
            blocks_needed.max() if lens.numel() else zero,
            bad_ids.any().long(),
        ]
    ).tolist()
    first, last, backwards, too_many, negative, max_blocks, bad = flags
    if first != 0 or last != num_tokens:
        _fail(
            "query_start_loc",
            f"must start at 0 and end at num_tokens = {num_tokens}, got {first}..{last}",
        )
    if backwards:
        _fail("query_start_loc", "must be non-decreasing")
    if negative:
        _fail("seq_lens", "must be non-negative")
    if too_many:
        _fail("seq_lens", "a sequence has more query tokens than context tokens")
    if max_blocks > block_tables.shape[1]:
        _fail(
            "block_tables",
            f"has {block_tables.shape[1]} columns, but a sequence needs {max_blocks} blocks",
        )
    if bad:
        _fail("block_tables", f"holds a block id outside [0, {num_blocks}) for a used block")
