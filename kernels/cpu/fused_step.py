"""A whole forward pass of up to a few hundred tokens on CPU in one compiled call (numba,
fp32): every step whose GEMMs the grid serves (`FusedWeights.max_tokens`).

A decode step of one to a few tokens spends most of its time outside arithmetic: the
GEMMs read every weight to do little with each, and between them some ten Python calls
per layer each cost their dispatch, with the caches cold after every GEMM. Here the step
runs as one call on the worker threads:

- the GEMMs read the weights from their quantisation grid (`grid_gemm`: 5 or 9 bits a
  weight in place of 32), each worker a share of the output tiles;
- attention runs the same compiled kernels as a step through Python (`paged_decode`,
  `paged_verify`), each worker a share of the sequences;
- the small ops (`layer_ops`'s RMSNorm, q/k head norms, rotary and K/V write) work row
  by row, each worker on a share of the rows; the gate/up GEMM applies the SiLU (or GELU,
  `StepShape.gelu`) to its own outputs (`grid_gemm`, silu), so the product is never
  written and read back;
- what families change in the layer is data the step reads: each layer's q/k norms,
  rotated dims and cos/sin table, sliding window, and the norms of its blocks' outputs
  before they join the residual (Gemma 3's);
- between phases the workers wait at a spinning barrier (microseconds), not for Python.

Every operation is the one the executor's step layer by layer does, in the same order,
with the same rounding (both paths sum every grid GEMM in one fixed order,
`grid_gemm.fixed_order`): logits come out bit for bit the same, which keeps speculative
decoding exact whichever path a step takes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedinfer.kernels.cpu import greedy_argmax, grid_gemm, layer_ops, paged_decode, paged_verify
from pagedinfer.kernels.cpu.numba_support import (
    Job,
    barrier,
    cache_array,
    cycle_counter,
    jit,
    lanes_add,
    run_jobs,
)

# The phases of a step, as `fused_forward` profiles them: each ends where the workers meet
# at a barrier (the wait there is the phase's too). "start" is the first layer's norm, where
# the first worker waits for the others to reach the kernel; "rows" moves the rows that
# reach the LM head to the front before the last layer's MLP; "lm_head" is the logits of
# the rows that need them and the 8-bit codes of the greedy rows; "approximate" and "pick"
# are `greedy_argmax`'s other phases. "gate_up" includes the SiLU, which that GEMM applies.
PHASES = (
    "start",
    "norm",
    "qkv",
    "rope",
    "attention",
    "rows",
    "o",
    "gate_up",
    "down",
    "lm_head",
    "approximate",
    "pick",
)
(
    _START,
    _NORM,
    _QKV,
    _ROPE,
    _ATTENTION,
    _ROWS,
    _O,
    _GATE_UP,
    _DOWN,
    _LM_HEAD,
    _APPROXIMATE,
    _PICK,
) = range(len(PHASES))


@dataclass(frozen=True)
class FusedWeights:
    """A model's weights as the fused step reads them. Layer arrays are stacked:
    [layers, ...]; each GEMM's codes and scales as in `grid_gemm.GridWeight`.

    A layer position's grids may be of two kinds across the layers (a GGUF K-quant mix
    such as Q4_K_M's, whose ffn_down is Q6_K in some layers and Q4_K in the others):
    each kind's layers are stacked apart, and `layer_slots` says where each layer's lie, so
    every layer's weight is read in its own kind, with no wider copy."""

    norms: np.ndarray  # fp32 [layers, 2, hidden]: input and post-attention RMSNorm
    final_norm: np.ndarray  # fp32 [hidden]
    eps: float
    kinds: tuple[str, str, str, str, str]  # q/k/v, o, gate/up, down, LM head
    orders: tuple[grid_gemm.SumOrder, ...]  # each GEMM's (`grid_gemm.fixed_order`)
    # The most new tokens a step may have here: its GEMMs all take the grid, which serves
    # calls of up to `grid_gemm.GRID_MAX_ROWS` rows.
    max_tokens: int
    codes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    scales: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    # Per layer position (q/k/v, o, gate/up, down): the second kind (None: one kind), and
    # its layers' stacked codes and scales (with one kind, an empty stack of the first's).
    second_kinds: tuple[str | None, ...]
    second_codes: tuple[np.ndarray, ...]
    second_scales: tuple[np.ndarray, ...]
    # int64 [4, layers]: each layer's index in its position's first stack, or -1 - its
    # index in the second.
    layer_slots: np.ndarray
    # fp32 [layers, q/k/v outputs]: the q/k/v biases (Qwen2's), added to the product
    # before the rotation; [layers, 0] for a model without them.
    qkv_bias: np.ndarray
    # fp32 [layers, 2, head_dim]: the query and key heads' RMSNorm weights (Qwen3's), applied
    # before the rotation; [layers, 0, 0] for a model without them.
    qk_norm: np.ndarray
    # int64 [layers, 2]: how many leading dims of each q and k head a layer rotates (0: a
    # NoPE layer, SmolLM3's; fewer than head_dim: partial rotary, Phi-3's), and which of
    # the step's cos/sin tables it reads (1: the local layers' own rope, Gemma 3's).
    rope: np.ndarray
    # fp32 [layers, 2, hidden]: the norms of the attention's and the MLP's outputs before
    # they join the residual (Gemma 3's); [layers, 0, 0]: added as they are.
    post_norms: np.ndarray
    # int64 [layers]: each layer's sliding window (0: it attends fully).
    windows: np.ndarray
    # The LM head as `greedy_argmax` picks greedy rows' tokens from it; None: every row's
    # logits are computed.
    argmax: greedy_argmax.ArgmaxWeights | None = None

    @classmethod
    def stack(
        cls,
        layers: Sequence[Sequence[grid_gemm.GridWeight]],
        lm_head: grid_gemm.GridWeight,
        orders: Sequence[grid_gemm.SumOrder],
        max_tokens: int,
        norms: np.ndarray,
        final_norm: np.ndarray,
        eps: float,
        rope: np.ndarray,
        argmax: greedy_argmax.ArgmaxWeights | None = None,
        qkv_bias: np.ndarray | None = None,
        qk_norm: np.ndarray | None = None,
        post_norms: np.ndarray | None = None,
        windows: np.ndarray | None = None,
    ) -> FusedWeights | None:
        """From each layer's four grids (q/k/v, o, gate/up, down) and the order each GEMM
        sums in (the four and the LM head), each layer's rotated dims and cos/sin table
        ([layers, 2], `rope`), its q/k/v bias where the model has them ([layers, q/k/v
        outputs]) and its q and k norms' weights where it has those ([layers, 2,
        head_dim]), its output norms' where it norms its blocks' outputs ([layers, 2,
        hidden]) and its sliding window ([layers], 0 for none; None: no layer has one); None
        where one GEMM's grids differ in shape across layers, or come in more than two
        kinds (with their arrays' types)."""
        kinds, codes, scales, seconds, second_codes, second_scales = [], [], [], [], [], []
        layer_slots = np.zeros((4, len(layers)), np.int64)
        for p, position in enumerate(zip(*layers, strict=True)):
            first = position[0]
            if any(
                (g.out_features, g.in_features) != (first.out_features, first.in_features)
                for g in position
            ):
                return None
            variants = list(dict.fromkeys(g.variant for g in position))
            if len(variants) > 2:
                return None
            stacks: list[list[grid_gemm.GridWeight]] = [[] for _ in variants]
            for layer, g in enumerate(position):
                v = variants.index(g.variant)
                layer_slots[p, layer] = len(stacks[v]) if v == 0 else -1 - len(stacks[v])
                stacks[v].append(g)
            kinds.append(first.kind)
            codes.append(np.stack([g.codes for g in stacks[0]]))
            scales.append(np.stack([g.scales for g in stacks[0]]))
            if len(stacks) == 2:
                seconds.append(stacks[1][0].kind)
                second_codes.append(np.stack([g.codes for g in stacks[1]]))
                second_scales.append(np.stack([g.scales for g in stacks[1]]))
            else:
                seconds.append(None)
                second_codes.append(codes[-1][:0])
                second_scales.append(scales[-1][:0])
        if qkv_bias is None:
            qkv_bias = np.zeros((len(layers), 0), np.float32)
        elif qkv_bias.shape != (len(layers), layers[0][0].out_features):
            return None
        if qk_norm is None:
            qk_norm = np.zeros((len(layers), 0, 0), np.float32)
        elif qk_norm.ndim != 3 or qk_norm.shape[:2] != (len(layers), 2):
            return None
        if rope.shape != (len(layers), 2):
            return None
        if post_norms is None:
            post_norms = np.zeros((len(layers), 0, 0), np.float32)
        elif post_norms.shape != (len(layers), 2, norms.shape[-1]):
            return None
        if windows is None:
            windows = np.zeros(len(layers), np.int64)
        elif windows.shape != (len(layers),):
            return None
        return cls(
            norms=np.ascontiguousarray(norms, dtype=np.float32),
            final_norm=np.ascontiguousarray(final_norm, dtype=np.float32),
            eps=float(eps),
            kinds=(*kinds, lm_head.kind),
            orders=tuple(orders),
            max_tokens=max_tokens,
            codes=(*codes, lm_head.codes),
            scales=(*scales, lm_head.scales),
            argmax=argmax,
            second_kinds=tuple(seconds),
            second_codes=tuple(second_codes),
            second_scales=tuple(second_scales),
            layer_slots=layer_slots,
            qkv_bias=np.ascontiguousarray(qkv_bias, dtype=np.float32),
            qk_norm=np.ascontiguousarray(qk_norm, dtype=np.float32),
            rope=np.ascontiguousarray(rope, dtype=np.int64),
            post_norms=np.ascontiguousarray(post_norms, dtype=np.float32),
            windows=np.ascontiguousarray(windows, dtype=np.int64),
        )

    def layer_grid(self, position: int, layer: int) -> grid_gemm.GridWeight:
        """One layer's weight at a layer position: a view of the stacked arrays."""
        slot = int(self.layer_slots[position, layer])
        kind, codes, scales = self.kinds[position], self.codes[position], self.scales[position]
        if slot < 0:
            slot = -1 - slot
            kind = self.second_kinds[position]
            codes, scales = self.second_codes[position], self.second_scales[position]
        out_features = codes.shape[1] * grid_gemm.LANES
        in_features = self.orders[position].ends[-1]
        return grid_gemm.GridWeight(kind, out_features, in_features, codes[slot], scales[slot])

    @property
    def nbytes(self) -> int:
        """What a step reads of them: every array once."""
        arrays = (
            *self.codes,
            *self.scales,
            *self.second_codes,
            *self.second_scales,
            self.norms,
            self.final_norm,
            self.qkv_bias,
            self.qk_norm,
            self.rope,
            self.post_norms,
            self.windows,
        )
        return sum(a.nbytes for a in arrays)


