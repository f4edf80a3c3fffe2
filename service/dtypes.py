"""Which dtype the model computes in: `--dtype`, or for `auto` a rule over the checkpoint's
dtype and the hardware (docs/architecture.md section 7).

`auto` computes in the checkpoint's dtype where the hardware multiplies it natively, as
vLLM does: on a GPU in bf16 (whatever the checkpoint), on a CPU a bf16 checkpoint in bf16
where the CPU has bf16 matmul instructions (AVX512-BF16 or AMX), where bf16 runs about
twice as fast as fp32; elsewhere in fp32, since bf16 emulated in software runs hundreds
of times slower. An fp16 checkpoint computes in fp32 on a CPU: the CPU backend has no
fp16 kernels, and its fp32 GEMMs keep such weights in their 16 bits (`grid_gemm.FP16`).
The choice reads only the configuration and the CPU's flags, never a timing, so the
same model on the same machine always takes the same path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
# CPU flags (as `cpu_flags` names them) under which bf16 matmuls run natively.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# torch's probes for them, by flag name.
_TORCH_PROBES = {
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx_bf16": "_is_amx_tile_supported",  # every CPU with AMX tiles has AMX-BF16
    "amx_fp16": "_is_amx_fp16_supported",
}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype chosen (a name of `DTYPES`) and why, in words for the log."""

    dtype: str
    reason: str


def checkpoint_dtype(raw_config: Mapping[str, Any]) -> str | None:
    """The dtype a Hugging Face config.json says its weights are stored in (`dtype`, or
    `torch_dtype` as older transformers write it); None where it names none we serve."""
    value = raw_config.get("dtype") or raw_config.get("torch_dtype")
    if isinstance(value, str):
        value = value.removeprefix("torch.")
    return value if value in DTYPES else None


def cpu_flags() -> frozenset[str]:
    """This CPU's matmul flags that the dtype rule reads, as torch detects them."""
    import torch

    return frozenset(
        flag
        for flag, probe in _TORCH_PROBES.items()
        if bool(getattr(torch.cpu, probe, lambda: False)())
    )


def choose_dtype(
    requested: str, checkpoint: str | None, device_type: str, flags: frozenset[str]
) -> DtypeChoice:
    """The dtype to compute in: `requested` unless it is "auto", else the rule of this
    module over the checkpoint's dtype (None: unknown), the device type ("cpu", "cuda")
    and, on a CPU, its flags (`cpu_flags`)."""
    if requested != "auto":
        return DtypeChoice(requested, f"dtype {requested} (--dtype {requested})")
    if device_type != "cpu":
        return DtypeChoice("bfloat16", f"dtype auto: bfloat16 on {device_type}")
    native = sorted(flags & NATIVE_BF16_FLAGS)
    if checkpoint == "bfloat16" and native:
        return DtypeChoice(
            "bfloat16",
            f"dtype auto: bfloat16, the checkpoint's, as this CPU multiplies bf16 natively "
            f"({', '.join(native)})",
        )
    if checkpoint == "float32":
        return DtypeChoice("float32", "dtype auto: float32, the checkpoint's")
    if checkpoint is None:
        return DtypeChoice("float32", "dtype auto: float32, as the checkpoint names no dtype")
    if checkpoint == "bfloat16":
        why = "this CPU has no native bf16 matmul (neither AVX512-BF16 nor AMX)"
    else:
        why = "the CPU backend has no fp16 kernels (its fp32 GEMMs keep fp16 weights in 16 bits)"
    return DtypeChoice("float32", f"dtype auto: float32 for a {checkpoint} checkpoint, as {why}")
