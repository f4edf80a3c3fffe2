"""The compiled verify kernel: runs of new tokens of one sequence, each K/V block read once
for all of them, and the plans that send tokens to it.

Batches come from `build_batch`: permuted physical blocks and NaN in every slot that no
sequence owns, so a run that reads past its last token's position returns NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pagedinfer.kernels import torch_ops

pytest.importorskip("numba", reason="the compiled verify kernel needs numba")

from pagedinfer.kernels.cpu import paged_verify

MAX_QUERY = torch_ops.COMPILED_MAX_QUERY
SHAPES = pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 8, 64, 16),
        (8, 1, 128, 16),
        (12, 3, 32, 16),
        (6, 2, 64, 5),
        (4, 2, 32, 1),
    ],
    ids=["smollm2", "mha", "group8-d128", "group4-d32", "block5", "block1"],
)


def context_lens(num_new: int) -> list[int]:
    """Contexts (16-token blocks) whose new tokens are all of it, end inside a block, end
    on its edge, straddle a block boundary, start on one, and follow a long context."""
    return [num_new, num_new + 5, 32, 16 + num_new // 2 + 1, 16 + num_new, 250]


def split_into_runs(batch, run_length: int) -> tuple[np.ndarray, ...]:
    """Every sequence's new tokens in runs of run_length (the last one shorter), as
    `verify_attention` takes them."""
    rows, counts, tables, lens = [], [], [], []
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        num_new = starts[seq + 1] - starts[seq]
        for offset in range(0, num_new, run_length):
            rows.append(starts[seq] + offset)
            counts.append(min(run_length, num_new - offset))
            tables.append(batch.block_tables[seq].tolist())
            lens.append(seq_len - num_new + 1 + offset)
    return (
        np.array(rows, dtype=np.int64),
        np.array(counts, dtype=np.int32),
        np.array(tables, dtype=np.int32),
        np.array(lens, dtype=np.int32),
    )


def run_kernel(batch, run_length: int, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan")) if out is None else out
    rows, counts, tables, lens = split_into_runs(batch, run_length)
    paged_verify.verify_attention(
        batch.query, batch.k_cache, batch.v_cache, rows, counts, tables, lens, batch.scale, out
    )
    return out


def default_plan(batch) -> torch_ops.AttentionPlan:
    """The plan `paged_attention` makes for the batch by default."""
    return torch_ops.plan_for(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
    )


def shape_kwargs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }


@SHAPES
def test_runs_of_every_length_match_the_reference_at_every_shape(
    make_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    longest = paged_verify.rows_per_run(num_heads, num_kv_heads, head_dim)
    assert longest >= 2
    for run_length in range(1, longest + 1):
        seq_lens = context_lens(run_length)
        batch = make_batch(
            seq_lens,
            [run_length] * len(seq_lens),
            seed=run_length,
            **shape_kwargs(num_heads, num_kv_heads, head_dim, block_size),
        )
        batch.assert_matches_reference(run_kernel(batch, run_length))


@SHAPES
def test_every_token_of_a_run_gets_the_same_bits_as_a_decode_of_its_own(
    make_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    # Speculative decoding must give exactly what decoding one token at a time gives.
    longest = paged_verify.rows_per_run(num_heads, num_kv_heads, head_dim)
    shape = shape_kwargs(num_heads, num_kv_heads, head_dim, block_size)
    for run_length in (2, longest):
        seq_lens = context_lens(run_length)
        batch = make_batch(seq_lens, [run_length] * len(seq_lens), seed=run_length, **shape)
        by_rows = torch_ops.plan_attention(
            batch.block_tables, batch.seq_lens, batch.query_start_loc, block_size, compiled=True
        )
        assert by_rows.runs is None
        rows = torch_ops.paged_attention(*batch.args(), plan=by_rows)
        assert torch.equal(run_kernel(batch, run_length), rows)


@pytest.mark.parametrize("num_new", range(1, MAX_QUERY + 1))
def test_drafts_of_every_length_match_the_reference_through_the_default_plan(
    make_batch: Callable, num_new: int
) -> None:
    seq_lens = context_lens(num_new)
    batch = make_batch(
        seq_lens, [num_new] * len(seq_lens), num_heads=9, num_kv_heads=3, seed=num_new
    )
    plan = default_plan(batch)
    assert plan.groups == []  # every new token went to a compiled kernel
    in_runs = 0 if plan.runs is None else int(plan.runs.counts.sum())
    assert in_runs == len(seq_lens) * int(torch_ops._tokens_in_runs(np.array([num_new]), 5)[0])
    batch.assert_matches_reference(torch_ops.paged_attention(*batch.args(), plan=plan))


def test_prompts_of_any_length_take_the_compiled_kernels_through_the_default_plan(
    make_batch: Callable,
) -> None:
    # Fresh prompts, a chunk after a long context, and a decode: no SDPA group is left.
    query_lens = [MAX_QUERY + 1, 40, 97, 130, 1]
    seq_lens = [MAX_QUERY + 1, 40, 97, 130 + 300, 77]
    batch = make_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3, seed=11)
    plan = default_plan(batch)
    assert plan.groups == []
    in_runs = int(plan.runs.counts.sum())
    assert in_runs + len(plan.decodes.query_rows) == sum(query_lens)
    assert in_runs == int(torch_ops._tokens_in_runs(np.array(query_lens), 5).sum())
    batch.assert_matches_reference(torch_ops.paged_attention(*batch.args(), plan=plan))


def test_runs_over_a_bf16_cache_get_the_bits_of_its_values_widened(make_batch: Callable) -> None:
    # As `test_cpu_decode`'s bf16 test, for runs: prompts, drafts and a decode in one step.
    query_lens = [MAX_QUERY + 1, 40, 3, 1]
    seq_lens = [MAX_QUERY + 1, 40 + 20, 3 + 50, 77]
    batch = make_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3, seed=4)
    k16, v16 = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    bf16 = dataclasses.replace(batch, k_cache=k16, v_cache=v16)
    widened = dataclasses.replace(batch, k_cache=k16.float(), v_cache=v16.float())
    plan = default_plan(bf16)
    assert plan.groups == [] and int(plan.runs.counts.sum()) > 0
    out = torch_ops.paged_attention(*bf16.args(), plan=plan)
    assert torch.equal(out, torch_ops.paged_attention(*widened.args(), plan=default_plan(widened)))
    assert not out.isnan().any()


@SHAPES
def test_mixed_decodes_and_drafts_match_the_reference_at_every_shape(
    make_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    generator = torch.Generator().manual_seed(block_size + num_heads)
    query_lens = [1, 2, 5, 1, 17, 9, 3, 16, 8, 40]
    seq_lens = [q + int(torch.randint(0, 60, (1,), generator=generator)) for q in query_lens]
    batch = make_batch(
        seq_lens,
        query_lens,
        seed=block_size,
        **shape_kwargs(num_heads, num_kv_heads, head_dim, block_size),
    )
    out = torch_ops.paged_attention(*batch.args())
    batch.assert_matches_reference(out)


def test_stale_slots_and_unused_table_entries_are_never_read(make_batch: Callable) -> None:
    # NaN fills every slot past each length; -1 pads the block tables.
    batch = make_batch(
        [5, 16, 21, 31, 32, 33], [5] * 6, num_heads=9, num_kv_heads=3, table_padding="minus_one"
    )
    for run_length in range(1, 6):
        batch.assert_matches_reference(run_kernel(batch, run_length))


@pytest.mark.parametrize("poisoned", range(1, 5))
def test_a_later_token_of_a_run_reaches_only_the_tokens_that_see_it(
    make_batch: Callable, poisoned: int
) -> None:
    # NaN K/V at the position of token `poisoned` of each 5-token run: the tokens before
    # it must not read it (not even as 0 * NaN), those from it on must.
    batch = make_batch([20, 33, 40], [5, 5, 5], num_heads=9, num_kv_heads=3, seed=poisoned)
    clean = run_kernel(batch, 5)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        position = seq_len - 5 + poisoned
        block = int(batch.block_tables[seq, position // 16])
        batch.k_cache[block, position % 16] = float("nan")
        batch.v_cache[block, position % 16] = float("nan")
    out = run_kernel(batch, 5)
    for first in batch.query_start_loc[:-1].tolist():
        before = slice(first, first + poisoned)
        assert torch.equal(out[before], clean[before])
        assert out[first + poisoned : first + 5].isnan().all()


def test_large_scores_stay_finite_and_exact(make_batch: Callable) -> None:
    # Scores of hundreds: the online softmax must subtract the running max before exp.
    batch = make_batch([40, 200], [5, 4], num_heads=9, num_kv_heads=3, seed=3)
    batch.query.mul_(40.0)
    batch.assert_matches_reference(run_kernel(batch, 5))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_the_same_output(make_batch: Callable, threads: int) -> None:
    batch = make_batch([250, 33, 17, 64, 5], [5, 3, 5, 4, 5], num_heads=9, num_kv_heads=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_kernel(batch, 5)
    finally:
        torch.set_num_threads(before)
    batch.assert_matches_reference(out)


def test_reads_and_writes_only_its_rows_of_strided_query_and_out(make_batch: Callable) -> None:
    # As in the model: query is a view into the q/k/v GEMM's output, out is written in place.
    batch = make_batch([30, 60, 90], [5, 2, 4], num_heads=9, num_kv_heads=3)
    num_tokens, num_heads, head_dim = batch.query.shape
    wide = torch.full((num_tokens, (num_heads + 6) * head_dim), float("nan"))
    wide[:, : num_heads * head_dim] = batch.query.reshape(num_tokens, -1)
    batch.query = wide[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not batch.query.is_contiguous()
    rows, counts, tables, lens = split_into_runs(batch, 5)
    every_other = slice(0, None, 2)  # the first and third sequences' runs
    out = torch.full_like(batch.query, -7.0)
    paged_verify.verify_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        rows[every_other],
        counts[every_other],
        tables[every_other],
        lens[every_other],
        batch.scale,
        out,
    )
    written = [
        row
        for first, count in zip(rows[every_other], counts[every_other], strict=True)
        for row in range(first, first + count)
    ]
    untouched = [r for r in range(num_tokens) if r not in written]
    assert torch.all(out[untouched] == -7.0)
    full = torch_ops.paged_attention(*batch.args())
    batch.assert_matches_reference(full)
    torch.testing.assert_close(out[written], full[written], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("num_new", "in_runs"),
    [(1, 0), (2, 0), (3, 3), (4, 4), (5, 5), (6, 5), (7, 5), (8, 8), (10, 10), (17, 15)],
)
def test_runs_take_whole_runs_and_a_last_one_of_at_least_half(num_new: int, in_runs: int) -> None:
    # SmolLM2's shapes: runs of up to 5 tokens; a last run of 1 or 2 goes a row per token.
    assert int(torch_ops._tokens_in_runs(np.array([num_new]), 5)[0]) == in_runs


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rows"),
    [(9, 3, 64, 5), (8, 8, 64, 16), (8, 1, 128, 2), (32, 2, 64, 0), (9, 3, 36, 0)],
)
def test_rows_per_run_fill_the_lanes(
    num_heads: int, num_kv_heads: int, head_dim: int, rows: int
) -> None:
    # 16 lanes of query heads per KV head; a run must share its blocks among two tokens.
    assert paged_verify.rows_per_run(num_heads, num_kv_heads, head_dim) == rows


def test_a_plan_splits_each_draft_into_runs_and_rows_exactly_once() -> None:
    # Sequences of 1, 7, 3 and 6 new tokens after contexts of 10, 30, 40 and 50 tokens.
    seq_lens = torch.tensor([11, 37, 43, 56], dtype=torch.int32)
    starts = torch.tensor([0, 1, 8, 11, 17], dtype=torch.int32)
    block_tables = torch.arange(4 * 4, dtype=torch.int32).view(4, 4)
    plan = torch_ops.plan_attention(
        block_tables, seq_lens, starts, 16, compiled=True, verify_rows=5
    )
    runs = {
        int(r): (int(c), int(n), t.tolist())
        for r, c, n, t in zip(
            plan.runs.query_rows,
            plan.runs.counts,
            plan.runs.seq_lens,
            plan.runs.block_tables,
            strict=True,
        )
    }
    # Sequence 1: tokens 1-5 in a run (the first sees 31 positions), tokens 6 and 7 rows;
    # sequence 2: one run of 3; sequence 3: a run of 5 and a row.
    assert runs == {
        1: (5, 31, block_tables[1].tolist()),
        8: (3, 41, block_tables[2].tolist()),
        11: (5, 51, block_tables[3].tolist()),
    }
    rows = dict(zip(plan.decodes.query_rows.tolist(), plan.decodes.seq_lens.tolist(), strict=True))
    assert rows == {0: 11, 6: 36, 7: 37, 16: 56}
    # Longest context first in both.
    assert plan.runs.seq_lens.tolist() == [51, 41, 31]
    assert plan.decodes.seq_lens.tolist() == [56, 37, 36, 11]


def test_without_verify_rows_every_token_is_a_row(make_batch: Callable) -> None:
    batch = make_batch([20, 40], [5, 3], num_heads=9, num_kv_heads=3)
    plan = torch_ops.plan_attention(
        batch.block_tables, batch.seq_lens, batch.query_start_loc, 16, compiled=True
    )
    assert plan.runs is None
    assert len(plan.decodes.query_rows) == 8


def test_a_plan_with_runs_too_long_for_these_tensors_is_refused(make_batch: Callable) -> None:
    smollm2 = make_batch([20, 40], [5, 5], num_heads=9, num_kv_heads=3)
    group8 = make_batch([20, 40], [5, 5], num_heads=8, num_kv_heads=1)
    plan = torch_ops.plan_for(*smollm2.args()[:6])
    assert plan.verify_rows == 5
    with pytest.raises(ValueError, match="plan: compiled verify runs"):
        torch_ops.paged_attention(*group8.args(), plan=plan)
    bf16 = make_batch([20, 40], [5, 5], num_heads=9, num_kv_heads=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="plan: compiled"):
        torch_ops.paged_attention(*bf16.args(), plan=plan)
