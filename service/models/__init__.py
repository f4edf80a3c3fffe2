"""Our forward passes, one module per architecture over the shared building blocks of
`layers`. The Llama family (Llama, Mistral, Qwen2) is one implementation: its members
differ only in config facts (biases, tying, rope scaling), not in code."""

from __future__ import annotations

from pagedinfer.service.models.config import FEATURES, ModelConfig
from pagedinfer.service.models.gemma3 import Gemma3Model
from pagedinfer.service.models.layers import DecoderModel
from pagedinfer.service.models.llama import AttentionMetadata, LlamaModel
from pagedinfer.service.models.phi3 import Phi3Model
from pagedinfer.service.models.qwen3 import Qwen3Model
from pagedinfer.service.models.smollm3 import SmolLM3Model

# ModelConfig.architecture -> the module that runs it.
MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": Qwen3Model,
    "phi3": Phi3Model,
    "smollm3": SmolLM3Model,
    "gemma3": Gemma3Model,
}


def build_model(config: ModelConfig) -> DecoderModel:
    """The architecture's module for config (parameters uninitialised until loaded)."""
    return MODEL_CLASSES[config.architecture](config)


__all__ = [
    "FEATURES",
    "MODEL_CLASSES",
    "AttentionMetadata",
    "DecoderModel",
    "LlamaModel",
    "ModelConfig",
    "build_model",
]
