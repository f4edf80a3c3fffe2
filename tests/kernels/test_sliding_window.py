"""Sliding-window paged attention: every backend against the reference and against
transformers' own sliding-window causal mask, with the blocks before each window freed.

A query at position p sees the positions k with p - W < k <= p. Batches come from
`build_batch` (permuted blocks, NaN wherever no sequence wrote); `free_outside_window`
then frees what a windowed model frees: the block-table columns wholly before the window
of each sequence's earliest new token become -1, and their blocks are filled with NaN,
so a backend that reads one of them fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pagedinfer.kernels as kernels
from pagedinfer.kernels.metadata import AttentionMetadata
from pagedinfer.kernels.reference import paged_attention_reference
from pagedinfer.kernels.validation import first_visible_block

# A decode past the window, a prompt longer than the window, a chunked prefill whose
# chunk starts past the window (12 new after 28), a prefill after a prefix-cache hit
# (8 after 32), a long decode and a prompt shorter than any window tried.
# As the suite's conftest: one ulp or so of each dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

MIXED_SEQ_LENS = [37, 33, 40, 40, 70, 3]
MIXED_QUERY_LENS = [1, 33, 12, 8, 1, 3]


def free_outside_window(batch: Any, window: int, fill: int = -1) -> int:
    """Free the blocks no new token of the batch can see: their block-table entries
    become `fill` and their cache slots NaN. Returns how many were freed."""
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.long()
    first = first_visible_block(batch.seq_lens, starts[1:] - starts[:-1], block_size, window)
    freed = 0
    for seq, num_freed in enumerate(first.tolist()):
        for col in range(num_freed):
            block = int(batch.block_tables[seq, col])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            batch.block_tables[seq, col] = fill
            freed += 1
    return freed


def expected(batch: Any, window: int | None) -> torch.Tensor:
    return paged_attention_reference(
        *(t.cpu() if torch.is_tensor(t) else t for t in batch.args()), sliding_window=window
    )


def assert_close(batch: Any, out: torch.Tensor, window: int | None) -> None:
    tol = TOLERANCE[batch.query.dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(
        out.cpu().float(), expected(batch, window).float(), atol=tol, rtol=tol
    )


def run(backend: ModuleType, batch: Any, window: int | None, **kwargs) -> torch.Tensor:
    return backend.paged_attention(*batch.args(), sliding_window=window, **kwargs)


@pytest.mark.parametrize("window", [1, 5, 16, 30])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_windowed_mixed_batch_matches_reference(
    backend: ModuleType, make_batch: Callable, window: int, num_heads: int, num_kv_heads: int
) -> None:
    batch = make_batch(
        MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    assert free_outside_window(batch, window) > 0  # every window here frees something
    assert_close(batch, run(backend, batch, window), window)


@pytest.mark.parametrize("block_size", [1, 5])
def test_windows_across_block_sizes(
    backend: ModuleType, make_batch: Callable, block_size: int
) -> None:
    """Windows that start mid-block, over tiny blocks (many freed table entries)."""
    batch = make_batch([23, 30, 19], [1, 9, 19], block_size=block_size, head_dim=32)
    free_outside_window(batch, 7)
    assert_close(batch, run(backend, batch, 7), 7)


def test_freed_blocks_may_point_anywhere(backend: ModuleType, make_batch: Callable) -> None:
    """A freed entry may also name a block some other request now fills (here: NaN)."""
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS)
    guard = int(batch.block_tables[0, -1])  # the NaN guard block of build_batch
    free_outside_window(batch, 9, fill=guard)
    assert_close(batch, run(backend, batch, 9), 9)


def test_window_at_least_the_context_is_full_attention(
    backend: ModuleType, make_batch: Callable
) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=6, num_kv_heads=2)
    full = backend.paged_attention(*batch.args())
    torch.testing.assert_close(run(backend, batch, max(MIXED_SEQ_LENS)), full)
    # One short of the longest context: only the 70-token decode (row 54) changes.
    out = run(backend, batch, max(MIXED_SEQ_LENS) - 1)
    assert_close(batch, out, max(MIXED_SEQ_LENS) - 1)
    assert not torch.equal(out[54], full[54])
    torch.testing.assert_close(out[:54], full[:54])
    torch.testing.assert_close(out[55:], full[55:])


def test_decode_past_the_window_sees_exactly_the_last_w_positions(
    backend: ModuleType, make_batch: Callable
) -> None:
    """A decode at position 99 with W = 20 equals full attention over positions 80..99
    alone, wherever those 20 K/V rows sit."""
    batch = make_batch([100], [1], num_heads=4, num_kv_heads=2)
    free_outside_window(batch, 20)
    out = run(backend, batch, 20).cpu()
    q = batch.query.cpu().transpose(0, 1)
    key, value = (t[80:].transpose(0, 1) for t in (batch.keys[0], batch.values[0]))
    direct = F.scaled_dot_product_attention(
        q, key, value, scale=batch.scale, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, direct, atol=1e-5, rtol=1e-5)


def test_matches_transformers_sliding_window_mask(
    backend: ModuleType, make_batch: Callable
) -> None:
    """The window's edges are transformers' own: its sliding-window causal mask function,
    applied to the contiguous K/V of each sequence, gives the same attention."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    window = 6
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=6, num_kv_heads=2)
    free_outside_window(batch, window)
    out = run(backend, batch, window).cpu()
    mask_of = sliding_window_causal_mask_function(window)
    starts = batch.query_start_loc.tolist()
    for seq, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[seq] : starts[seq + 1]].cpu()
        seq_len = key.shape[0]
        q_idx = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        mask = mask_of(0, 0, q_idx, torch.arange(seq_len)[None, :])
        direct = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            attn_mask=mask,
            scale=batch.scale,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[seq] : starts[seq + 1]], direct, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_prefill(backend: ModuleType, make_batch: Callable) -> None:
    """A 45-token prompt in chunks of 20, 20 and 5 (each chunk's earlier blocks freed)
    gives the rows a single prefill gives."""
    window = 11
    whole = make_batch([45], [45], num_heads=4, num_kv_heads=2)
    reference = run(backend, whole, window).cpu()
    assert_close(whole, reference, window)
    for done, chunk in ((0, 20), (20, 20), (40, 5)):
        # The same cache up to the chunk's end, the chunk's queries.
        part = dataclasses.replace(
            whole,
            query=whole.query[done : done + chunk],
            k_cache=whole.k_cache.clone(),
            v_cache=whole.v_cache.clone(),
            block_tables=whole.block_tables.clone(),
            seq_lens=torch.tensor([done + chunk], dtype=torch.int32, device=whole.query.device),
            query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=whole.query.device),
        )
        assert free_outside_window(part, window) == max(done - window + 1, 0) // 16
        rows = run(backend, part, window).cpu()
        torch.testing.assert_close(rows, reference[done : done + chunk], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_window(
    backend: ModuleType, make_batch: Callable, dtype: torch.dtype
) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=6, num_kv_heads=3, dtype=dtype)
    free_outside_window(batch, 10)
    out = run(backend, batch, 10)
    assert out.dtype == dtype
    assert_close(batch, out, 10)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_decode_with_window(make_batch: Callable, num_splits: int) -> None:
    """Split-KV over a window: splits cover only the window's tiles; some stay empty."""
    from pagedinfer.kernels import triton_ops

    batch = make_batch([300, 9, 140], [1, 1, 1], num_heads=4, num_kv_heads=2)
    free_outside_window(batch, 130)
    out = triton_ops.paged_attention(*batch.args(), num_splits=num_splits, sliding_window=130)
    assert_close(batch, out, 130)