@dataclass(frozen=True)
class StepShape:
    """The model facts the compiled step is specialised for."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    block_size: int
    gelu: bool = False  # the GLU's activation: GELU's tanh approximation, not SiLU


@dataclass(frozen=True)
class CacheArrays:
    """A model's KV caches as the fused step takes them: numpy views of each layer's K
    and V cache (`cache_arrays`)."""

    caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]


def views_of(known: CacheArrays, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether `known` views these very cache tensors."""
    return len(known.caches) == len(kv_caches) and all(
        k is known_k and v is known_v
        for (k, v), (known_k, known_v) in zip(kv_caches, known.caches, strict=True)
    )


def cache_arrays(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], known: CacheArrays | None = None
) -> CacheArrays:
    """Views of these caches: `known` where it views these very tensors, else new ones.
    The executor keeps them from step to step: checking that `known` still fits costs far
    less than making a view of every layer's caches each step."""
    if known is not None and views_of(known, kv_caches):
        return known
    return CacheArrays(
        tuple((k, v) for k, v in kv_caches),
        tuple(cache_array(k) for k, _ in kv_caches),
        tuple(cache_array(v) for _, v in kv_caches),
    )


@dataclass(frozen=True)
class _Setup:
    """What `fused_forward` makes for a step of one shape (tokens, logits rows and which
    of them are greedy, workers) and a step of the same shape reuses: the kernel, the
    scratch arrays it writes before reading, and the arguments that do not change."""

    kernel: Callable[..., None]
    weight_args: tuple[Any, ...]
    # From `normed` to the normed rows for the LM head, and from `argmax_at` to `picked`:
    # the arguments on either side of the logits, which are new each step.
    scratch_args: tuple[Any, ...]
    argmax_args: tuple[Any, ...]
    num_full: int  # logits rows computed in full
    picking: np.ndarray  # bool [S]: rows whose argmax `greedy_argmax` picks
    full_positions: np.ndarray  # int64: the full rows among the S rows
    argmax_normed: np.ndarray  # fp32 [picking rows, hidden]
    picked: np.ndarray  # int64 [picking rows]
    sync: np.ndarray  # int64 [2], zeroed before each step


