"""A test's own model runner: a paged KV cache for a few sequences and one forward over
chunks of their tokens, through a model's own forward or a CPU executor."""

from __future__ import annotations

from typing import Any

import torch

from pagedinfer.kernels import AttentionMetadata
from pagedinfer.service.models import DecoderModel, ModelConfig

BLOCK_SIZE = 16


class PagedCache:
    """A KV cache with a shuffled block table per sequence: the test's own model runner."""

    def __init__(
        self,
        config: ModelConfig,
        num_seqs: int,
        max_len: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 1
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        # NaN in unused slots: reading anything that was never written poisons the output.
        self.kv_caches = [
            (
                torch.full(shape, float("nan"), dtype=dtype),
                torch.full(shape, float("nan"), dtype=dtype),
            )
            for _ in range(config.num_layers)
        ]
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.block_tables = order.view(num_seqs, blocks_per_seq).to(torch.int32)

    def step(self, model: Any, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """Run one forward over chunks (seq index, new token ids, start position).

        Returns each chunk's logits for all its new tokens.
        """
        logits, _ = self.forward(model, chunks)
        return list(logits.split([len(tokens) for _, tokens, _ in chunks]))

    def forward(
        self,
        model: Any,
        chunks: list[tuple[int, list[int], int]],
        greedy: torch.Tensor | None = None,
        rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`step`'s forward: (logits, tokens) for every new token, or for the new tokens at
        `rows`. model: a `DecoderModel` (tokens None) or a `CpuExecutor` (greedy: bool, per
        such token, as the executor takes it)."""
        ids, positions, slots, seq_ids, seq_lens, starts = [], [], [], [], [], [0]
        for seq, tokens, start in chunks:
            pos = torch.arange(start, start + len(tokens))
            table = self.block_tables[seq].long()
            ids.append(torch.tensor(tokens))
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_ids.append(seq)
            seq_lens.append(start + len(tokens))
            starts.append(starts[-1] + len(tokens))
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_tables=self.block_tables[seq_ids],
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
        )
        args = (
            torch.cat(ids),
            torch.cat(positions),
            self.kv_caches,
            attn,
            torch.arange(starts[-1]) if rows is None else torch.tensor(rows, dtype=torch.long),
        )
        if isinstance(model, DecoderModel):
            return model(*args), None
        return model.forward(*args, greedy)

    def copy(self) -> PagedCache:
        """The same blocks and tables, with the K/V values copied."""
        other = object.__new__(PagedCache)
        other.kv_caches = [(k.clone(), v.clone()) for k, v in self.kv_caches]
        other.block_tables = self.block_tables
        return other

    def equals(self, other: PagedCache) -> bool:
        """Whether both hold the same K/V bit for bit (NaN where neither wrote)."""
        return all(
            torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
            for pair, other_pair in zip(self.kv_caches, other.kv_caches, strict=True)
            for a, b in zip(pair, other_pair, strict=True)
        )
