"""The CPU backend behind one door: `prepare(model, block_size) -> CpuExecutor | None`.

The model runner calls `prepare` once; where it returns an executor, that executor runs
every step (`CpuExecutor.forward`), else the model's own torch forward does. The
executor serves only configurations whose every architecture feature it implements
(`supports`, `SUPPORTED_FEATURES`), and chooses its kernels from the configuration and
the CPU alone. Internals: see README.md beside this file.

Importing this package imports no numba; its kernel modules do.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedinfer.kernels.cpu.compile_record import compiled_before, record_compiled, weights_file
from pagedinfer.kernels.cpu.executor import (
    SUPPORTED_FEATURES,
    CpuExecutor,
    prepare,
    unfused_biases,
    unsupported_features,
)


def supports(model_config: Any) -> bool:
    """Whether the executor implements every feature of this model config."""
    return not unsupported_features(model_config)


def bf16_products_serve(model_config: Any) -> bool:
    """Whether the executor serves this model in bf16 (--dtype bfloat16) with its own
    kernels: the layers' GEMMs multiply bf16 weights (`executor.bf16_layer_kind`), and the
    rest runs in fp32. Needs AVX512-BF16, the compiled kernels, every feature implemented
    and no bias past q/k/v's; elsewhere bf16 runs on the matmul library's bf16 GEMMs and
    torch ops."""
    from pagedinfer.kernels import torch_ops

    native = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    compiled = torch_ops.compiled_kernels() and supports(model_config)
    return native and compiled and not unfused_biases(model_config)


__all__ = [
    "SUPPORTED_FEATURES",
    "CpuExecutor",
    "bf16_products_serve",
    "compiled_before",
    "prepare",
    "record_compiled",
    "supports",
    "unsupported_features",
    "weights_file",
]
