"""Our forward passes. One implementation covers the Llama family (Llama, Mistral, Qwen2,
SmolLM): they differ only in config facts (biases, tying, rope scaling), not in code."""

from pagedinfer.service.models.llama import AttentionMetadata, LlamaModel, ModelConfig

__all__ = ["AttentionMetadata", "LlamaModel", "ModelConfig"]
