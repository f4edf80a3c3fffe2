"""The building blocks every architecture's forward pass is made of: projections, norms,
rotary embeddings, attention over the paged KV cache, the gated MLP, the pre-norm decoder
layer, and the decoder skeleton (`DecoderModel`) that runs them over one flat batch.

One flat batch of tokens, no padding: the tokens of every running sequence are packed
into `input_ids [T]` with their `positions [T]`; attention goes through the paged KV
cache with `pagedinfer.kernels`. Logits are computed only for the rows that sample.
Weights use the fused layout: q/k/v are one `qkv_proj`, gate/up one `gate_up_proj`, so
each layer runs four GEMMs; parameters are named as in Hugging Face checkpoints otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer import kernels
from pagedinfer.kernels import AttentionMetadata
from pagedinfer.kernels.validation import check_paged_attention
from pagedinfer.service.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the global (or local) layers' rotary embedding and the
    cos/sin scale, as Hugging Face computes them per rope type."""
    dim = config.rotary_dim
    base, scaling = config.rope_of(local)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    # "dynamic" NTK equals the default below max_position_embeddings; the loader refuses
    # longer contexts, where it would depend on the running length.
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "longrope":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        return 1.0 / (factors * base**exponents), float(scaling["attention_factor"])
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
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position:
    the global layers' rope, or the local (sliding-window) layers' one."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.local = local
        half = config.rotary_dim // 2
        self.register_buffer(
            "cos_sin", torch.empty(config.max_position_embeddings, 2, half), persistent=False
        )
        if self.cos_sin.device.type != "meta":
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the table in place on its device: after `to_empty`, for example."""
        inv_freq, scale = rope_inv_freq(self.config, self.local)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        table = torch.stack((angles.cos() * scale, angles.sin() * scale), dim=1)
        self.cos_sin.copy_(table)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """cos and sin [T, 2, rotary_dim / 2] of positions [T]; once per forward, shared by
        layers."""
        return self.cos_sin[positions]

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """`apply_rotary`: what backends that run the model's layers themselves call."""
        apply_rotary(x, cos_sin)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, heads, dims] in place (neox style: the two halves form the pairs) by
    cos_sin [T, 2, dims / 2] (`RotaryEmbedding`). x may be a view of the leading dims of
    each head (partial rotary)."""
    cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated1 = x1 * cos - x2 * sin
    x2.mul_(cos).addcmul_(x1, sin)
    x1.copy_(rotated1)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), weight [out_features, in_features] as in checkpoints.

    Parameters are left uninitialised: the loader fills every one from the checkpoint.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += x @ weight.T (+ bias): fused into the GEMM in fp32; in 16-bit dtypes the
        product is rounded first, as a separate matmul and add round it (fusing the
        addition drifted several times further from the fp32 result in bf16)."""
        if out.dtype != torch.float32:
            out += F.linear(x, self.weight, self.bias)
            return
        out.addmm_(x, self.weight.t())
        if self.bias is not None:
            out += self.bias