class StepScratch:
    """The setup of the last step `fused_forward` ran (`_Setup`), kept for the next: the
    steps of a batch that only decodes all have one shape, so each reuses the last one's
    arrays and arguments instead of making them again. For one thread at a time."""

    def __init__(self) -> None:
        self._weights: FusedWeights | None = None
        self._key: tuple[Any, ...] | None = None
        self._setup: _Setup | None = None

    def setup(
        self,
        weights: FusedWeights,
        shape: StepShape,
        tokens: int,
        rows: np.ndarray,
        picking: np.ndarray,
        workers: int,
        num_layers: int,
        profiled: bool,
    ) -> _Setup:
        """The setup for this step: the last one where the step has its shape, else new."""
        key = (shape, tokens, rows.tobytes(), picking.tobytes(), workers, num_layers, profiled)
        if self._setup is None or weights is not self._weights or key != self._key:
            self._setup = _new_setup(
                weights, shape, tokens, rows, picking, workers, num_layers, profiled
            )
            self._weights, self._key = weights, key
        return self._setup


def _new_setup(
    weights: FusedWeights,
    shape: StepShape,
    tokens: int,
    rows: np.ndarray,
    picking: np.ndarray,
    workers: int,
    num_layers: int,
    profiled: bool,
) -> _Setup:
    qkv_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    q_width = shape.num_heads * shape.head_dim
    qkv = torch.empty(tokens, qkv_width)
    query = qkv[:, :q_width].view(tokens, shape.num_heads, shape.head_dim)
    attn_out = torch.empty(tokens, shape.num_heads, shape.head_dim)
    full_rows, argmax_rows = rows[~picking], rows[picking]
    # The last layer's attention output, MLP and residual matter only for the rows that
    # go on to the LM head (a prompt's K/V is written before): those run on the rows
    # kept, moved to the front, and the LM head reads them there.
    kept = np.union1d(full_rows, argmax_rows).astype(np.int64)
    full_at, argmax_at = np.searchsorted(kept, full_rows), np.searchsorted(kept, argmax_rows)
    argmax_normed = np.empty((argmax_rows.shape[0], shape.hidden), np.float32)
    picked = np.empty(argmax_rows.shape[0], np.int64)
    if weights.argmax is not None:
        argmax_weight_args = (
            *greedy_argmax.weights_args(weights.argmax),
            *weights.argmax.pool.get(argmax_rows.shape[0], workers).args(),
        )
    else:
        argmax_weight_args = greedy_argmax.no_args(weights.codes[4], weights.scales[4])
    return _Setup(
        kernel=_kernel(
            shape, weights.kinds, weights.second_kinds, weights.orders, num_layers, profiled
        ),
        weight_args=(
            weights.norms,
            weights.final_norm,
            np.float32(weights.eps),
            *weights.codes,
            *weights.scales,
            *weights.second_codes,
            *weights.second_scales,
            weights.layer_slots,
            weights.qkv_bias,
            weights.qk_norm,
            weights.rope,
            weights.post_norms,
            weights.windows,
        ),
        scratch_args=(
            np.empty((tokens, shape.hidden), np.float32),  # normed
            qkv.numpy(),
            query.numpy(),
            attn_out.numpy(),
            np.empty((tokens, shape.intermediate), np.float32),  # silu(gate) * up
            kept,
            full_at,
            np.empty((full_rows.shape[0], shape.hidden), np.float32),  # the rows for logits
            np.empty((full_rows.shape[0], shape.hidden), np.float32),  # ... normed
        ),
        argmax_args=(
            argmax_at,
            np.empty((argmax_rows.shape[0], shape.hidden), np.float32),  # the greedy rows
            argmax_normed,
            *argmax_weight_args,
            picked,
        ),
        num_full=full_rows.shape[0],
        picking=picking.copy(),  # the caller's greedy flags may change under it
        full_positions=np.flatnonzero(~picking),
        argmax_normed=argmax_normed,
        picked=picked,
        sync=np.zeros(2, dtype=np.int64),  # arrivals at barriers; a bad slot's token + 1
    )


