"""Compiled plans for decodes that verify a draft: a few new tokens per sequence, one
kernel row per token, over a paged context.

Batches come from `build_batch`: permuted physical blocks and NaN in every slot that no
sequence owns, so a row that reads past its own position returns NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedinfer.kernels import torch_ops
from pagedinfer.service.config import MAX_SPECULATIVE_TOKENS

pytest.importorskip("numba", reason="the compiled decode kernel needs numba")

MAX_QUERY = torch_ops.COMPILED_MAX_QUERY


def plan(batch, compiled: bool) -> torch_ops.AttentionPlan:
    return torch_ops.plan_attention(
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.k_cache.shape[1],
        compiled=compiled,
    )


def run(batch, compiled: bool) -> tuple[torch.Tensor, torch_ops.AttentionPlan]:
    p = plan(batch, compiled)
    return torch_ops.paged_attention(*batch.args(), plan=p), p


def assert_same_as_torch_path(batch, out: torch.Tensor) -> None:
    torch_out, torch_plan = run(batch, compiled=False)
    assert torch_plan.decodes is None
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


def test_the_longest_draft_is_one_compiled_row_per_token() -> None:
    # A decode verifying the longest draft carries 1 + MAX_SPECULATIVE_TOKENS tokens.
    assert MAX_QUERY == 1 + MAX_SPECULATIVE_TOKENS


@pytest.mark.parametrize("num_new", range(2, MAX_QUERY + 1))
def test_a_draft_of_any_length_matches_the_reference_and_the_torch_path(
    make_batch: Callable, num_new: int
) -> None:
    # Contexts that end inside a block, on its edge, one past it, and long.
    seq_lens = [num_new, num_new + 15, 32, 33 + num_new, 250]
    batch = make_batch(seq_lens, [num_new] * len(seq_lens), seed=num_new)
    out, p = run(batch, compiled=True)
    assert p.groups == []  # every new token went to the compiled kernel
    assert len(p.decodes.query_rows) == num_new * len(seq_lens)
    batch.assert_matches_reference(out)
    assert_same_as_torch_path(batch, out)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (6, 2, 64, 5), (4, 2, 32, 1)],
    ids=["smollm2", "block5", "block1"],
)
def test_mixed_decodes_and_drafts_match_the_reference_at_every_shape(
    make_batch: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    generator = torch.Generator().manual_seed(block_size)
    query_lens = [1, 2, 5, 1, 17, 9, 3]
    seq_lens = [q + int(torch.randint(0, 60, (1,), generator=generator)) for q in query_lens]
    batch = make_batch(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=block_size,
    )
    out, p = run(batch, compiled=True)
    assert p.groups == []
    batch.assert_matches_reference(out)
    assert_same_as_torch_path(batch, out)


def test_each_new_token_sees_the_context_up_to_itself() -> None:
    # Sequences of 4 new tokens after 6 (length 10) and 1 new after 20 (length 21).
    block_tables = torch.tensor([[3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    p = torch_ops.plan_attention(
        block_tables,
        torch.tensor([10, 21], dtype=torch.int32),
        torch.tensor([0, 4, 5], dtype=torch.int32),
        block_size=8,
        compiled=True,
    )
    rows = dict(zip(p.decodes.query_rows.tolist(), p.decodes.seq_lens.tolist(), strict=True))
    assert rows == {0: 7, 1: 8, 2: 9, 3: 10, 4: 21}
    # Longest context first; each row keeps its own sequence's block table.
    assert p.decodes.seq_lens.tolist() == sorted(rows.values(), reverse=True)
    for row, table in zip(p.decodes.query_rows, p.decodes.block_tables, strict=True):
        assert table.tolist() == block_tables[0 if row < 4 else 1].tolist()


def test_sequences_past_the_compiled_limit_still_go_to_groups(make_batch: Callable) -> None:
    query_lens = [MAX_QUERY, MAX_QUERY + 1, 1, 40, 2]
    seq_lens = [MAX_QUERY + 20, MAX_QUERY + 1, 30, 70, 2]
    batch = make_batch(seq_lens, query_lens, num_heads=9, num_kv_heads=3)
    out, p = run(batch, compiled=True)
    starts = batch.query_start_loc.tolist()

    def rows(*seqs: int) -> set[int]:
        return {r for s in seqs for r in range(starts[s], starts[s + 1])}

    assert set(p.decodes.query_rows.tolist()) == rows(0, 2, 4)
    grouped = {r for g in p.groups for r in g.out_rows.tolist()}
    assert grouped == rows(1, 3)
    assert all(not g.decode for g in p.groups)
    batch.assert_matches_reference(out)
    assert_same_as_torch_path(batch, out)
