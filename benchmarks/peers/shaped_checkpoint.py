"""Checkpoints of the families and sizes users serve, with random weights.

Only the embedded model's weights are on this machine, so the benchmarks check that the
speed holds for checkpoints with the architecture and shapes of published ones (`SHAPES`:
Qwen2.5-0.5B, Qwen3-0.6B and 1.7B, Llama-3.2-1B, Gemma-3-1B, and Phi-4-mini's and
SmolLM3-3B's layers at a third or a quarter of their depth, so that every one fits beside
a peer in memory), drawn at random and seeded, over the embedded model's tokenizer (so its
vocabulary, 49,152 tokens, not theirs). Speed depends on the shapes and the features, not
on the values; every system serves the same directory. Each is stored in fp32, or in bf16
as most checkpoints are published.

    python benchmarks/peers/shaped_checkpoint.py qwen3 [bfloat16]  # built once
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from pagedinfer.service.loader import cache_dir, ensure_default_model

if not __package__:  # run as a script: the benchmarks directory holds its package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers.paths import staged_directory

# Qwen2.5-0.5B-Instruct's config.json, but for the vocabulary (the embedded tokenizer's).
QWEN2_0_5B_SHAPE = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Qwen3-0.6B's config.json, but for the vocabulary (the embedded tokenizer's).
QWEN3_0_6B_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Qwen3-1.7B's config.json, but for the vocabulary.
QWEN3_1_7B_SHAPE = {**QWEN3_0_6B_SHAPE, "hidden_size": 2048, "intermediate_size": 6144}
# Llama-3.2-1B's config.json (llama3 rope scaling, tied embeddings), but for the vocabulary.
LLAMA3_1B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
# Gemma-3-1B's config.json (5 sliding-window layers to 1 global, q/k norms, sandwich norms,
# GELU-tanh MLP), but for the vocabulary.
GEMMA3_1B_SHAPE = {
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Phi-4-mini's layer (3/4 of each head rotates, LongRoPE) at 8 of its 32 layers: about
# 1B parameters. The LongRoPE factors are made up; their values do not change the speed.
PHI4_MINI_8_LAYERS_SHAPE = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 8,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0] * 48,
        "long_factor": [1.0 + i / 8 for i in range(48)],
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
# SmolLM3-3B's layer (every 4th layer without rotary embedding) at 12 of its 36 layers.
SMOLLM3_12_LAYERS_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 65536,
    "rope_theta": 5000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": None,  # SmolLM3's own (128004) lies past the embedded vocabulary
}
# Per family: transformers' config class, the shape and the name of the directory.
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen2": ("Qwen2Config", QWEN2_0_5B_SHAPE, "qwen2-0.5b"),
    "qwen3": ("Qwen3Config", QWEN3_0_6B_SHAPE, "qwen3-0.6b"),
    "qwen3-1.7b": ("Qwen3Config", QWEN3_1_7B_SHAPE, "qwen3-1.7b"),
    "llama3-1b": ("LlamaConfig", LLAMA3_1B_SHAPE, "llama-3.2-1b"),
    "gemma3-1b": ("Gemma3TextConfig", GEMMA3_1B_SHAPE, "gemma-3-1b"),
    "phi4-mini-8l": ("Phi3Config", PHI4_MINI_8_LAYERS_SHAPE, "phi-4-mini-8-layers"),
    "smollm3-12l": ("SmolLM3Config", SMOLLM3_12_LAYERS_SHAPE, "smollm3-3b-12-layers"),
}
# The embedded model's files that a checkpoint over its tokenizer takes as they are.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Random biases (transformers starts them at zero): a bias that is all zeros is no test.
BIAS_STD = 0.02


def make_shaped_checkpoint(
    target: Path,
    seed: int = 0,
    shape: dict[str, Any] = QWEN2_0_5B_SHAPE,
    config_class: str = "Qwen2Config",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a checkpoint of `config_class` (a transformers config class) and `shape`
    (default Qwen2.5-0.5B's) over the embedded model's tokenizer to `target`: safetensors
    in `dtype`, seeded random weights and biases (drawn in fp32, then rounded)."""
    import transformers
    from transformers import AutoModelForCausalLM

    source = ensure_default_model()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    make_config = getattr(transformers, config_class)
    config = make_config(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(param, std=BIAS_STD)
    model.to(dtype)
    with staged_directory(target) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
    return target


def ensure_shaped_model(
    seed: int = 0, family: str = "qwen2", dtype: torch.dtype = torch.float32
) -> Path:
    """The shaped checkpoint of `family` (a key of `SHAPES`) stored in `dtype`, built once
    into pagedinfer's cache."""
    config_class, shape, name = SHAPES[family]
    suffix = "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    key = hashlib.sha256(f"{name}|{sorted(shape.items())}|{seed}{suffix}".encode())
    target = cache_dir() / "models" / f"{name}-shaped{suffix}-{key.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    return make_shaped_checkpoint(target, seed, shape, config_class, dtype)


if __name__ == "__main__":
    family = sys.argv[1] if len(sys.argv) > 1 else "qwen2"
    stored = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    print(ensure_shaped_model(family=family, dtype=stored))
    sys.exit(0)