def test_a_windowed_plan_sends_every_sequence_to_the_compiled_kernels(
    make_batch: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled CPU kernels take the window as an argument: a windowed plan gives them
    decodes and runs as a full one does, they read no freed block (-1 entries, NaN
    blocks), and a plan made for one window refuses to serve another."""
    from pagedinfer.kernels import torch_ops

    monkeypatch.delenv("PAGEDINFER_CPU_KERNELS", raising=False)
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=4, num_kv_heads=2)
    full = torch_ops.plan_for(*batch.args()[:6])
    windowed = torch_ops.plan_for(*batch.args()[:6], sliding_window=9)
    assert windowed.sliding_window == 9 and not windowed.groups
    assert windowed.decodes is not None and windowed.runs is not None
    assert windowed.decodes.query_rows.tolist() == full.decodes.query_rows.tolist()
    with pytest.raises(ValueError, match="plan: made for sliding_window=9"):
        torch_ops.paged_attention(*batch.args(), plan=windowed)
    assert free_outside_window(batch, 9) > 0
    assert_close(
        batch, torch_ops.paged_attention(*batch.args(), plan=windowed, sliding_window=9), 9
    )
    # Without verify runs, every token is a row of the decode kernel: the same bits, also
    # where a run's later tokens see nothing of a block its first token sees (window 3).
    for window in (3, 9):
        batch = make_batch([37, 40, 70, 3], [1, 12, 8, 3], num_heads=4, num_kv_heads=2)
        free_outside_window(batch, window)
        windowed = torch_ops.plan_for(*batch.args()[:6], sliding_window=window)
        assert windowed.runs is not None and windowed.runs.query_rows.size == 3
        rows = torch_ops.plan_attention(
            *batch.args()[3:6], batch.k_cache.shape[1], compiled=True, sliding_window=window
        )
        assert rows.runs is None and not rows.groups
        by_rows = torch_ops.paged_attention(*batch.args(), plan=rows, sliding_window=window)
        by_runs = torch_ops.paged_attention(*batch.args(), plan=windowed, sliding_window=window)
        assert torch.equal(by_rows, by_runs)
        assert_close(batch, by_runs, window)


def test_metadata_keeps_one_plan_per_window(make_batch: Callable) -> None:
    """Layers of different windows in one forward (Gemma 3's local and global layers)
    each reuse their own plan."""
    batch = make_batch([40, 70], [1, 5], num_heads=4, num_kv_heads=2)
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(6, dtype=torch.int64),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
    )
    q, k, v = batch.query, batch.k_cache, batch.v_cache
    local, full = attn.plan_for(q, k, v, sliding_window=8), attn.plan_for(q, k, v)
    assert local is not full
    assert local.sliding_window == 8 and full.sliding_window is None
    assert attn.plan_for(q, k, v, sliding_window=8) is local
    assert attn.plan_for(q, k, v) is full


def test_public_api_checks_values_only_inside_the_window(make_batch: Callable) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS)
    free_outside_window(batch, 9)
    assert_close(batch, kernels.paged_attention(*batch.args(), sliding_window=9), 9)
    # The freed entries are out of range for full attention, which reads them.
    with pytest.raises(ValueError, match="block_tables: holds a block id outside"):
        kernels.paged_attention(*batch.args())
    # An entry inside a window must still name a real block.
    batch.block_tables[4, 4] = -1  # the 70-token decode's last block
    with pytest.raises(ValueError, match="block_tables: holds a block id outside"):
        kernels.paged_attention(*batch.args(), sliding_window=9)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_window_is_refused(make_batch: Callable, bad: object) -> None:
    batch = make_batch([5, 12], [1, 12])
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.paged_attention(*batch.args(), sliding_window=bad)
