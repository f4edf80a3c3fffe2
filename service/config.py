"""Engine configuration: one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AllocationPolicy = Literal["paged", "contiguous"]


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    The KV cache is sized either by `num_gpu_blocks` (exact) or by `kv_cache_memory`
    (bytes; the model runner divides it by the size of one block). On CUDA, when both
    are unset, `gpu_memory_utilization` of the free device memory is used.
    """

    model: str | None = None  # None = the embedded default model
    dtype: str = "auto"  # auto = float32 on CPU, the checkpoint's dtype on GPU
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int = 2 * 1024**3
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    allocation_policy: AllocationPolicy = "paged"
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("kv_cache_memory", self.kv_cache_memory)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.max_model_len < self.block_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be at least block_size ({self.block_size})"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.allocation_policy not in ("paged", "contiguous"):
            raise ValueError(
                f"allocation_policy must be 'paged' or 'contiguous', got {self.allocation_policy!r}"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
