"""A GGUF file as a Hugging Face directory: config.json, an fp32 model.safetensors, the
tokenizer files and the file's tensor index (`gguf_grids.TensorIndex`).

The header is read by a small parser of our own, once: gguf-py's reader spends seconds on
a vocabulary's strings, and transformers' conversion reads the file four times (about
30 s for a 135M model). The metadata becomes a config as transformers' GGUF loader maps
it, each tensor is dequantised exactly as llama.cpp does (`gguf_quants`) and written
straight into the safetensors file, so only one tensor is in memory at a time. The
tokenizer is transformers' conversion of the file's vocabulary.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedinfer.service import gguf_quants
from pagedinfer.service.gguf_grids import TensorEntry, TensorIndex, tensor_parts

log = logging.getLogger(__name__)

# GGUF architectures (general.architecture) we convert and serve.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
# general.architecture -> Hugging Face model_type, where they differ.
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Metadata key (after "<architecture>.") -> config field, as transformers' GGUF loader
# maps them; per architecture, the fields some add.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_ARCH_CONFIG_KEYS = {
    "llama": {"rope.dimension_count": "head_dim"},
    "mistral": {"rope.dimension_count": "head_dim"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# The tensor where llama.cpp keeps Llama 3's rope scaling: a divisor per rotary frequency.
ROPE_FACTORS = "rope_freqs.weight"
# Llama 3's rope scaling parameters, for factors too few to fit them (`llama3_rope_scaling`).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_CONTEXT = 8192
# Architectures whose norm weights llama.cpp's converter stores plus one (Gemma's
# `x * (1 + w)`): the conversion takes the one off again.
_NORMS_PLUS_ONE = ("gemma3",)

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# Fixed-size metadata value types: struct format per type id.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})


@dataclass(frozen=True)
class Header:
    """A GGUF file's metadata (key -> value; arrays as lists) and its tensors; rope_factors:
    the values of its `rope_freqs.weight` (each rotary frequency's divisor), if it has one."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    rope_factors: tuple[float, ...] | None = None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def index(self) -> TensorIndex:
        return TensorIndex(self.architecture, dict(self.tensors))


class _Cursor:
    """Reads little-endian GGUF values from a buffer, naming the file when it runs out."""

    def __init__(self, data: Any, source: object) -> None:
        self.data = data
        self.pos = 0
        self.source = source

    def take(self, size: int) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise ValueError(f"{self.source}: GGUF header cut short (truncated file?)")
        self.pos += size
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("<Q")
        start = self.take(size)
        return bytes(self.data[start : start + size]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.data, dtype, count, start).tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.source}: unknown GGUF metadata value type {kind}")


