"""Our forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM).

They differ only in config facts (biases, tying, rope scaling), not in code: the
pre-norm decoder of `layers`, h += attention(rms_norm(h)); h += mlp(rms_norm(h)), with a
SiLU-gated MLP and a rotary embedding of every head. This is the reference every backend
must match: plain torch over the kernel contract (see `layers`).
"""

from __future__ import annotations

from pagedinfer.kernels import AttentionMetadata
from pagedinfer.service.models.config import FEATURES, SUPPORTED_ROPE_TYPES, ModelConfig
from pagedinfer.service.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    DecoderModel,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_inv_freq,
)

__all__ = [
    "FEATURES",
    "MLP",
    "SUPPORTED_ROPE_TYPES",
    "Attention",
    "AttentionMetadata",
    "DecoderLayer",
    "Embedding",
    "Linear",
    "LlamaModel",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_inv_freq",
]


class LlamaModel(DecoderModel):
    """A Llama-family decoder over a flat token batch with a paged KV cache."""