_EMPTY_ROWS = np.zeros(0, np.int64)
_EMPTY_TABLE = np.zeros((0, 1), np.int32)
_EMPTY_INTS = np.zeros(0, np.int32)


def fused_forward(
    weights: FusedWeights,
    shape: StepShape,
    hidden: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    plan: Any,
    logits_indices: torch.Tensor,
    scale: float,
    greedy: np.ndarray | None = None,
    profile: np.ndarray | None = None,
    arrays: CacheArrays | None = None,
    scratch: StepScratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every layer over the new tokens' hidden states [T, hidden] (the embeddings; the
    step's scratch after; cos_sin [T, 2 * tables, half]: each token's rows of the rotary
    tables that `weights.rope` names), then the final norm and LM head of rows logits_indices: fp32 logits
    [S, vocab], and with `greedy` (bool [S]: rows whose only use is their argmax) the
    argmax tokens int64 [S] that `greedy_argmax` picked for those rows (-1 for every other
    row), whose logits are then not computed. plan: the batch's
    `torch_ops.AttentionPlan` with compiled decodes and no padded groups. profile: None,
    or int64 [workers or more, len(PHASES), 2], to which each worker adds the cycles
    (`numba_support.cycle_counter`) it spent in each phase, working and then waiting for the
    others (a kernel compiled with the counters; without profile, one without them).
    arrays: `cache_arrays(kv_caches)`, made here when not given. scratch: where the
    step's setup is kept for the next step of its shape (None: made for this step alone).
    Raises ValueError for a slot past the cache's end."""
    tokens = hidden.shape[0]
    rows = logits_indices.numpy()
    if weights.argmax is not None and greedy is not None:
        picking = np.asarray(greedy, dtype=bool)
    else:
        picking = np.zeros(rows.shape[0], dtype=bool)
    workers = torch.get_num_threads()
    if profile is not None and (
        profile.dtype != np.int64
        or profile.shape[0] < workers
        or profile.shape[1:] != (len(PHASES), 2)
    ):
        raise ValueError(
            f"profile must be int64 [{workers} or more, {len(PHASES)}, 2], got "
            f"{profile.dtype} {profile.shape}"
        )
    if arrays is None:
        arrays = cache_arrays(kv_caches)
    if scratch is None:
        scratch = StepScratch()
    setup = scratch.setup(
        weights, shape, tokens, rows, picking, workers, len(kv_caches), profile is not None
    )
    decodes, runs = plan.decodes, plan.runs
    d_rows, d_tables, d_lens = (
        (decodes.query_rows, decodes.block_tables, decodes.seq_lens)
        if decodes is not None
        else (_EMPTY_ROWS, _EMPTY_TABLE, _EMPTY_INTS)
    )
    r_rows, r_counts, r_tables, r_lens = (
        (runs.query_rows, runs.counts, runs.block_tables, runs.seq_lens)
        if runs is not None
        else (_EMPTY_ROWS, _EMPTY_INTS, _EMPTY_TABLE, _EMPTY_INTS)
    )
    # New each step: the caller may keep the logits.
    full_logits = torch.empty(setup.num_full, shape.vocab)
    sync = setup.sync
    sync.fill(0)
    args = (
        hidden.numpy(),
        cos_sin.numpy(),
        slot_mapping.numpy(),
        *setup.weight_args,
        arrays.keys,
        arrays.values,
        d_rows,
        d_tables,
        d_lens,
        r_rows,
        r_counts,
        r_tables,
        r_lens,
        np.float32(scale),
        *setup.scratch_args,
        full_logits.numpy(),
        *setup.argmax_args,
        sync,
        _NO_PROFILE if profile is None else profile,
    )
    run_jobs([Job(setup.kernel, args, workers)])
    if sync[1]:
        token = int(sync[1]) - 1
        raise ValueError(
            f"slot_mapping: slot {int(slot_mapping[token])} of token {token} is outside the "
            f"cache's {kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1]} slots"
        )
    picking, picked = setup.picking, setup.picked
    if not picked.shape[0]:
        return full_logits, None
    positions = setup.full_positions  # of full_logits' rows among the S rows
    argmax = np.full(rows.shape[0], -1, dtype=np.int64)
    argmax[picking] = picked
    # A greedy row that `greedy_argmax` could not pick (-1) gets its logits after all.
    missed = picked < 0
    if missed.any():
        assert weights.argmax is not None
        late = grid_gemm.grid_linear(
            torch.from_numpy(setup.argmax_normed[missed]),
            weights.argmax.grid,
            weights.argmax.order,
        )
        full_logits = torch.cat((full_logits, late))
        positions = np.concatenate((positions, np.flatnonzero(picking)[missed]))
    logits = torch.empty(rows.shape[0], shape.vocab)  # picked rows' stay unwritten
    if positions.shape[0]:
        logits[torch.from_numpy(positions)] = full_logits
    return logits, torch.from_numpy(argmax)


