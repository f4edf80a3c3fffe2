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

from pagedinfer.kernels.cpu.compile_record import compiled_before, record_compiled, weights_file
from pagedinfer.kernels.cpu.executor import (
    SUPPORTED_FEATURES,
    CpuExecutor,
    prepare,
    unsupported_features,
)


def supports(model_config: Any) -> bool:
    """Whether the executor implements every feature of this model config."""
    return not unsupported_features(model_config)


__all__ = [
    "SUPPORTED_FEATURES",
    "CpuExecutor",
    "compiled_before",
    "prepare",
    "record_compiled",
    "supports",
    "unsupported_features",
    "weights_file",
]
