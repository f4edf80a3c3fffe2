"""An ordinary checkpoint of the embedded model: its weights on no quantisation grid.

The embedded model's fp32 weights come from a Q4_1 GGUF file, so every block of 32
takes one of 16 evenly spaced values, which the CPU backend exploits. A checkpoint a
user brings has no such structure. Multiplying every weight by (1 + 1e-3 noise) keeps
the model's behaviour (the same tokens almost always) and puts the weights on no grid,
so that the benchmark measures what any Hugging Face checkpoint of this size gets.
With `--bf16` the noisy weights are stored in bf16, as most checkpoints are published.

    python benchmarks/peers/noisy_checkpoint.py [--bf16]  # prints the directory, built once
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedinfer.service.loader import cache_dir, ensure_default_model

if not __package__:  # run as a script: the benchmarks directory holds its package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers.paths import staged_directory

NOISE_SCALE = 1e-3
# The weight files; every other file of the directory is copied as it is.
_WEIGHT_SUFFIX = ".safetensors"


def noisy_weights(
    weights: dict[str, torch.Tensor], scale: float, seed: int, dtype: torch.dtype | None = None
) -> dict:
    """Each floating-point tensor times (1 + scale * standard normal noise), fixed seed,
    stored in `dtype` (default: the tensor's own)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(weights):  # sorted: the same noise whatever the file's order
        tensor = weights[name]
        if tensor.is_floating_point():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor = (tensor.float() * (1.0 + scale * noise)).to(dtype or tensor.dtype)
        out[name] = tensor.contiguous()
    return out


def make_noisy_checkpoint(
    source: Path,
    target: Path,
    scale: float = NOISE_SCALE,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `source`'s Hugging Face directory with noisy weights to `target` (safetensors),
    in `dtype` where given (config.json's torch_dtype then says so)."""
    if scale <= 0:
        raise ValueError(f"noise scale must be positive, got {scale}")
    files = sorted(source.glob(f"*{_WEIGHT_SUFFIX}"))
    if not files:
        raise ValueError(f"{source} has no {_WEIGHT_SUFFIX} weight files")
    with staged_directory(target) as staging:
        for path in source.iterdir():
            if path.is_file() and path.suffix != _WEIGHT_SUFFIX:
                shutil.copy2(path, staging / path.name)
        if dtype is not None and (staging / "config.json").is_file():
            config = json.loads((staging / "config.json").read_text())
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
            (staging / "config.json").write_text(json.dumps(config, indent=2))
        for index, path in enumerate(files):
            weights = noisy_weights(load_file(path), scale, seed + index, dtype)
            save_file(weights, staging / path.name, metadata={"format": "pt"})
    return target


def ensure_noisy_model(
    scale: float = NOISE_SCALE, seed: int = 0, dtype: torch.dtype | None = None
) -> Path:
    """The embedded model's noisy checkpoint (in `dtype`, default fp32), built once into
    pagedinfer's cache."""
    source = ensure_default_model()
    suffix = "" if dtype is None else f"-{str(dtype).removeprefix('torch.')}"
    key = hashlib.sha256(f"{source.name}|{scale}|{seed}{suffix}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{source.name}-noisy{suffix}-{key}"
    if (target / "config.json").is_file():
        return target
    return make_noisy_checkpoint(source, target, scale, seed, dtype)


if __name__ == "__main__":
    print(ensure_noisy_model(dtype=torch.bfloat16 if "--bf16" in sys.argv[1:] else None))
    sys.exit(0)