def read_header(path: Path) -> Header:
    """The metadata and tensor index of a GGUF file (versions 2 and 3). Raises ValueError
    naming the file for anything that is not a whole GGUF header."""
    with open(path, "rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ValueError(f"{path}: not a GGUF file (empty)") from None
    with data:
        if data[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic number)")
        cursor = _Cursor(data, path)
        cursor.take(4)
        version = cursor.scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        size = len(data)
    tensors = {}
    for name, dims, type_id, offset in infos:
        type_name = _type_name(type_id)
        fmt = gguf_quants.FORMATS.get(type_name)
        nbytes = 0 if fmt is None else math.prod(dims) // fmt.values * fmt.nbytes
        if data_start + offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the file's end (truncated?)")
        tensors[name] = TensorEntry(name, type_name, dims, data_start + offset, nbytes)
    rope = tensors.get(ROPE_FACTORS)
    factors = None
    if rope is not None and rope.type == "F32":
        factors = tuple(
            np.fromfile(path, np.float32, rope.nbytes // 4, offset=rope.offset).tolist()
        )
    return Header(metadata, tensors, factors)


def _type_name(type_id: int) -> str:
    """ggml's name of a tensor type id (gguf-py's table, which lists every type)."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown ggml type {type_id}"


def check_architecture(header: Header, source: object) -> str:
    """The file's architecture, once checked that we convert it and that the conversion
    keeps everything our forward pass needs (`losses`); ValueError otherwise."""
    arch = header.architecture
    if not arch:
        raise ValueError(f"{source} has no general.architecture field: not a model GGUF?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if lost := losses(header):
        raise ValueError(
            f"{source}: the GGUF conversion of this {arch} model would drop "
            f"{'; '.join(lost)}; serve the Hugging Face checkpoint instead"
        )
    return arch


def losses(header: Header) -> list[str]:
    """What converting this file would not carry over: fields the config mapping (the
    one transformers' GGUF loader uses, our reference) does not read that differ from
    the defaults it assumes."""
    arch = header.architecture

    def number(key: str) -> float | None:
        value = header.metadata.get(f"{arch}.{key}")
        return None if value is None else float(value)

    lost = []
    heads, hidden = number("attention.head_count"), number("embedding_length")
    head_dim = number("attention.key_length") or (hidden / heads if hidden and heads else None)
    if arch == "phi3":
        rotary = number("rope.dimension_count")
        if rotary is not None and head_dim is not None and rotary != head_dim:
            lost.append(f"partial rotary embeddings (rope.dimension_count={rotary:g})")
        if any(name.startswith("rope_factors_") for name in header.tensors):
            lost.append("LongRoPE's factors (rope_factors_* tensors)")
        if number("attention.sliding_window"):
            lost.append(f"the sliding window ({number('attention.sliding_window'):g})")
    if header.rope_factors is not None and _rope_scaling(header) is None:
        lost.append(f"rope frequency factors ({ROPE_FACTORS}) that are not Llama 3's rope scaling")
    if arch == "qwen3" and head_dim is not None and head_dim != 128:
        lost.append(f"head_dim={head_dim:g} (transformers assumes Qwen3's 128)")
    if arch == "gemma3" and (number("rope.scaling.factor") or 1.0) != 1.0:
        lost.append(f"rope scaling (rope.scaling.factor={number('rope.scaling.factor'):g})")
    return lost


def config_fields(header: Header) -> dict[str, Any]:
    """The Hugging Face config fields the file's metadata gives (with model_type)."""
    arch = header.architecture
    meta = header.metadata
    keys = {**_CONFIG_KEYS, **_ARCH_CONFIG_KEYS.get(arch, {})}
    fields: dict[str, Any] = {"model_type": _MODEL_TYPES.get(arch, arch), "dtype": "float32"}
    if "general.name" in meta:
        fields["_model_name_or_path"] = meta["general.name"]
    fields["tie_word_embeddings"] = "output.weight" not in header.tensors
    for key, field in keys.items():
        if f"{arch}.{key}" in meta:
            fields[field] = meta[f"{arch}.{key}"]
    for key, field in _TOKEN_ID_KEYS.items():
        if key in meta:
            fields[field] = meta[key]
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if scaling := _rope_scaling(header):
        fields["rope_scaling"] = scaling
    return fields


def _rope_scaling(header: Header) -> dict[str, Any] | None:
    """The Hugging Face rope_scaling of the file's rope factors (None: none, or factors
    that are not Llama 3's)."""
    arch = header.architecture
    if header.rope_factors is None or arch not in ("llama", "mistral"):
        return None
    meta = header.metadata
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    return llama3_rope_scaling(np.asarray(header.rope_factors, dtype=np.float64), base)


def llama3_wavelengths(rotary_dim: int, base: float) -> np.ndarray:
    """Each rotary frequency's wavelength in positions."""
    return 2 * np.pi * base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def llama3_factors(
    wavelengths: np.ndarray, factor: float, low: float, high: float, context: float
) -> np.ndarray:
    """Llama 3's divisor of each rotary frequency: 1 for wavelengths under context / high,
    `factor` over context / low, and a smooth step between (as transformers and
    llama.cpp's converter compute it)."""
    smooth = (context / wavelengths - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelengths < context / high, 1.0, np.where(wavelengths > context / low, factor, mid)
    )


def llama3_rope_scaling(factors: np.ndarray, base: float) -> dict[str, Any] | None:
    """Llama 3's rope_scaling parameters that give `factors` (llama.cpp's converter keeps only
    the factors), or None where no parameters give them (to fp32's precision).

    Only the wavelengths context / low and context / high enter the factors, so low is
    taken as 1 (Llama 3's): `factor` is the largest factor; the smooth step's share s of
    each factor strictly between 1 and it is context / (high - 1) / wavelength - 1 / (high
    - 1), a line in 1 / wavelength whose fit gives the rest. With fewer than two such
    factors the step cannot be fitted: Llama 3's own parameters are tried."""
    wavelengths = llama3_wavelengths(2 * len(factors), base)
    factor = float(factors.max())
    if factor <= 1.0 or factors.min() < 1.0 - 1e-6:
        return None
    mid = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    low, high, context = 1.0, _LLAMA3_ROPE["high_freq_factor"], float(_LLAMA3_CONTEXT)
    if mid.sum() >= 2:
        share = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[mid], share, 1)
        if intercept >= 0 or slope <= 0:
            return None
        high = float(round(1 - 1 / intercept, 4))
        context = float(round(slope * (high - 1)))
    expected = llama3_factors(wavelengths, factor, low, high, context)
    if not np.allclose(expected, factors, rtol=1e-5, atol=0):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(context),
    }


def convert(gguf_path: Path, out_dir: Path, progress: Callable[[str], None] | None = None) -> None:
    """Write the Hugging Face directory of a GGUF file into `out_dir` (which exists).
    Refuses (ValueError, before writing weights) an architecture we do not serve, a
    conversion that would lose a feature, and a tensor type we do not read."""
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    from pagedinfer.service.loader import fused_projections
    from pagedinfer.service.models import build_model
    from pagedinfer.service.models.hf_config import model_config_from_hf

    step = progress or (lambda _: None)
    header = read_header(gguf_path)
    check_architecture(header, gguf_path)
    gguf_quants.check_tensor_types(((t.name, t.type) for t in header.tensors.values()), gguf_path)
    header.index().save(out_dir)

    step("config")
    fields = config_fields(header)
    config = AutoConfig.for_model(**fields)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    raw = json.loads((out_dir / "config.json").read_text())
    ours = model_config_from_hf(raw, name=gguf_path.stem)

    step("tokenizer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)

    step("dequantise weights")
    import torch

    with torch.device("meta"):
        module = build_model(ours)
    params = {name: tuple(p.shape) for name, p in module.named_parameters()}
    parts = tensor_parts(
        header.index(),
        params,
        fused_projections(ours),
        (ours.num_heads, ours.num_kv_heads),
        ours.num_layers,
    )
    missing = [name for name in params if name not in parts]
    if missing:
        raise ValueError(f"{gguf_path}: no tensors for {missing[:5]} (a model of another layout?)")
    tensors = [(hf, part) for found in parts.values() for hf, part in found]
    _write_safetensors(gguf_path, tensors, out_dir / "model.safetensors", header.architecture)


def _write_safetensors(
    gguf_path: Path, tensors: list[tuple[str, Any]], out: Path, arch: str
) -> None:
    """Dequantise each (Hugging Face name, `gguf_grids._Part`) into `out` as fp32, one at
    a time: the header's offsets are known from the shapes before any tensor is read."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for hf_name, part in tensors:
        shape = [int(n) for n in reversed(part.entry.shape)]
        nbytes = math.prod(shape) * 4
        header[hf_name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for _, part in tensors:
            values = _dequantised(gguf_path, part, arch)
            handle.write(np.ascontiguousarray(values, dtype=np.float32).tobytes())
    log.debug("wrote %d tensors (%.0f MiB) to %s", len(tensors), offset / 2**20, out)


def _dequantised(gguf_path: Path, part: Any, arch: str) -> np.ndarray:
    """One file tensor in fp32, rows in Hugging Face order (llama.cpp's q/k permutation
    undone) and Gemma's norms back to the checkpoint's values."""
    entry = part.entry
    raw = np.fromfile(gguf_path, np.uint8, entry.nbytes, offset=entry.offset)
    values = gguf_quants.dequantize(raw.reshape(math.prod(entry.shape[1:]), -1), entry.type)
    values = values.reshape(tuple(reversed(entry.shape)))
    if part.rows is not None:
        values = values[part.rows]
    if arch in _NORMS_PLUS_ONE and entry.name.endswith("norm.weight"):
        values = values - np.float32(1.0)
    return values
