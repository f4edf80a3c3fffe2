"""paged_attention: both backends against the simple reference and against contiguous SDPA.

Every batch comes from `build_batch`: permuted physical blocks, NaN in every slot no
sequence owns, and block-table padding pointing at a NaN guard block.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import pagedinfer.kernels as kernels

# One call holding every kind of sequence: a decode, a full prefill, a chunked prefill
# (12 new tokens after 28), a prefill after a block-aligned prefix-cache hit (8 after
# 32), a long decode and a tiny prefill.
MIXED_SEQ_LENS = [7, 33, 40, 40, 50, 3]
MIXED_QUERY_LENS = [1, 33, 12, 8, 1, 3]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(2, 2), (9, 3), (8, 2), (8, 1)],
    ids=["group1", "group3", "group4", "group8"],
)
def test_gqa_groups_match_reference(
    backend: ModuleType, make_batch: Callable, num_heads: int, num_kv_heads: int
) -> None:
    batch = make_batch(
        MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    batch.assert_matches_reference(backend.paged_attention(*batch.args()))


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_sizes_and_head_dims_match_reference(
    backend: ModuleType, make_batch: Callable, block_size: int, head_dim: int
) -> None:
    batch = make_batch(
        [9, 21, 17], [1, 21, 6], head_dim=head_dim, block_size=block_size, num_heads=6
    )
    batch.assert_matches_reference(backend.paged_attention(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_matches_reference(
    backend: ModuleType, make_batch: Callable, dtype: torch.dtype
) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=9, num_kv_heads=3, dtype=dtype)
    out = backend.paged_attention(*batch.args())
    assert out.dtype == dtype
    batch.assert_matches_reference(out)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-compute", "fp32-compute"])
def test_cpu_bf16_computes_natively_or_in_fp32(
    make_batch: Callable, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """The torch path computes bf16 in bf16 where the CPU has it natively, in fp32
    elsewhere: both must agree with the reference, whichever CPU runs the test."""
    from pagedinfer.kernels import torch_ops

    monkeypatch.setattr(torch_ops, "native_bf16", lambda: native)
    expected = torch.bfloat16 if native else torch.float32
    assert torch_ops.compute_dtype(torch.bfloat16, torch.bfloat16) == expected
    assert torch_ops.compute_dtype(torch.float16, torch.float16) == torch.float32
    batch = make_batch(
        MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=9, num_kv_heads=3, dtype=torch.bfloat16
    )
    out = torch_ops.paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    batch.assert_matches_reference(out)


def test_minus_one_table_padding_is_never_read(backend: ModuleType, make_batch: Callable) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, table_padding="minus_one")
    batch.assert_matches_reference(backend.paged_attention(*batch.args()))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode_matches_reference(make_batch: Callable, num_splits: int) -> None:
    from pagedinfer.kernels import triton_ops

    # Seven splits of 64-position tiles leave some splits of the short sequence empty.
    batch = make_batch([150, 9, 64], [1, 1, 1], num_heads=9, num_kv_heads=3)
    out = triton_ops.paged_attention(*batch.args(), num_splits=num_splits)
    batch.assert_matches_reference(out)


def test_split_kv_works_for_prefill_too(make_batch: Callable) -> None:
    from pagedinfer.kernels import triton_ops

    batch = make_batch([70, 40], [20, 40], num_heads=4, num_kv_heads=2)
    batch.assert_matches_reference(triton_ops.paged_attention(*batch.args(), num_splits=3))


def test_split_heuristic_only_splits_small_long_decode_batches() -> None:
    from pagedinfer.kernels.triton_ops import choose_num_splits

    gpu = torch.device("cuda")
    cpu = torch.device("cpu")
    assert choose_num_splits(8, 8, 8, 32768, cpu) == 1  # enough programs for one "SM"
    assert choose_num_splits(40, 8, 8, 32768, cpu) == 1  # prefill work
    assert choose_num_splits(1, 1, 1, 512, cpu) == 1  # short context
    if torch.cuda.is_available():
        assert choose_num_splits(1, 1, 8, 32768, gpu) > 1


def test_paged_equals_contiguous_sdpa(backend: ModuleType, make_batch: Callable) -> None:
    """Paging only moves K/V around: the result is attention over the same K/V laid out
    contiguously, with the new tokens causal against the end of their context."""
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, num_heads=9, num_kv_heads=3)
    out = backend.paged_attention(*batch.args()).cpu()
    starts = batch.query_start_loc.tolist()
    for seq, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[seq] : starts[seq + 1]].cpu()
        num_new, seq_len = q.shape[0], key.shape[0]
        causal = torch.ones(num_new, seq_len, dtype=torch.bool).tril(seq_len - num_new)
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            attn_mask=causal,
            scale=batch.scale,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(
            out[starts[seq] : starts[seq + 1]], expected, atol=1e-5, rtol=1e-5
        )


def test_writes_into_out_and_returns_it(backend: ModuleType, make_batch: Callable) -> None:
    batch = make_batch([5, 12], [1, 12])
    out = torch.full_like(batch.query, 7.0)
    assert backend.paged_attention(*batch.args(), out) is out
    batch.assert_matches_reference(out)


def test_strided_query_and_out(backend: ModuleType, make_batch: Callable) -> None:
    """The model slices q out of a fused qkv projection, so query is not contiguous."""
    batch = make_batch([5, 12], [1, 12], num_heads=4, num_kv_heads=2)
    fused = torch.randn(batch.query.shape[0], 8, 64, device=batch.query.device)
    fused[:, 2:6] = batch.query
    batch.query = fused[:, 2:6]
    out_storage = torch.zeros(batch.query.shape[0], 4, 128, device=batch.query.device)
    out = out_storage[:, :, ::2]
    backend.paged_attention(*batch.args(), out)
    batch.assert_matches_reference(out)


def test_empty_batch(backend: ModuleType, make_batch: Callable) -> None:
    batch = make_batch([4], [0])
    out = backend.paged_attention(*batch.args())
    assert out.shape == (0, 6, 64)


def test_public_api_dispatches_and_checks(
    make_batch: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.use_triton(batch.query)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels.use_triton(batch.query) == batch.query.is_cuda
    batch.assert_matches_reference(kernels.paged_attention(*batch.args()))


def test_fresh_prompts_of_different_lengths(backend: ModuleType, make_batch: Callable) -> None:
    """Only new prompts, no earlier context: the padded rows of the shorter ones must not
    disturb anything."""
    batch = make_batch([20, 7, 33], [20, 7, 33], num_heads=9, num_kv_heads=3)
    batch.assert_matches_reference(backend.paged_attention(*batch.args()))


def test_lengths_spread_over_many_buckets(backend: ModuleType, make_batch: Callable) -> None:
    """Decodes and prefills of very different lengths (the torch path groups them by
    length) still land in their own output rows."""
    batch = make_batch(
        [5, 300, 700, 130, 3, 520], [1, 1, 1, 100, 3, 70], num_heads=4, num_kv_heads=2
    )
    batch.assert_matches_reference(backend.paged_attention(*batch.args()))


def test_decode_groups_respect_the_padding_budget(make_batch: Callable) -> None:
    """The torch path cuts decodes, sorted by context, wherever padding to the group's
    longest would pass DECODE_PAD_SLOTS; every row still lands in its own output."""
    from pagedinfer.kernels import torch_ops

    budget = torch_ops.DECODE_PAD_SLOTS
    top = 4 * budget
    # top - budget joins top's group exactly at the budget, one slot less does not.
    seq_lens = [top - budget - 1, 10, top, top - 2 * budget + 5, top - budget, 82]
    batch = make_batch(seq_lens, [1] * len(seq_lens), num_heads=9, num_kv_heads=3)
    plan = torch_ops.plan_attention(
        batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.k_cache.shape[1]
    )
    groups = [sorted(seq_lens[i] for i in g.query_rows.tolist()) for g in plan.groups]
    assert groups == [[3 * budget, top], [2 * budget + 5, 3 * budget - 1], [10, 82]]
    out = torch_ops.paged_attention(*batch.args(), plan=plan)
    batch.assert_matches_reference(out)
