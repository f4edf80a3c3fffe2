"""The tiny random-weight models' configurations (transformers' own config classes), shared
by the `make_tiny_model` fixture and the tests that build configs from them. A module of
its own: `from conftest import` would pick whichever folder's conftest came first."""

from __future__ import annotations

from typing import Any

# Small enough to build in well under a second; vocab_size matches the default tokenizer.
TINY_BASE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,  # sharper attention than the default 0.02, so errors show
}
TINY_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3_rope": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    # head_dim 32, not hidden_size / num_heads = 16; q/k norms.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    # Phi-4-mini's shape of rope: half of each head rotates, LongRoPE past 64 positions.
    "phi3": (
        "Phi3Config",
        {
            "tie_word_embeddings": False,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.1, 3.4],
                "long_factor": [1.5, 3.0, 6.5, 11.0],
            },
            "pad_token_id": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    # Layer 1 without rotary embedding (NoPE).
    "smollm3": (
        "SmolLM3Config",
        {"no_rope_layers": [1, 0], "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # A local (sliding-window) and a global layer, each with its own rope; the window
    # covers the whole context. query_pre_attn_scalar differs from head_dim.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}
# Presets whose norm weights are randomised too (by default they start as the identity,
# which would hide a norm read wrongly).
RANDOM_NORMS = {"qwen3", "phi3", "smollm3", "gemma3"}
