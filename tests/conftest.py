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
from tiny_models import RANDOM_NORMS, TINY_BASE, TINY_PRESETS

# Everything loads from local files; never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


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
