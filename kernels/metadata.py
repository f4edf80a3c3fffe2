"""Where a batch's tokens live in the paged KV cache: the arguments every layer's
`write_kv` and `paged_attention` share, built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedinfer.kernels import torch_ops


@dataclass
class AttentionMetadata:
    """slot_mapping: int64 [T], cache slot of each new token (-1 = skip).
    block_tables: int32 [num_seqs, max_blocks_per_seq].
    seq_lens: int32 [num_seqs], context length of each sequence including its new tokens.
    query_start_loc: int32 [num_seqs + 1], sequence i owns tokens qsl[i]:qsl[i + 1].
    compiled: the torch path's attention may hand sequences to the compiled CPU kernels
    (the CPU executor sets it; a model's own forward stays on plain torch ops).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    compiled: bool = False
    # The torch path's grouping, indices and masks: the same for every layer of one
    # sliding window (None: full attention), so they are built by the first such layer's
    # call and reused by the others.
    plans: dict[int | None, torch_ops.AttentionPlan] = field(default_factory=dict)
    # Set once the first layer's kernel calls have checked the batch: the later layers'
    # tensors match in shape, dtype and device, so their calls skip the checks.
    validated: bool = False

    def plan_for(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sliding_window: int | None = None,
    ) -> torch_ops.AttentionPlan:
        """The batch's attention plan for the torch path and this layer's window, made on
        the first call for that window."""
        plan = self.plans.get(sliding_window)
        if plan is None or plan.block_size != k_cache.shape[1]:
            plan = torch_ops.plan_for(
                query,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                compiled=self.compiled,
                sliding_window=sliding_window,
            )
            self.plans[sliding_window] = plan
        return plan
