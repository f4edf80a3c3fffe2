"""Our forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM).

One flat batch of tokens, no padding: the tokens of every running sequence are packed
into `input_ids [T]` with their `positions [T]`; attention goes through the paged KV
cache with `pagedinfer.kernels`. Logits are computed only for the rows that sample.

Weights use the fused layout: q/k/v are one `qkv_proj`, gate/up one `gate_up_proj`,
so each layer runs four GEMMs. The loader fills them from Hugging Face checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer import kernels
from pagedinfer.kernels import torch_ops
from pagedinfer.kernels.validation import check_paged_attention, check_write_kv

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelConfig:
    """The architecture facts our forward pass needs, whatever checkpoint they came from."""

    architecture: str  # "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2; Llama with attention_bias)
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )


@dataclass
class AttentionMetadata:
    """Where the batch's tokens live in the paged KV cache; built by the model runner.

    slot_mapping: int64 [T], cache slot of each new token (-1 = skip).
    block_tables: int32 [num_seqs, max_blocks_per_seq].
    seq_lens: int32 [num_seqs], context length of each sequence including its new tokens.
    query_start_loc: int32 [num_seqs + 1], sequence i owns tokens qsl[i]:qsl[i + 1].
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # The CPU kernel's grouping, indices and masks: the same for every layer, so they
    # are built by the first layer's call and reused by the others.
    cpu_plan: torch_ops.AttentionPlan | None = None
    # Set once the first layer's kernel calls have checked the batch: the later layers'
    # tensors match in shape, dtype and device, so their calls skip the checks.
    validated: bool = False

    def torch_plan(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch_ops.AttentionPlan:
        block_size = k_cache.shape[1]
        if self.cpu_plan is None or self.cpu_plan.block_size != block_size:
            self.cpu_plan = torch_ops.plan_for(
                query, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc
            )
        return self.cpu_plan


@functools.cache
def cpu_layer() -> ModuleType:
    """`kernels.cpu_layer`, imported on first use: it imports numba."""
    from pagedinfer.kernels import cpu_layer as module

    return module


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, as Hugging Face computes them per rope type."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    # "dynamic" NTK equals the default below max_position_embeddings; the loader refuses
    # longer contexts, where it would depend on the running length.
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    original_max = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    if rope_type == "llama3":
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        low_freq_wavelen = original_max / low_freq_factor
        high_freq_wavelen = original_max / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    return _yarn_inv_freq(scaling, dim, base, factor, original_max)


def _yarn_inv_freq(
    scaling: dict[str, Any], dim: int, base: float, factor: float, original_max: int
) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        half = config.head_dim // 2
        self.register_buffer(
            "cos_sin", torch.empty(config.max_position_embeddings, 2, half), persistent=False
        )
        if self.cos_sin.device.type != "meta":
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the table in place on its device: after `to_empty`, for example."""
        inv_freq, scale = rope_inv_freq(self.config)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        table = torch.stack((angles.cos() * scale, angles.sin() * scale), dim=1)
        self.cos_sin.copy_(table)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """cos and sin [T, 2, head_dim / 2] of positions [T]; once per forward, shared by layers."""
        return self.cos_sin[positions]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, heads, head_dim] in place (neox style: the two halves form the pairs)
    by cos_sin [T, 2, head_dim / 2] (`RotaryEmbedding`)."""
    cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated1 = x1 * cos - x2 * sin
    x2.mul_(cos).addcmul_(x1, sin)
    x1.copy_(rotated1)


# The batch size oneDNN tunes a packed weight's layout for. Any batch runs on it; with 32,
# SmolLM2's layer GEMMs in bf16 ran 1.5-1.9x faster than unpacked from 1 to 128 tokens
# and 10% slower at 512 (measured on an AMX CPU, 2 threads).
PACK_BATCH_HINT = 32


def cpu_weight_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether bf16 weights on this CPU can be packed for oneDNN's AMX/AVX512-BF16 GEMMs."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch_ops.native_bf16()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """weight [out_features, in_features] (nn.Linear's layout) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# The batch size MKL tunes an fp32 packed weight's layout for. A packed weight serves any
# batch (`mkl_linear`). Packed for 128, SmolLM2's layer GEMMs ran 1.1-1.5x faster than
# dense from 4 to 64 tokens, 1.07-1.16x from 128 to 512, level at 2-3 and 14% slower at
# one token; the LM head 1.1-2.5x faster at every row count. Packed for 4-16 they ran
# slower than dense from 24 tokens up (measured on an AVX-512 CPU, 2 threads).
MKL_PACK_BATCH_HINT = 128


