"""Qwen3 (dense): the Llama decoder with an RMSNorm of each query and key head.

    q, k, v = split(qkv_proj(rms_norm(h)))
    q, k = rope(q_norm(q)), rope(k_norm(k))        # per head, over head_dim

No q/k/v biases (unlike Qwen2), and head_dim is the config's own, not
hidden_size / num_heads. The norms are `Attention`'s (the config's `qk_norm`); this
module names the architecture and keeps that fact checked.
"""

from __future__ import annotations

from pagedinfer.service.models.config import ModelConfig
from pagedinfer.service.models.llama import LlamaModel


class Qwen3Model(LlamaModel):
    """A Qwen3 decoder over a flat token batch with a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        if not config.qk_norm:
            raise ValueError("a Qwen3 config must have qk_norm (its heads are RMS-normed)")
        super().__init__(config)
