"""Kernel test fixtures: both backends, and paged batches built the hard way.

Triton decides when a kernel is defined whether it is interpreted, and its own library
must agree, so without a GPU this suite turns TRITON_INTERPRET=1 on before anything
imports Triton, for the whole process. Run it in a process of its own, as
scripts/test.sh does: with the variable on, the public ops route every CPU call to the
(slow) interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pagedinfer.kernels import triton_ops
from pagedinfer.kernels.reference import paged_attention_reference

assert torch.cuda.is_available() or triton_ops._INTERPRETED, (
    "the Triton kernels were defined before TRITON_INTERPRET=1 was set"
)

TOLERANCE = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,  # one bf16 ulp at |x| in [2, 4) is 1.6e-2
}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=["torch", "torch-gather", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The module of one backend: `torch_ops` or `triton_ops` (same signatures).

    "torch" serves fp32 decodes with the compiled kernel (numba is a dependency);
    "torch-gather" keeps them on the gather + SDPA path.
    """
    if request.param == "triton":
        return triton_ops
    from pagedinfer.kernels import torch_ops

    if request.param == "torch":
        monkeypatch.delenv("PAGEDINFER_CPU_KERNELS", raising=False)
        assert torch_ops._paged_decode() is not None, "numba is missing: no compiled decodes"
    else:
        monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")
    return torch_ops


@dataclass
class PagedBatch:
    """The inputs of one paged_attention call, plus the per-sequence K/V it pages."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    def assert_matches_reference(self, out: torch.Tensor) -> None:
        """out is finite and matches the simple reference within the dtype's tolerance."""
        expected = paged_attention_reference(
            *(t.cpu() if torch.is_tensor(t) else t for t in self.args())
        )
        tol = TOLERANCE[self.query.dtype]
        assert not out.isnan().any()
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)

    def args(self) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def build_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    table_padding: str = "guard",
    seed: int = 0,
) -> PagedBatch:
    """A batch whose cache is hostile: physical blocks randomly permuted, NaN in every
    slot no sequence owns (the tail of each last block, the spare blocks, the guard
    block), and block-table columns past a sequence's end pointing at the NaN guard
    block ("guard") or holding -1 ("minus_one").
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, one of them the guard
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical = torch.randperm(num_blocks, generator=generator)
    guard = int(physical[-1])
    width = max(blocks_per_seq) + 1
    fill = guard if table_padding == "guard" else -1
    block_tables = torch.full((len(seq_lens), width), fill, dtype=torch.int32)
    keys, values = [], []
    next_block = 0
    for seq, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[seq, :n_blocks] = physical[next_block : next_block + n_blocks].int()
        next_block += n_blocks
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        for position in range(seq_len):
            block = int(block_tables[seq, position // block_size])
            k_cache[block, position % block_size] = key[position]
            v_cache[block, position % block_size] = value[position]
        keys.append(key)
        values.append(value)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int()
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    return PagedBatch(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


@pytest.fixture
def make_batch() -> Callable[..., PagedBatch]:
    return build_batch
