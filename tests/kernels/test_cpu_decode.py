"""The compiled CPU decode kernel: what it serves, what it reads, and how it falls back.

Batches come from `build_batch`: permuted physical blocks and NaN in every slot that no
sequence owns, so a kernel that reads past a sequence's length returns NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pagedinfer.kernels import torch_ops
from pagedinfer.kernels.cpu import paged_decode

# Lengths around block edges (16-token blocks): one token, a block minus one, exactly one
# and two blocks, one past, and a long context of many blocks.
EDGE_LENS = [1, 15, 16, 17, 32, 33, 250]


def decode_batch(make_batch: Callable, seq_lens: list[int], **kwargs: object):
    return make_batch(seq_lens, [1] * len(seq_lens), **kwargs)


def run_compiled(batch) -> tuple[torch.Tensor, torch_ops.AttentionPlan]:
    plan = torch_ops.plan_attention(
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.k_cache.shape[1],
        compiled=True,
    )
    return torch_ops.paged_attention(*batch.args(), plan=plan), plan


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 64, 16), (8, 1, 128, 16), (6, 2, 64, 5), (4, 2, 32, 1)],
    ids=["smollm2", "mha", "group8-d128", "block5", "block1"],
)
def test_decodes_match_reference_at_every_shape(
    make_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = decode_batch(
        make_batch,
        EDGE_LENS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    out, plan = run_compiled(batch)
    assert plan.groups == []  # every sequence went to the compiled kernel
    batch.assert_matches_reference(out)


def test_stale_slots_and_unused_table_entries_are_never_read(make_batch: Callable) -> None:
    # NaN fills every slot past each length; -1 pads the block tables.
    batch = decode_batch(make_batch, [5, 16, 21], table_padding="minus_one")
    out, _ = run_compiled(batch)
    batch.assert_matches_reference(out)


def test_large_scores_stay_finite_and_exact(make_batch: Callable) -> None:
    # Scores of hundreds: the online softmax must subtract the running max before exp.
    batch = decode_batch(make_batch, [40, 200], seed=3)
    batch.query.mul_(40.0)
    out, _ = run_compiled(batch)
    batch.assert_matches_reference(out)


def test_mixed_batch_sends_longer_prefills_to_the_gather_path(make_batch: Callable) -> None:
    # Past COMPILED_MAX_QUERY (17) new tokens a sequence is a prefill for SDPA.
    seq_lens, query_lens = [7, 33, 40, 50, 18, 90], [1, 33, 20, 1, 18, 1]
    batch = make_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3)
    out, plan = run_compiled(batch)
    starts = batch.query_start_loc.tolist()
    # Longest context first, so that the threads' round-robin shares are even.
    assert plan.decodes.query_rows.tolist() == [starts[5], starts[3], starts[0]]
    assert plan.decodes.seq_lens.tolist() == [90, 50, 7]
    assert all(not g.decode for g in plan.groups)
    batch.assert_matches_reference(out)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_the_same_output(make_batch: Callable, threads: int) -> None:
    batch = decode_batch(make_batch, EDGE_LENS, num_heads=9, num_kv_heads=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _ = run_compiled(batch)
    finally:
        torch.set_num_threads(before)
    batch.assert_matches_reference(out)


def test_only_fp32_cpu_tensors_take_the_kernel(
    make_batch: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEDINFER_CPU_KERNELS", raising=False)
    fp32 = decode_batch(make_batch, [20])
    bf16 = decode_batch(make_batch, [20], dtype=torch.bfloat16)
    assert torch_ops.compiled_decode(fp32.query, fp32.k_cache, fp32.v_cache)
    assert not torch_ops.compiled_decode(bf16.query, bf16.k_cache, bf16.v_cache)
    strided = fp32.k_cache.transpose(1, 2)
    assert not paged_decode.supports(fp32.query, strided, strided)
    tracked = fp32.query.clone().requires_grad_()
    assert not paged_decode.supports(tracked, fp32.k_cache, fp32.v_cache)
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")
    assert not torch_ops.compiled_decode(fp32.query, fp32.k_cache, fp32.v_cache)


def test_without_a_plan_fp32_decodes_take_the_kernel_and_others_the_gather(
    make_batch: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEDINFER_CPU_KERNELS", raising=False)
    calls = []
    real = paged_decode.decode_job
    monkeypatch.setattr(paged_decode, "decode_job", lambda *args: calls.append(1) or real(*args))
    fp32 = decode_batch(make_batch, [20, 40])
    fp32.assert_matches_reference(torch_ops.paged_attention(*fp32.args()))
    assert calls == [1]
    bf16 = decode_batch(make_batch, [20, 40], dtype=torch.bfloat16)
    torch_ops.paged_attention(*bf16.args())
    assert calls == [1]


def as_bf16_cache(batch):
    """The batch with bf16 caches (NaN where it had NaN) beside fp32 queries, and the fp32
    batch whose caches hold exactly those bf16 values."""
    k16, v16 = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    widened = dataclasses.replace(batch, k_cache=k16.float(), v_cache=v16.float())
    return dataclasses.replace(batch, k_cache=k16, v_cache=v16), widened


@pytest.mark.parametrize("plan", ["compiled", "default"])
def test_fp32_queries_over_a_bf16_cache_get_the_bits_of_its_values_widened(
    make_batch: Callable, plan: str
) -> None:
    # A model served with bf16 products: fp32 new tokens, K/V kept in bf16. The kernel
    # widens each block's values exactly, so the bits are those of the fp32 cache that
    # holds them; without a plan the torch path sends the same tensors to the kernel.
    batch = decode_batch(make_batch, EDGE_LENS, num_heads=9, num_kv_heads=3)
    bf16, widened = as_bf16_cache(batch)
    assert paged_decode.supports(bf16.query, bf16.k_cache, bf16.v_cache, bf16.query)
    if plan == "compiled":
        out, used = run_compiled(bf16)
        assert used.groups == []
        assert torch.equal(out, run_compiled(widened)[0])
    else:
        out = torch_ops.paged_attention(*bf16.args())
        assert torch.equal(out, torch_ops.paged_attention(*widened.args()))
    assert not out.isnan().any()
    mixed = dataclasses.replace(bf16, v_cache=batch.v_cache)  # a bf16 K beside an fp32 V
    assert not paged_decode.supports(mixed.query, mixed.k_cache, mixed.v_cache)


def test_a_compiled_plan_with_tensors_it_cannot_serve_is_refused(make_batch: Callable) -> None:
    fp32 = decode_batch(make_batch, [20])
    bf16 = decode_batch(make_batch, [20], dtype=torch.bfloat16)
    _, plan = run_compiled(fp32)
    with pytest.raises(ValueError, match="plan: compiled decodes"):
        torch_ops.paged_attention(*bf16.args(), plan=plan)


def test_reads_and_writes_only_its_rows_of_strided_query_and_out(make_batch: Callable) -> None:
    # As in the model: query is a view into the q/k/v GEMM's output (rows further apart
    # than one query row), and the kernel writes its rows of `out` in place.
    batch = decode_batch(make_batch, EDGE_LENS, num_heads=9, num_kv_heads=3)
    num_tokens, num_heads, head_dim = batch.query.shape
    wide = torch.full((num_tokens, (num_heads + 6) * head_dim), float("nan"))
    wide[:, : num_heads * head_dim] = batch.query.reshape(num_tokens, -1)
    query = wide[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not query.is_contiguous()
    plan = torch_ops.plan_attention(
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.k_cache.shape[1],
        compiled=True,
    )
    decodes = plan.decodes
    every_other = slice(0, None, 2)
    out = torch.full_like(batch.query, -7.0)
    paged_decode.decode_attention(
        query,
        batch.k_cache,
        batch.v_cache,
        decodes.query_rows[every_other],
        decodes.block_tables[every_other],
        decodes.seq_lens[every_other],
        batch.scale,
        out,
    )
    written = sorted(decodes.query_rows[every_other].tolist())
    untouched = [r for r in range(num_tokens) if r not in written]
    assert torch.all(out[untouched] == -7.0)
    full = torch_ops.paged_attention(*batch.args(), plan=plan)
    batch.assert_matches_reference(full)
    torch.testing.assert_close(out[written], full[written], rtol=0, atol=0)