_NO_PROFILE = np.zeros((1, len(PHASES), 2), dtype=np.int64)


@functools.cache
def _kernel(
    shape: StepShape,
    kinds: tuple[str, ...],
    second_kinds: tuple[str | None, ...],
    orders: tuple[grid_gemm.SumOrder, ...],
    num_layers: int,
    profiled: bool = False,
) -> Callable[..., None]:
    """The compiled step for one model shape and its positions' kinds (compiled, or loaded
    from the cache, on first call); profiled: counting each phase's cycles into its `prof`
    argument."""
    nh, nkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    hidden_tiles = shape.hidden // grid_gemm.LANES
    qkv_tiles = (nh + 2 * nkv) * d // grid_gemm.LANES
    act_tiles = shape.intermediate // grid_gemm.LANES
    vocab_tiles = shape.vocab // grid_gemm.LANES
    lanes = grid_gemm.LANES
    slots_per_layer = nkv * d

    def gemm(i: int, in_features: int, silu: bool = False) -> Callable[..., None]:
        order = orders[i]
        return grid_gemm.gemm_all_rows(
            kinds[i], in_features, order.ends, order.fused, silu, silu and shape.gelu
        )

    def layer_gemm(i: int, in_features: int, silu: bool = False) -> Callable[..., None]:
        """gemm(x, codes, scales, second_codes, second_scales, slot, out, add, worker,
        workers): one layer's GEMM at position i, in the kind its `slot` says (with one
        kind, the second branch is never taken)."""
        first, order = gemm(i, in_features, silu), orders[i]
        second = first
        if second_kinds[i] is not None:
            second = grid_gemm.gemm_all_rows(
                second_kinds[i], in_features, order.ends, order.fused, silu, silu and shape.gelu
            )

        @jit(inline="always", nogil=True)
        def in_its_kind(
            x: np.ndarray,
            codes: np.ndarray,
            scales: np.ndarray,
            second_codes: np.ndarray,
            second_scales: np.ndarray,
            slot: int,
            out: np.ndarray,
            add: bool,
            worker: int,
            workers: int,
        ) -> None:
            if slot >= 0:
                first(x, codes[slot], scales[slot], out, add, worker, workers)
            else:
                j = -1 - slot
                second(x, second_codes[j], second_scales[j], out, add, worker, workers)

        return in_its_kind

    qkv_gemm = layer_gemm(0, shape.hidden)
    o_gemm = layer_gemm(1, nh * d)
    gate_up_gemm = layer_gemm(2, shape.hidden, silu=True)  # gives act(gate) * up
    down_gemm = layer_gemm(3, shape.intermediate)
    lm_gemm = gemm(4, shape.hidden)
    quantize, approximate, pick = greedy_argmax.phase_kernels(shape.hidden, orders[4], kinds[4])
    decode = paged_decode.compiled_kernel(shape.block_size, nh, nkv, d)
    verify = paged_verify.compiled_kernel(shape.block_size, nh, nkv, d)
    rms_norm, rope_write_kv = layer_ops.rms_norm_rows, layer_ops.rope_write_kv_rows

    @jit(inline="always", nogil=True)
    def add_normed(
        hidden: np.ndarray, block_out: np.ndarray, weight: np.ndarray, eps: np.float32
    ) -> None:
        """hidden += rms_norm(block_out) * weight, row by row (block_out normed in place),
        as the layer-by-layer path's `hidden += norm(o(x))` rounds it."""
        rms_norm(block_out, weight, eps, block_out)
        for t in range(hidden.shape[0]):
            for c in range(0, hidden.shape[1], lanes):
                lanes_add(hidden[t, c : c + lanes], block_out[t, c : c + lanes], lanes)

    @jit(inline="always", nogil=True)
    def end_phase(
        sync: np.ndarray,
        workers: int,
        passed: int,
        prof: np.ndarray,
        worker: int,
        phase: int,
        mark: int,
    ) -> tuple[int, int]:
        """The barrier that ends a phase, and with `profiled` the cycles from `mark` to the
        barrier (working) and in it (waiting); returns the barrier count and a new mark."""
        arrived = mark
        if profiled:
            arrived = cycle_counter()
            prof[worker, phase, 0] += arrived - mark
        passed = barrier(sync, workers, passed)
        if profiled:
            mark = cycle_counter()
            prof[worker, phase, 1] += mark - arrived
        return passed, mark

    @jit(nogil=True, error_model="numpy")
    def step(
        hidden: np.ndarray,
        cos_sin: np.ndarray,
        slots: np.ndarray,
        norms: np.ndarray,
        final_norm: np.ndarray,
        eps: np.float32,
        qkv_codes: np.ndarray,
        o_codes: np.ndarray,
        gate_up_codes: np.ndarray,
        down_codes: np.ndarray,
        lm_codes: np.ndarray,
        qkv_scales: np.ndarray,
        o_scales: np.ndarray,
        gate_up_scales: np.ndarray,
        down_scales: np.ndarray,
        lm_scales: np.ndarray,
        qkv_codes2: np.ndarray,
        o_codes2: np.ndarray,
        gate_up_codes2: np.ndarray,
        down_codes2: np.ndarray,
        qkv_scales2: np.ndarray,
        o_scales2: np.ndarray,
        gate_up_scales2: np.ndarray,
        down_scales2: np.ndarray,
        layer_slots: np.ndarray,
        qkv_bias: np.ndarray,
        qk_norm: np.ndarray,
        rope: np.ndarray,
        post_norms: np.ndarray,
        windows: np.ndarray,
        k_caches: Any,
        v_caches: Any,
        d_rows: np.ndarray,
        d_tables: np.ndarray,
        d_lens: np.ndarray,
        r_rows: np.ndarray,
        r_counts: np.ndarray,
        r_tables: np.ndarray,
        r_lens: np.ndarray,
        scale: np.float32,
        normed: np.ndarray,
        qkv: np.ndarray,
        query: np.ndarray,
        attn_out: np.ndarray,
        act: np.ndarray,
        kept: np.ndarray,
        rows_at: np.ndarray,
        picked: np.ndarray,
        picked_normed: np.ndarray,
        logits: np.ndarray,
        argmax_at: np.ndarray,
        argmax_picked: np.ndarray,
        argmax_normed: np.ndarray,
        argmax_codes: np.ndarray,
        argmax_offsets: np.ndarray,
        argmax_scales: np.ndarray,
        argmax_bounds: np.ndarray,
        argmax_bounds_max: np.ndarray,
        argmax_norm_max: np.float32,
        argmax_grid_codes: np.ndarray,
        argmax_grid_scales: np.ndarray,
        row_codes: np.ndarray,
        row_words: np.ndarray,
        row_scales: np.ndarray,
        row_errors: np.ndarray,
        row_margins: np.ndarray,
        approx: np.ndarray,
        maxima: np.ndarray,
        found: np.ndarray,
        found_bounds: np.ndarray,
        exact: np.ndarray,
        tokens_out: np.ndarray,
        sync: np.ndarray,
        prof: np.ndarray,
        worker: int,
        workers: int,
    ) -> None:
        mark = cycle_counter() if profiled else 0
        tokens = hidden.shape[0]
        hidden_out = hidden.reshape(tokens, hidden_tiles, lanes)
        normed_out = normed.reshape(tokens, hidden_tiles, lanes)
        qkv_out = qkv.reshape(tokens, qkv_tiles, lanes)
        act_out = act.reshape(tokens, act_tiles, lanes)
        attn_rows = attn_out.reshape(tokens, nh * d)
        logits_out = logits.reshape(rows_at.shape[0], vocab_tiles, lanes)
        passed = 0
        # Each worker's share of the rows for the ops that work row by row.
        lo, hi = tokens * worker // workers, tokens * (worker + 1) // workers
        for layer in range(num_layers):
            k_cache, v_cache = k_caches[layer], v_caches[layer]
            rms_norm(hidden[lo:hi], norms[layer, 0], eps, normed[lo:hi])
            passed, mark = end_phase(
                sync, workers, passed, prof, worker, _START if layer == 0 else _NORM, mark
            )
            qkv_gemm(
                normed,
                qkv_codes,
                qkv_scales,
                qkv_codes2,
                qkv_scales2,
                layer_slots[0, layer],
                qkv_out,
                False,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _QKV, mark)
            if qkv_bias.shape[1]:  # the worker's rows, before their rotation
                bias = qkv_bias[layer]
                for t in range(lo, hi):
                    for i in range(bias.shape[0]):
                        qkv[t, i] += bias[i]
            cache_rows = k_cache.shape[0] * k_cache.shape[1]
            bad = rope_write_kv(
                qkv[lo:hi],
                cos_sin[lo:hi],
                slots[lo:hi],
                k_cache.reshape(cache_rows, slots_per_layer),
                v_cache.reshape(cache_rows, slots_per_layer),
                nh,
                nkv,
                qk_norm[layer],
                eps,
                rope[layer, 0],
                rope[layer, 1],
            )
            if bad >= 0 and sync[1] == 0:
                sync[1] = lo + bad + 1  # a bad token (the workers' own first ones race)
            passed, mark = end_phase(sync, workers, passed, prof, worker, _ROPE, mark)
            if sync[1] != 0:
                return
            window = windows[layer]
            decode(
                query,
                k_cache,
                v_cache,
                d_rows,
                d_tables,
                d_lens,
                scale,
                window,
                attn_out,
                worker,
                workers,
            )
            verify(
                query,
                k_cache,
                v_cache,
                r_rows,
                r_counts,
                r_tables,
                r_lens,
                scale,
                window,
                attn_out,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _ATTENTION, mark)
            n = tokens
            if layer == num_layers - 1 and kept.shape[0] < tokens:
                n = kept.shape[0]
                if worker == 0:  # kept[j] >= j: each row moves down, over rows no longer read
                    for j in range(n):
                        attn_rows[j] = attn_rows[kept[j]]
                        hidden[j] = hidden[kept[j]]
                passed, mark = end_phase(sync, workers, passed, prof, worker, _ROWS, mark)
                lo, hi = n * worker // workers, n * (worker + 1) // workers
            # Gemma 3: each block's output goes to `normed` (read no more by then), and
            # is normed into the residual by each worker for its rows.
            sandwich = post_norms.shape[1] > 0
            o_gemm(
                attn_rows[:n],
                o_codes,
                o_scales,
                o_codes2,
                o_scales2,
                layer_slots[1, layer],
                normed_out[:n] if sandwich else hidden_out[:n],
                not sandwich,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _O, mark)
            if sandwich:  # the worker's rows, which it norms next: no barrier between
                add_normed(hidden[lo:hi], normed[lo:hi], post_norms[layer, 0], eps)
            rms_norm(hidden[lo:hi], norms[layer, 1], eps, normed[lo:hi])
            passed, mark = end_phase(sync, workers, passed, prof, worker, _NORM, mark)
            gate_up_gemm(
                normed[:n],
                gate_up_codes,
                gate_up_scales,
                gate_up_codes2,
                gate_up_scales2,
                layer_slots[2, layer],
                act_out[:n],
                False,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _GATE_UP, mark)
            down_gemm(
                act[:n],
                down_codes,
                down_scales,
                down_codes2,
                down_scales2,
                layer_slots[3, layer],
                normed_out[:n] if sandwich else hidden_out[:n],
                not sandwich,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _DOWN, mark)
            if sandwich:
                add_normed(hidden[lo:hi], normed[lo:hi], post_norms[layer, 1], eps)
                passed, mark = end_phase(sync, workers, passed, prof, worker, _NORM, mark)
        if worker == 0:
            for i in range(rows_at.shape[0]):
                picked[i] = hidden[rows_at[i]]
            rms_norm(picked, final_norm, eps, picked_normed)
            for i in range(argmax_at.shape[0]):
                argmax_picked[i] = hidden[argmax_at[i]]
            rms_norm(argmax_picked, final_norm, eps, argmax_normed)
        passed, mark = end_phase(sync, workers, passed, prof, worker, _NORM, mark)
        if rows_at.shape[0]:
            lm_gemm(picked_normed, lm_codes, lm_scales, logits_out, False, worker, workers)
        if argmax_at.shape[0]:
            quantize(
                argmax_normed,
                argmax_norm_max,
                row_codes,
                row_scales,
                row_errors,
                row_margins,
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _LM_HEAD, mark)
            approximate(
                row_words,
                row_scales,
                argmax_codes,
                argmax_offsets,
                argmax_scales,
                approx,
                maxima[worker],
                worker,
                workers,
            )
            passed, mark = end_phase(sync, workers, passed, prof, worker, _APPROXIMATE, mark)
            pick(
                argmax_normed,
                approx,
                maxima,
                row_errors,
                row_margins,
                argmax_bounds,
                argmax_bounds_max,
                argmax_grid_codes,
                argmax_grid_scales,
                found[worker],
                found_bounds[worker],
                exact[worker],
                tokens_out,
                worker,
                workers,
            )
        if profiled:
            last = _PICK if argmax_at.shape[0] else _LM_HEAD
            prof[worker, last, 0] += cycle_counter() - mark

    return step
