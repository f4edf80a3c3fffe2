"""Which kernel sets numba's disk cache already holds, so that a start knows before it
builds whether the CPU executor's kernels load in seconds or must compile for minutes.

A record is an empty file beside numba's cache files, named by a digest of everything a
cache hit depends on: the kernel sources' stamps (numba keys its cache on them), numba's
version, the CPU's name and features, and what the caller says identifies the kernel
variants it needs (model shapes, dtype, block size, weights). It is written once a
warm-up has compiled or loaded every kernel; deleting the cache deletes it too.

The model runner reads it to choose: with a record, build the executor before serving
(no torch-forward phase, no second copy of the weights); without one, compile in the
background while the torch forward serves.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

_KERNEL_SOURCES = Path(__file__).resolve().parent
_PREFIX = "pagedinfer-compiled-"


def record_directory() -> Path:
    """Where numba keeps its cache: NUMBA_CACHE_DIR, else `__pycache__` beside the kernels."""
    import numba

    configured = numba.config.CACHE_DIR
    return Path(configured) if configured else _KERNEL_SOURCES / "__pycache__"


def record_key(identity: str) -> str:
    """The digest naming the record of a kernel set: `identity` (the caller's variants)
    plus what numba's cache hits depend on."""
    import llvmlite.binding as llvm
    import numba

    parts = [identity, numba.__version__, llvm.get_host_cpu_name()]
    parts.append(llvm.get_host_cpu_features().flatten())
    for source in sorted((*_KERNEL_SOURCES.glob("*.py"), _KERNEL_SOURCES.parent / "torch_ops.py")):
        stat = source.stat()
        parts.append(f"{source.name}:{stat.st_mtime_ns}:{stat.st_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def compiled_before(identity: str) -> bool:
    """Whether a warm-up of this kernel set finished over the cache this process uses."""
    try:
        return (record_directory() / (_PREFIX + record_key(identity))).is_file()
    except (OSError, ImportError):
        return False


def record_compiled(identity: str) -> None:
    """Note that this kernel set is in the cache; a cache it cannot write gets no record
    (every start then compiles in the background, as without one)."""
    try:
        directory = record_directory()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / (_PREFIX + record_key(identity))).touch()
    except (OSError, ImportError) as err:
        log.debug("no compile record written: %s", err)


def weights_file(identity: str, directory: Path) -> Path | None:
    """Where the executor keeps the built weights of this kernel set under `directory`
    (`weight_store`): named by the same digest, so code or model changes miss it."""
    try:
        return directory / f"{record_key(identity)}.bin"
    except (OSError, ImportError):
        return None
