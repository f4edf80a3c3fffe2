"""A checkpoint of another family and size: Qwen2.5-0.5B's shape (or Qwen3-0.6B's) with
random weights.

Only the embedded model's weights are on this machine, so the benchmark checks that the
speed holds for other checkpoints with one of Qwen2.5-0.5B-Instruct's architecture and
shapes (24 layers, hidden 896, 14 query heads over 2 KV heads, MLP 4864, q/k/v biases,
tied embeddings), drawn at random and seeded, over the embedded model's tokenizer (so its
vocabulary, 49,152 tokens, not Qwen's). Speed depends on the shapes and the features, not
on the values; every system serves the same directory. Qwen3-0.6B's shape (28 layers,
hidden 1024, 16 query heads of 128 dims over 8 KV heads, MLP 3072, q/k head norms, no
biases, tied embeddings) is the other family checked the same way.

    python benchmarks/peers/shaped_checkpoint.py qwen3  # the directory, built once
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
# Per family: transformers' config class, the shape and the name of the directory.
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen2": ("Qwen2Config", QWEN2_0_5B_SHAPE, "qwen2-0.5b"),
    "qwen3": ("Qwen3Config", QWEN3_0_6B_SHAPE, "qwen3-0.6b"),
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
) -> Path:
    """Write a checkpoint of `config_class` (a transformers config class) and `shape`
    (default the module doc's Qwen2) over the embedded model's tokenizer to `target`: fp32
    safetensors, seeded random weights and biases."""
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
    with staged_directory(target) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
    return target


def ensure_shaped_model(seed: int = 0, family: str = "qwen2") -> Path:
    """The family's shaped checkpoint (`SHAPES`: Qwen2.5-0.5B's or Qwen3-0.6B's), built
    once into pagedinfer's cache."""
    config_class, shape, name = SHAPES[family]
    key = hashlib.sha256(f"{name}|{sorted(shape.items())}|{seed}".encode())
    target = cache_dir() / "models" / f"{name}-shaped-{key.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    return make_shaped_checkpoint(target, seed, shape, config_class)


if __name__ == "__main__":
    print(ensure_shaped_model(family=sys.argv[1] if len(sys.argv) > 1 else "qwen2"))
    sys.exit(0)