def cpu_mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fp32 weights on this CPU can be packed for MKL's sgemm (torch built with MKL)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


@dataclass
class MKLPacked:
    """An fp32 weight [out_features, in_features] in MKL's packed layout, and its shape.

    torch's `_mkl_linear` takes the dense weight too, and reads it only to fall back when
    the batch size differs from the one it is given. `mkl_linear` always gives the
    batch's own, so a stand-in of the right shape (one element, broadcast) takes its place
    and the dense weight can go.
    """

    packed: torch.Tensor
    shape_only: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, batch_hint: int = MKL_PACK_BATCH_HINT) -> MKLPacked:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        return cls(packed, torch.zeros(1, dtype=weight.dtype).expand(weight.shape))


def mkl_linear(x: torch.Tensor, weight: MKLPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the packed weight, for a batch of any size."""
    return torch.ops.mkl._mkl_linear(x, weight.packed, weight.shape_only, bias, x.shape[0])


class Linear(nn.Module):
    """y = x @ weight (+ bias) with weight stored [in_features, out_features].

    The transpose of nn.Linear's layout: on CPU, MKL runs these GEMMs 10-60% faster at
    the 8-128 token batches of serving than x @ weight.T (measured, fp32). On CPU the
    loader then packs the weights once, in place of this layout: fp32 for MKL's sgemm
    (`pack_mkl`), bf16 for oneDNN where the CPU has native bf16 (`pack`). GPUs, and CPUs
    where neither applies, run this layout.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Where the engine packed the weight (see `pack`), the dense copy is gone.
        self.packed: torch.Tensor | None = None  # oneDNN's layout (bf16)
        self.mkl: MKLPacked | None = None  # MKL's layout (fp32)
        # The GEMM from the weight's quantisation grid, for calls of up to grid_rows rows,
        # where the model keeps one (`use_grid`).
        self.grid: Callable[..., torch.Tensor] | None = None
        self.grid_rows = 0

    def pack(self) -> None:
        """Reorder the weight into oneDNN's layout (bf16), once; every later call uses it.

        The dense copy moves to the meta device: shape, dtype and the parameter count
        stay, the memory is released, and any use of it outside this path fails loudly.
        """
        self.packed = pack_weight(self.weight.t())
        self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def pack_mkl(self) -> None:
        """Reorder the weight into MKL's layout (fp32), once, in place of the dense copy."""
        self.mkl = MKLPacked.of(self.weight.t())
        self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def use_grid(self, grid: Callable[..., torch.Tensor], rows: int) -> None:
        """Take GEMMs of up to `rows` rows from the weight's grid: grid(x, out=None,
        add=False) as `cpu_gemm.grid_linear`, summing as MKL sums larger calls (the fused
        step's GEMMs, so a step gives the same bits either way)."""
        self.grid, self.grid_rows = grid, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.grid is not None and x.shape[0] <= self.grid_rows:
            return self.grid(x.contiguous())
        if self.mkl is not None:
            return mkl_linear(x, self.mkl, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += x @ weight (+ bias), with the addition fused into the GEMM where it can be."""
        if self.packed is not None:
            out += packed_linear(x, self.packed, self.bias)
            return
        if self.grid is not None and x.shape[0] <= self.grid_rows and out.is_contiguous():
            self.grid(x.contiguous(), out=out, add=True)
            return
        if self.mkl is not None:
            out += mkl_linear(x, self.mkl, self.bias)
            return
        out.addmm_(x, self.weight)
        if self.bias is not None:
            out += self.bias


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # For the CPU path; on the CPU whatever device the model is built on (meta first).
        self._eps = torch.tensor(eps, dtype=torch.float32, device="cpu")

    def forward(self, x: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """compiled: x is fp32 on CPU and the compiled kernels serve it (`LlamaModel`)."""
        if compiled:
            return cpu_layer().rms_norm(x, self.weight, self.eps)
        # In fp32, rounded once at the end for 16-bit input (Hugging Face rounds after
        # normalising and again after scaling: within one ulp).
        if x.is_cuda:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        # On CPU, rms_norm runs as separate passes: one fused vector_norm reduction and
        # two multiplies are 10x faster at 512 tokens (75 vs 756 us, fp32) and as fast
        # at one token. At decode sizes each op's dispatch is most of its cost, so no-op
        # conversions are skipped and mean(x^2) + eps is one addcmul.
        fp32 = x.dtype == torch.float32
        xf = x if fp32 else x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        scale = torch.addcmul(self._eps, norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
        weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        out = (xf * scale).mul_(weight)
        return out if fp32 else out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the q/k/v GEMM's output: q and k heads together (adjacent columns,
        rotated in one pass), k heads, v heads; each [tokens, heads, head_dim]."""
        num_tokens = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        value = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        return qk, qk[:, self.num_heads :], value

    def forward(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        compiled: bool = False,
    ) -> None:
        """residual += attention(x), in place. compiled: as in `RMSNorm.forward`."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        query = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        # The model runner built valid metadata: skip the checks that read index tensors,
        # and all checks after the first layer's.
        validate = not attn.validated
        if compiled:  # rotation and cache write in one kernel, reading qkv's rows once
            if validate:
                _, key, value = self.split_qkv(qkv)
                check_write_kv(key, value, k_cache, v_cache, attn.slot_mapping, False)
            cpu_layer().rope_write_kv(
                qkv, rope, attn.slot_mapping, k_cache, v_cache, self.num_heads
            )
        else:
            qk, key, value = self.split_qkv(qkv)
            apply_rotary(qk, rope)
            kernels.write_kv(
                key,
                value,
                k_cache,
                v_cache,
                attn.slot_mapping,
                check_values=False,
                validate=validate,
            )
        args = (query, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc)
        if validate:  # before the plan is built from the metadata
            check_paged_attention(*args, self.scale, None, check_values=False)
        # On CPU the layers of one forward share the batch's attention plan.
        plan = None if kernels.use_triton(k_cache) else attn.torch_plan(*args[:3])
        out = kernels.paged_attention(*args, self.scale, validate=False, plan=plan)
        attn.validated = True
        self.o_proj.add_into(residual, out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, residual: torch.Tensor, x: torch.Tensor, compiled: bool = False) -> None:
        """residual += mlp(x), in place. compiled: as in `RMSNorm.forward`."""
        gate_up = self.gate_up_proj(x)
        if compiled:
            self.down_proj.add_into(residual, cpu_layer().silu_mul(gate_up))
            return
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        self.down_proj.add_into(residual, F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The layer's GEMMs, in the order they run: q/k/v, o, gate/up, down."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def forward(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        compiled: bool = False,
    ) -> torch.Tensor:
        """compiled: the ops between the GEMMs run in `kernels.cpu_layer`'s kernels."""
        # hidden is the residual stream; each block adds its output into it in place.
        normed = self.input_layernorm(hidden, compiled)
        self.self_attn(hidden, normed, rope, kv_cache, attn, compiled)
        self.mlp(hidden, self.post_attention_layernorm(hidden, compiled), compiled)
        return hidden


class Logits(NamedTuple):
    """What a forward pass gives for its sampled rows."""

    logits: torch.Tensor  # fp32 [S, vocab]; a row with a token in `tokens` is left unwritten
    # int64 [S] or None: the argmax of each greedy row that the model picked without its
    # logits (`kernels.cpu_argmax`), -1 for every other row.
    tokens: torch.Tensor | None = None


class LlamaModel(nn.Module):
    """A Llama-family decoder over a flat token batch with a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied: the LM head reads embed_tokens.weight (no second parameter to keep in sync).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.lm_head_packed: torch.Tensor | None = None  # set by pack_weights
        self.lm_head_mkl: MKLPacked | None = None  # set by pack_weights_mkl
        self.lm_head_grid: Callable[..., torch.Tensor] | None = None  # as Linear.grid
        self.lm_head_grid_rows = 0
        self.lm_head_argmax: Any = None  # kernels.cpu_argmax.ArgmaxWeights, as Linear.grid
        # Set by pack_weights_mkl where every GEMM weight lies on a quantisation grid whose
        # GEMM can sum as MKL sums large ones: steps of a few tokens then run as one call.
        self.fused: Any = None  # kernels.cpu_step.FusedWeights
        # int64 [threads, phases, 2], or None: each fused step adds the cycles its workers
        # spend per phase (`kernels.cpu_step.fused_forward`), for profiling.
        self.step_profile: np.ndarray | None = None
        self._cache_arrays: Any = None  # kernels.cpu_step.CacheArrays of the last step

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> None:
        """Pack every GEMM weight for oneDNN (see `cpu_weight_packing_available`).

        The LM head gets a packed copy of its own when it is tied to the embeddings,
        which the token lookup still reads densely.
        """
        for layer in self.layers:
            for linear in layer.linears():
                linear.pack()
        self.lm_head_packed = pack_weight(self.lm_head_weight())
        if self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.to("meta"), requires_grad=False)

    def pack_weights_mkl(self) -> None:
        """Pack every fp32 GEMM weight for MKL (see `cpu_mkl_packing_available`); as with
        `pack_weights`, a tied LM head gets a packed copy of its own. Where the compiled
        kernels are in use and the weights lie on a quantisation grid (a dequantised GGUF
        model), also keep them as that grid for the fused step (`kernels.cpu_step`)."""
        grids = self._grids() if torch_ops.compiled_kernels() else None
        for layer in self.layers:
            for linear in layer.linears():
                linear.pack_mkl()
        self.lm_head_mkl = MKLPacked.of(self.lm_head_weight())
        if self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.to("meta"), requires_grad=False)
        if grids is not None:
            self.fused = self._fused_weights(*grids)

    def _grids(self) -> tuple[list[list[Any]], Any] | None:
        """Every GEMM weight's grid (`kernels.cpu_gemm.to_grid`), or None where one has
        none or a GEMM has a bias (the fused step adds none)."""
        from pagedinfer.kernels import cpu_gemm  # imports numba

        config = self.config
        if config.attention_bias or config.o_proj_bias or config.mlp_bias:
            return None
        layers = []
        for layer in self.layers:
            grids = [cpu_gemm.to_grid(linear.weight.t()) for linear in layer.linears()]
            if any(g is None for g in grids):
                return None
            layers.append(grids)
        lm_head = cpu_gemm.to_grid(self.lm_head_weight())
        return None if lm_head is None else (layers, lm_head)

    def _fused_weights(self, layers: list[list[Any]], lm_head: Any) -> Any:
        """The fused step's weights, if the grids can give MKL's bits for each GEMM shape
        (summed in the order MKL sums on this machine); every GEMM then takes calls of a
        few rows from its grid (`Linear.use_grid`), so that a row comes out the same in
        a step of any size and through either path."""
        from pagedinfer.kernels import cpu_argmax, cpu_gemm, cpu_step  # import numba

        libraries = [*(linear.mkl for linear in self.layers[0].linears()), self.lm_head_mkl]
        orders = []
        for grid, mkl in zip([*layers[0], lm_head], libraries, strict=True):
            order = cpu_gemm.library_order(
                grid, functools.partial(mkl_linear, weight=mkl, bias=None)
            )
            if order is None:
                return None
            orders.append(order)
        rows = cpu_gemm.rows_faster(
            [
                (grid, order, functools.partial(mkl_linear, weight=linear.mkl, bias=None))
                for layer, grids in zip(self.layers, layers, strict=True)
                for linear, grid, order in zip(layer.linears(), grids, orders, strict=False)
            ]
        )
        norms = torch.stack(
            [
                torch.stack((layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
                for layer in self.layers
            ]
        )
        # Greedy rows' tokens without their logits, where that is faster here.
        argmax = cpu_argmax.ArgmaxWeights.of(lm_head, orders[4]) if cpu_argmax.fast() else None
        # The fused step takes every step of up to GRID_MAX_ROWS tokens, even where the
        # library's GEMMs alone are faster (`rows` above, which the layer-by-layer path
        # keeps): its attention, norms and rope save more. On an Intel Xeon, where the
        # library's GEMMs were faster from 16-32 rows, the speculative system's workload
        # (`benchmarks/throughput.py`) took 5.1-5.4 s with every step fused, against
        # 5.5-5.7 with steps of up to 32 tokens and 7.6-7.9 with up to 16.
        fused = cpu_step.FusedWeights.stack(
            layers,
            lm_head,
            orders,
            cpu_gemm.GRID_MAX_ROWS,
            norms.detach().numpy(),
            self.norm.weight.detach().numpy(),
            self.config.rms_norm_eps,
            argmax,
        )
        if fused is None:
            return None
        for i, layer in enumerate(self.layers):
            for position, (linear, grid) in enumerate(zip(layer.linears(), layers[i], strict=True)):
                # A view of the stacked grid: the fused step's arrays serve both paths.
                codes, scales = fused.codes[position][i], fused.scales[position][i]
                view = dataclasses.replace(grid, codes=codes, scales=scales)
                gemm = functools.partial(cpu_gemm.grid_linear, weight=view, order=orders[position])
                linear.use_grid(gemm, rows)
        self.lm_head_grid = functools.partial(cpu_gemm.grid_linear, weight=lm_head, order=orders[4])
        self.lm_head_grid_rows = rows
        self.lm_head_argmax = argmax
        return fused

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy: torch.Tensor | None = None,
    ) -> Logits:
        """Run the new tokens through every layer; return the fp32 logits [S, vocab] of the
        rows logits_indices (int64 [S]) of the batch.

        input_ids, positions: int64 [T]. kv_caches: one (k_cache, v_cache) per layer,
        each [num_blocks, block_size, num_kv_heads, head_dim]. greedy: bool [S], the rows
        whose only use is their argmax (greedy sampling without penalties or logprobs):
        where it can, the model picks their tokens without computing their logits.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries for {len(self.layers)} layers"
            )
        if greedy is not None and greedy.shape != logits_indices.shape:
            raise ValueError(
                f"greedy has shape {tuple(greedy.shape)}, logits_indices "
                f"{tuple(logits_indices.shape)}"
            )
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        # fp32 on CPU: the ops between the GEMMs run in `kernels.cpu_layer`'s kernels.
        compiled = torch_ops.compiled_kernels() and cpu_layer().supports(hidden, rope)
        if compiled and self.fused is not None:
            out = self._fused_step(hidden, rope, kv_caches, attn, logits_indices, greedy)
            if out is not None:
                return out
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, rope, kv_cache, attn, compiled)
        # Only the sampled rows need the final norm and the (large) vocabulary projection.
        normed = self.norm(hidden[logits_indices], compiled)
        if greedy is None or self.lm_head_argmax is None or not bool(greedy.any()):
            return Logits(self.compute_logits(normed))
        from pagedinfer.kernels import cpu_argmax  # imports numba

        tokens = torch.full(logits_indices.shape, -1, dtype=torch.int64)
        tokens[greedy] = cpu_argmax.lm_head_argmax(normed[greedy], self.lm_head_argmax)
        logits = torch.empty(normed.shape[0], self.config.vocab_size)  # picked rows' unwritten
        needed = tokens < 0
        if bool(needed.any()):
            logits[needed] = self.compute_logits(normed[needed])
        return Logits(logits, tokens)

    def _fused_step(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy: torch.Tensor | None,
    ) -> Logits | None:
        """The step as one compiled call (`kernels.cpu_step`), where it serves the batch:
        up to `FusedWeights.max_tokens` new tokens, every sequence's on the compiled
        attention kernels, caches the kernels take. None: the step runs layer by layer."""
        from pagedinfer.kernels import cpu_decode, cpu_step  # import numba

        config = self.config
        tokens = hidden.shape[0]
        if tokens > self.fused.max_tokens:
            return None
        k_cache, v_cache = kv_caches[0]
        query = hidden.new_empty(tokens, config.num_heads, config.head_dim)
        if kernels.use_triton(k_cache) or not cpu_decode.supports(query, k_cache, v_cache):
            return None
        qsl = attn.query_start_loc
        args = (query, k_cache, v_cache, attn.block_tables, attn.seq_lens, qsl)
        scale = config.head_dim**-0.5
        if not attn.validated:  # the checks the first layer's calls make
            key = hidden.new_empty(tokens, config.num_kv_heads, config.head_dim)
            check_write_kv(key, key, k_cache, v_cache, attn.slot_mapping, False)
            check_paged_attention(*args, scale, None, check_values=False)
        plan = attn.torch_plan(query, k_cache, v_cache)
        if plan.groups:
            return None
        attn.validated = True
        shape = cpu_step.StepShape(
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            block_size=k_cache.shape[1],
        )
        self._cache_arrays = cpu_step.cache_arrays(kv_caches, self._cache_arrays)
        logits, tokens = cpu_step.fused_forward(
            self.fused,
            shape,
            hidden,
            rope,
            attn.slot_mapping,
            kv_caches,
            plan,
            logits_indices,
            scale,
            None if greedy is None else greedy.numpy(),
            self.step_profile,
            self._cache_arrays,
        )
        return Logits(logits, tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: fp32 logits [S, vocab] of final-normed hidden states [S, hidden]."""
        if self.lm_head_packed is not None:
            return packed_linear(hidden, self.lm_head_packed, None).float()
        if self.lm_head_grid is not None and hidden.shape[0] <= self.lm_head_grid_rows:
            return self.lm_head_grid(hidden.contiguous())
        if self.lm_head_mkl is not None:
            return mkl_linear(hidden, self.lm_head_mkl, None)
        return F.linear(hidden, self.lm_head_weight()).float()
