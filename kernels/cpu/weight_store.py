"""The executor's GEMM weights as built at an earlier start, so a later one reads them.

Choosing each position's grids (decoding a GGUF file's blocks, checking value for value
that they give the model's weights, or laying ordinary weights out in tiles) costs about
a second of a warm start. Its result depends only on the model's weight files and on
this package's code, so the first build writes it to one file named by a digest of both
(`compile_record.weights_file`), and later starts read it back.

The file: a magic line, an 8-byte little-endian header length, a JSON header listing each grid (kind,
shape) and each array (dtype, shape, offset), then the arrays, each 64-byte aligned.
A store that is missing, unreadable, or does not fit the model is ignored and the grids
are chosen again; a directory that cannot be written simply gets no store.

The digest changes with every model and every version of the code, so the directory
keeps only the stores used last (`prune`): MAX_BYTES of them, and the one just written
always. Reading a store marks it used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pagedinfer.kernels.cpu import grid_gemm

log = logging.getLogger(__name__)

Grids = tuple[list[list[grid_gemm.GridWeight]], grid_gemm.GridWeight]
_MAGIC = b"pagedinfer-cpu-grids\n"
# 2: K-quants with their files' scales (SUPER) and 6-bit codes (FINE6); 3: FINE6 rows
# hold one input's 6 bits a byte (bits 2..7), the fourth input's spread over bits 0..1.
_VERSION = 3
_ALIGN = 64
MAX_BYTES = 8 * 2**30
# Each kind read back as grid_gemm's own string object, not an equal one from the JSON:
# numba keys a kernel's disk cache on a pickle of its closure, and pickle writes a string
# met twice as a back-reference only where it is the same object, so an equal copy would
# miss the cache that the first build's kernels filled and compile them all again.
_KINDS = {kind: kind for kind in (*grid_gemm.GRIDS, *grid_gemm.DENSE)}


def save(path: Path, grids: Grids) -> bool:
    """Write `grids` (each layer's GEMM positions, and the LM head) to `path` atomically;
    whether it was written."""
    layers, lm_head = grids
    header: dict[str, Any] = {"version": _VERSION, "grids": [], "arrays": []}
    arrays, offset = [], 0
    for name, grid in _named(layers, lm_head):
        header["grids"].append([name, grid.kind, grid.out_features, grid.in_features])
        for part in ("codes", "scales"):
            array = np.ascontiguousarray(getattr(grid, part))
            header["arrays"].append([f"{name}.{part}", array.dtype.str, array.shape, offset])
            arrays.append(array)
            offset += _aligned(array.nbytes)
    encoded = json.dumps(header).encode()
    data_start = _aligned(len(_MAGIC) + 8 + len(encoded))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f"{path.name}*.tmp"):  # a killed writer's
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + len(encoded).to_bytes(8, "little") + encoded)
                for (_, _, _, at), array in zip(header["arrays"], arrays, strict=True):
                    f.seek(data_start + at)
                    f.write(array.data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as err:
        log.debug("CPU executor: no weight store written at %s: %s", path, err)
        return False
    prune(path.parent, keep=path)
    return True


def prune(directory: Path, keep: Path) -> list[Path]:
    """Delete the stores in `directory` used longest ago (by modification time, which
    `load` renews) until those left hold at most MAX_BYTES, never `keep`; the deleted
    paths. A store another process still reads stays readable to it."""
    stores = []
    for store in directory.glob("*.bin"):
        with contextlib.suppress(OSError):  # deleted meanwhile by another process's prune
            stat = store.stat()
            stores.append((store != keep, -stat.st_mtime_ns, stat.st_size, store))
    stores.sort()  # `keep` first, then the most recently used
    deleted, total = [], 0
    for _, _, size, store in stores:
        total += size
        if store != keep and total > MAX_BYTES:
            with contextlib.suppress(OSError):
                store.unlink()
                deleted.append(store)
                total -= size
    if deleted:
        log.info("CPU executor: deleted %d weight stores used longest ago", len(deleted))
    return deleted


def load(path: Path, shapes: list[list[tuple[int, int]]]) -> Grids | None:
    """The grids stored at `path`, or None where there are none or they do not fit
    `shapes`: each layer's GEMM weight shapes (out, in) by position, the LM head's last."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise ValueError("not a weight store")
            length = int.from_bytes(f.read(8), "little")
            if length > path.stat().st_size:
                raise ValueError("its header runs past the end of the file")
            header = json.loads(f.read(length))
            if header.get("version") != _VERSION:
                raise ValueError(f"version {header.get('version')}")
            arrays = {}
            for name, dtype, shape, at in header["arrays"]:
                array = np.empty(shape, dtype=dtype)  # each its own, so none pins the file's
                f.seek(_aligned(len(_MAGIC) + 8 + length) + at)
                if f.readinto(memoryview(array).cast("B")) != array.nbytes:
                    raise ValueError(f"{name} runs past the end of the file")
                arrays[name] = array
        grids = {
            name: grid_gemm.GridWeight(
                _KINDS[kind], out, k, arrays[f"{name}.codes"], arrays[f"{name}.scales"]
            )
            for name, kind, out, k in header["grids"]
        }
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("CPU executor: ignoring the unreadable weight store %s: %s", path, err)
        return None
    layers = [
        [grids.get(f"layer{i}.{p}") for p in range(len(shapes[0]))] for i in range(len(shapes) - 1)
    ]
    lm_head = grids.get("lm_head")
    want = [shape for layer in shapes for shape in layer]
    held = [g for layer in layers for g in layer] + [lm_head]
    have = [(g.out_features, g.in_features) if g else None for g in held]
    if have != want or len(grids) != len(want):
        log.warning("CPU executor: ignoring the weight store %s: it holds other shapes", path)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: `prune` keeps it over those used longer ago
    return layers, lm_head


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _named(layers: list[list[Any]], lm_head: Any) -> list[tuple[str, Any]]:
    named = [(f"layer{i}.{p}", g) for i, layer in enumerate(layers) for p, g in enumerate(layer)]
    return [*named, ("lm_head", lm_head)]
