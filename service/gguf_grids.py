"""Which blocks of a GGUF file make each of our fused GEMM weights, read as their grids.

The loader serves a GGUF file through its fp32 conversion (`gguf_convert`, the
reference); beside it, `block_grids` says, for each weight whose every part is of a grid type
(`gguf_quants.block_grid`), what the file's blocks hold: backends that compute from
such grids take it instead of rediscovering the grid in the fp32 values. Blocks are read
on demand; the file's tensor index (names, types, shapes, offsets) is kept beside the
conversion, so that a start reads no GGUF header.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pagedinfer.service import gguf_quants

INDEX_FILE = "gguf_tensors.json"
# Architectures whose q and k rows llama.cpp's converter permutes and transformers' GGUF
# loader permutes back (its LlamaTensorProcessor): the blocks get the same permutation.
PERMUTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: shape in GGUF order (row length first), data offset."""

    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorIndex:
    """A GGUF file's architecture and tensors."""

    architecture: str
    tensors: dict[str, TensorEntry]

    def save(self, directory: Path) -> None:
        """Written atomically: concurrent loaders see the whole index or none."""
        tensors = [asdict(t) for t in self.tensors.values()]
        data = {"architecture": self.architecture, "tensors": tensors}
        handle, name = tempfile.mkstemp(prefix=f".{INDEX_FILE}.", dir=directory)
        with os.fdopen(handle, "w") as out:
            json.dump(data, out)
        os.chmod(name, 0o644)
        os.replace(name, directory / INDEX_FILE)

    @classmethod
    def load(cls, directory: Path) -> TensorIndex | None:
        path = directory / INDEX_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        tensors = {}
        for t in data["tensors"]:
            tensors[t["name"]] = TensorEntry(**{**t, "shape": tuple(t["shape"])})
        return cls(data["architecture"], tensors)


def tensor_index(gguf_path: Path, directory: Path) -> TensorIndex:
    """The index kept in `directory` (a conversion of `gguf_path`), read from the file and
    kept there where an older conversion lacks it."""
    index = TensorIndex.load(directory)
    if index is None:
        from pagedinfer.service.gguf_convert import read_header

        index = read_header(gguf_path).index()
        with contextlib.suppress(OSError):  # a read-only cache: read it again next time
            index.save(directory)
    return index


@dataclass(frozen=True)
class _Part:
    """One file tensor's rows within one of our parameters; heads: undo llama.cpp's q/k
    row permutation over that many heads (0: none)."""

    entry: TensorEntry
    heads: int

    @property
    def rows(self) -> np.ndarray | None:
        """The order of the file's rows that gives the checkpoint's (None: as stored)."""
        return _unpermuted_rows(self.entry.shape[-1], self.heads) if self.heads else None


class BlockGrids(Mapping[str, gguf_quants.BlockGrid]):
    """Our parameter name -> the `gguf_quants.BlockGrid` its file tensors hold, for every
    parameter whose parts are all of grid types; each read from the file when asked for."""

    def __init__(self, gguf_path: Path, parts: dict[str, list[_Part]]) -> None:
        self.path = Path(gguf_path)
        self._parts = parts

    def __getitem__(self, name: str) -> gguf_quants.BlockGrid:
        grids = []
        for part in self._parts[name]:
            entry = part.entry
            rows = entry.shape[1]
            raw = np.fromfile(self.path, np.uint8, entry.nbytes, offset=entry.offset)
            raw = raw.reshape(rows, -1)
            if part.rows is not None:
                raw = raw[part.rows]
            grid = gguf_quants.block_grid(raw, entry.type)
            assert grid is not None  # only grid types are indexed
            grids.append(grid)
        return grids[0] if len(grids) == 1 else gguf_quants.concatenate(grids)

    def __contains__(self, name: object) -> bool:
        return name in self._parts  # without reading the blocks, as Mapping's would

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def types(self, name: str) -> list[str]:
        """The GGUF types of a parameter's parts."""
        return [part.entry.type for part in self._parts[name]]


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's permutation of q or k rows over `heads` heads
    (each head's rows interleaved in pairs), as transformers' GGUF loader undoes it."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def tensor_parts(
    index: TensorIndex,
    params: Mapping[str, tuple[int, ...]],
    fused: Mapping[str, tuple[str, int, int]],
    heads: tuple[int, int],
    num_layers: int,
) -> dict[str, list[tuple[str, _Part]]]:
    """For each of our parameters (name -> shape) that the file holds: its parts, each
    with the Hugging Face name the file's tensor has in a checkpoint (gguf-py's tensor
    name map). fused: Hugging Face projection -> (our fused projection, row range), as
    the loader fills them; heads: (query heads, key/value heads), for the q/k
    permutation. A parameter missing from the file, or of another shape, is left out."""
    import gguf

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == index.architecture), None)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(arch, num_layers)
    permuted = index.architecture in PERMUTED_ARCHITECTURES

    def entry(hf_name: str, shape: tuple[int, ...]) -> tuple[str, _Part] | None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        found = index.tensors.get(name) if name else None
        if found is None or found.shape != tuple(reversed(shape)):
            return None
        part_heads = 0
        if permuted and ".attn_q." in found.name:
            part_heads = heads[0]
        elif permuted and ".attn_k." in found.name:
            part_heads = heads[1]
        return hf_name, _Part(found, part_heads)

    parts: dict[str, list[tuple[str, _Part]]] = {}
    for param, shape in params.items():
        hf = param if param.startswith("lm_head.") else f"model.{param}"
        found = [entry(hf, shape)]  # a fused weight the file holds whole (Phi-3's qkv)
        if found[0] is None:
            pieces = [
                (hf.replace(ours, hf_proj), (hi - lo, *shape[1:]))
                for hf_proj, (ours, lo, hi) in fused.items()
                if f".{ours}." in hf
            ]
            found = [entry(name, piece) for name, piece in pieces] if pieces else found
        if all(p is not None for p in found):
            parts[param] = [p for p in found if p is not None]
    return parts


def block_grids(
    gguf_path: Path,
    index: TensorIndex,
    params: Mapping[str, tuple[int, ...]],
    fused: Mapping[str, tuple[str, int, int]],
    heads: tuple[int, int],
    num_layers: int,
) -> BlockGrids:
    """For each of our 2-D parameters (name -> shape) that the file holds on grids: its
    parts (`tensor_parts`)."""
    weights = {name: shape for name, shape in params.items() if len(shape) == 2}
    parts = {
        param: [part for _, part in found]
        for param, found in tensor_parts(index, weights, fused, heads, num_layers).items()
        if all(part.entry.type in gguf_quants.GRID_TYPES for _, part in found)
    }
    return BlockGrids(gguf_path, parts)