class Embedding(nn.Module):
    """Token embeddings [vocab, hidden] (uninitialised until loaded); tied, also the LM
    head's weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim (the hidden size, or one head's dims)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In fp32, rounded once at the end for 16-bit input."""
        return (self.normalize(x) * self.weight.float()).to(x.dtype)

    def scale(self) -> torch.Tensor:
        """What x / rms(x) is multiplied by, fp32: the weight (a backend that runs the
        layers itself reads this, not `weight`)."""
        return self.weight.detach().float()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in fp32."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    """Self-attention of one layer over the paged KV cache: q/k/v in one GEMM, optionally
    an RMSNorm of each query and key head, the rotary embedding of the first `rotary_dim`
    dims of each head (none in a NoPE layer), paged attention, the output projection."""

    def __init__(self, config: ModelConfig, layer: int = 0, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.rotary_dim = 0 if layer in config.nope_layers else config.rotary_dim
        self.sliding_window = config.layer_window(layer)  # None: full attention
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> None:
        """residual += o_proj(attention(x)), in place."""
        self.o_proj.add_into(residual, self.attend(x, rope, kv_cache, attn))

    def attend(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention output [T, num_heads * head_dim] of x [T, hidden], before o_proj;
        writes the new tokens' keys and values into kv_cache."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent columns: normed and rotated in place, in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
            qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])
        if self.rotary_dim:
            apply_rotary(qk[..., : self.rotary_dim], rope)
        query = qk[:, : self.num_heads]
        key = qk[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        k_cache, v_cache = kv_cache
        # The model runner built valid metadata: skip the checks that read index tensors,
        # and all checks after the first layer's.
        validate = not attn.validated
        kernels.write_kv(
            key, value, k_cache, v_cache, attn.slot_mapping, check_values=False, validate=validate
        )
        args = (query, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc)
        window = self.sliding_window
        if validate:  # before the plan is built from the metadata
            check_paged_attention(
                *args, self.scale, None, check_values=False, sliding_window=window
            )
        # On CPU the layers of one forward (of one window) share the batch's attention plan.
        plan = (
            None if kernels.use_triton(k_cache) else attn.plan_for(query, k_cache, v_cache, window)
        )
        out = kernels.paged_attention(
            *args, self.scale, validate=False, plan=plan, sliding_window=window
        )
        attn.validated = True
        return out.view(num_tokens, self.q_size)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(
        self,
        config: ModelConfig,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> None:
        """residual += mlp(x), in place."""
        self.down_proj.add_into(residual, self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x), the down projection's input."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.activation(gate).mul_(up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: h += attention(norm(h)); h += mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The layer's GEMMs, in the order they run: q/k/v, o, gate/up, down."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def block_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """The norms of the attention's and the MLP's inputs, then of their outputs before
        they join the residual (None: added as they are; Gemma 3 norms them)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden is the residual stream; each block adds its output into it in place.
        self.self_attn(hidden, self.input_layernorm(hidden), rope, kv_cache, attn)
        self.mlp(hidden, self.post_attention_layernorm(hidden))
        return hidden


class DecoderModel(nn.Module):
    """A decoder over a flat token batch with a paged KV cache: token embeddings, the rope
    tables, the layers that `make_layer` builds, a final norm and the LM head. An
    architecture's module changes the pieces it needs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        # Local layers with a rope of their own read this table; the others `rotary`.
        self.local_rotary = (
            RotaryEmbedding(config, local=True)
            if config.local_layers and config.local_rope_theta is not None
            else None
        )
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_layers))
        self.norm = self.make_norm(config.hidden_size, config.rms_norm_eps)
        # Tied: the LM head reads embed_tokens.weight (no second parameter to keep in sync).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def make_layer(self, config: ModelConfig, layer: int) -> nn.Module:
        """Decoder layer number `layer`."""
        return DecoderLayer(config, layer)

    def make_norm(self, hidden_size: int, eps: float) -> nn.Module:
        """The final norm."""
        return RMSNorm(hidden_size, eps)

    def reset_buffers(self) -> None:
        """Recompute the computed (non-checkpoint) buffers, after `to_empty` for example."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_cache()

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden], nn.Linear's layout."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the new tokens through every layer; return the fp32 logits [S, vocab] of the
        rows logits_indices (int64 [S]) of the batch.

        input_ids, positions: int64 [T]. kv_caches: one (k_cache, v_cache) per layer,
        each [num_blocks, block_size, num_kv_heads, head_dim].
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries for {len(self.layers)} layers"
            )
        hidden = self.embed(input_ids)
        rope = self.rotary(positions)
        local_rope = rope if self.local_rotary is None else self.local_rotary(positions)
        local_layers = self.config.local_layers
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, local_rope if i in local_layers else rope, kv_cache, attn)
        # Only the sampled rows need the final norm and the (large) vocabulary projection.
        return self.compute_logits(self.norm(hidden[logits_indices]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] of input_ids [T]: the residual stream's start."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: fp32 logits [S, vocab] of final-normed hidden states [S, hidden]."""
        logits = F.linear(hidden, self.lm_head_weight()).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
