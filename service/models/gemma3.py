"""Gemma 3 (text): a decoder with norms on both sides of each block, scaled embeddings,
a GeGLU MLP, per-head q/k norms, and local (sliding-window) layers interleaved with
global ones, each kind with its own rotary embedding.

    h = embed(x) * sqrt(hidden_size)
    h += post_attention_norm(attention(input_norm(h)))
    h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))
    logits = lm_head(norm(h))                              (tied to the embeddings)

    norm(x)      = x / rms(x) * (1 + weight)               every norm, q/k norms included
    mlp(x)       = down(gelu_tanh(gate(x)) * up(x))
    attention    : q, k = rope(q_norm(q)), rope(k_norm(k)); scores scaled by
                   query_pre_attn_scalar**-0.5; local layers rotate with their own base
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.kernels import AttentionMetadata
from pagedinfer.service.models.config import ModelConfig
from pagedinfer.service.models.layers import MLP, Attention, DecoderModel, Linear, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): a checkpoint's zero weight is the identity scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalize(x) * (1.0 + self.weight.float())).to(x.dtype)

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.detach().float()


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 layer: each block's output is normed before it joins the residual."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(config, activation=partial(F.gelu, approximate="tanh"))
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The layer's GEMMs, in the order they run: q/k/v, o, gate/up, down."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def block_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """The attention's and the MLP's input norms, then their outputs' (`forward`)."""
        return (
            self.input_layernorm,
            self.pre_feedforward_layernorm,
            self.post_attention_layernorm,
            self.post_feedforward_layernorm,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        attention = self.self_attn.attend(self.input_layernorm(hidden), rope, kv_cache, attn)
        hidden += self.post_attention_layernorm(self.self_attn.o_proj(attention))
        mlp = self.mlp.down_proj(self.mlp.hidden(self.pre_feedforward_layernorm(hidden)))
        hidden += self.post_feedforward_layernorm(mlp)
        return hidden


class Gemma3Model(DecoderModel):
    """A Gemma 3 text decoder over a flat token batch with a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        if not config.qk_norm or config.query_pre_attn_scalar is None:
            raise ValueError("a Gemma 3 config must have qk_norm and query_pre_attn_scalar")
        super().__init__(config)

    def make_layer(self, config: ModelConfig, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(config, layer)

    def make_norm(self, hidden_size: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(hidden_size, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """embed(x) * sqrt(hidden_size), the scale rounded to the weights' dtype first."""
        weight = self.embed_tokens.weight
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=weight.dtype, device=weight.device)
        return self.embed_tokens(input_ids) * scale
