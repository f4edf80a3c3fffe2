"""Shared fixtures: the converted default model and tiny random-weight model directories.

torch and transformers are imported inside the fixtures, so suites that do not use
them (operator, charts) do not pay for the imports.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Everything loads from local files; never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

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


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) converted to safetensors."""
    from pagedinfer.service.loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def make_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Callable[..., Path]:
    """Factory: `make_tiny_model(preset, **overrides)`, preset a key of TINY_PRESETS.

    Saves a random-weight model with transformers' own config class (seeded, so it is
    reproducible) plus the default model's tokenizer, and returns its directory.
    Directories are cached per (preset, overrides) for the session.
    """
    import torch
    import transformers

    made: dict[str, Path] = {}

    def make(preset: str, **overrides: Any) -> Path:
        key = f"{preset}-{sorted(overrides.items())}"
        if key in made:
            return made[key]
        class_name, preset_kwargs = TINY_PRESETS[preset]
        config = getattr(transformers, class_name)(**{**TINY_BASE, **preset_kwargs, **overrides})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Random-init biases are zero; make every bias a model has count.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    torch.nn.init.normal_(param, std=0.5)
                elif preset in RANDOM_NORMS and "norm" in name:
                    param.add_(torch.randn_like(param), alpha=0.3)
        out = tmp_path_factory.mktemp(f"tiny-{preset}")
        model.save_pretrained(out)
        for file in TOKENIZER_FILES:
            if (default_model_dir / file).is_file():
                shutil.copy(default_model_dir / file, out / file)
        made[key] = out
        return out

    return make
