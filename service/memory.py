"""Sizing the CPU KV cache from the memory the server may use, as vLLM sizes it on a GPU.

Without `--kv-cache-memory`, the KV cache gets what the container's memory limit leaves:
the limit (cgroup v2 `memory.max`/`memory.high`, else v1 `memory.limit_in_bytes`), less
a headroom share of it, less what the process holds once the model is loaded
(interpreter, libraries, tokenizer, weights as loaded), less what is still to come: the
CPU backend's own form of the weights while it builds it beside the dense ones, one
step's activations and sampling logits, the torch attention path's gathered context,
request state. Without a limit it takes a share of the host's available memory, capped:
a laptop's memory is shared with everything else on it.

The decisions are pure functions of the numbers (`plan_kv_cache`, `activation_bytes`,
`backend_pending_bytes`), so they are table-tested; `read_host_memory` and
`resident_bytes` are the only readers of /proc and /sys, with their roots injectable.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.models.llama import ModelConfig

MiB = 2**20
GiB = 2**30
# Where the cgroup filesystem is mounted; the environment variable moves it (a
# container with cgroupfs elsewhere, or a test with a fake limit file).
CGROUP_ROOT_ENV = "PAGEDINFER_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Share of the limit left unused: allocator fragmentation, page cache the kernel charges
# to the container, and the estimates' error.
HEADROOM = 0.10
# Without a limit: this share of the memory available once the model is loaded, at most
# NO_LIMIT_KV_CAP.
NO_LIMIT_SHARE = 0.5
NO_LIMIT_KV_CAP = 512 * MiB
# What serving allocates beyond one step's tensors: gRPC and telemetry buffers,
# per-request state, kernels compiled after start, malloc arenas of the worker threads.
SERVING_ALLOWANCE = 128 * MiB
# Bytes per GEMM weight the CPU backend's grid form takes while it is built beside the
# dense weights: the grids, their stacked copy for the fused step, the LM head's 8-bit
# approximations and loading the compiled kernels (the embedded model, warm kernel cache).
GRID_BYTES_PER_WEIGHT = 3.0
# What a child compiling the CPU kernels holds beside the pages it shares with the server:
# LLVM's memory while it compiles the fused step (about 450 MiB for a 30-layer model),
# after the weights it built are handed back.
COMPILE_CHILD_BYTES = 512 * MiB
# Logits-sized tensors sampling holds at once per row of a chunk: their penalised copy,
# the scaled and masked rows, probabilities, and top-p's sort (values and int64 indices,
# three logits' worth). Rows sampled with penalties and top-p peak at ten.
LOGITS_COPIES = 10


@dataclass(frozen=True)
class HostMemory:
    """What the process may use: the container's limit (None = none found) and the
    host's available memory, both in bytes."""

    limit: int | None
    source: str  # the file the limit came from, or why there is none
    available: int  # MemAvailable


@dataclass(frozen=True)
class Footprint:
    """The memory the model takes besides its KV cache (bytes)."""

    resident: int  # held now: interpreter, libraries, tokenizer, weights as loaded
    pending: int  # still to come at start: the CPU backend's weights while it builds them
    activations: int  # one step's tensors and sampling logits (`activation_bytes`)

    def with_compiling_child(self) -> Footprint:
        """This footprint while a child compiles the CPU kernels: the child's memory
        (`COMPILE_CHILD_BYTES`) is pending, unless the backend's own build is larger."""
        return dataclasses.replace(self, pending=max(self.pending, COMPILE_CHILD_BYTES))


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache budget chosen and the reason, as one log line."""

    budget: int
    num_blocks: int
    reason: str


def activation_bytes(model: ModelConfig, config: EngineConfig, itemsize: int) -> int:
    """Peak bytes of the tensors one engine step allocates beyond weights and KV cache.

    A step of `max_num_batched_tokens` rows holds the residual stream, the normed input,
    q/k/v, the attention output and the MLP's gate, up and activated rows at once; the
    rows that need logits (at most one per running sequence and draft token) hold
    `LOGITS_COPIES` fp32 rows of the vocabulary while sampling.
    """
    tokens = config.max_num_batched_tokens
    q_size = model.num_heads * model.head_dim
    kv_size = model.num_kv_heads * model.head_dim
    per_token = 3 * model.hidden_size + 2 * q_size + 2 * kv_size + 3 * model.intermediate_size
    logit_rows = min(tokens, config.max_num_seqs * (1 + config.num_speculative_tokens))
    from pagedinfer.service.sampler import SAMPLE_CHUNK_ROWS

    # The logits of every sampled row, and the sampler's copies of one chunk of them.
    copied_rows = min(logit_rows, SAMPLE_CHUNK_ROWS)
    vocab_row = model.vocab_size * 4
    return tokens * per_token * itemsize + (logit_rows + copied_rows * LOGITS_COPIES) * vocab_row


def gemm_weights(model: ModelConfig) -> int:
    """Elements of the GEMM weights: every layer's q/k/v, o, gate/up and down, and the LM head."""
    q_size = model.num_heads * model.head_dim
    kv_size = model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    return model.num_layers * per_layer + model.vocab_size * hidden


def backend_pending_bytes(model: ModelConfig, mode: str, itemsize: int) -> int:
    """What the CPU backend adds while it builds its weights beside the model's dense ones
    (which it releases once it serves): GRID_BYTES_PER_WEIGHT for quantisation grids, a
    copy of the weights for the matmul library's packed layouts, nothing for dense GEMMs."""
    per_weight = {"grid": GRID_BYTES_PER_WEIGHT, "mkl": itemsize, "onednn": itemsize}
    if mode not in (*per_weight, "dense"):
        raise ValueError(f"unknown CPU backend mode {mode!r}")
    return int(gemm_weights(model) * per_weight.get(mode, 0))


def child_compile_fits(
    host: HostMemory,
    footprint: Footprint,
    block_bytes: int,
    num_layers: int,
    min_blocks: int,
) -> bool:
    """Whether the memory holds a compiling child beside `footprint` (the process with
    the model's dense weights, which the torch forward serves on meanwhile) and
    `min_blocks` KV blocks. Where it does not, the server compiles before it serves,
    without the dense weights (`cpu.prepare(compile_first=True)`)."""
    try:
        plan_kv_cache(host, footprint.with_compiling_child(), block_bytes, num_layers, min_blocks)
    except ValueError:
        return False
    return True


def plan_kv_cache(
    host: HostMemory,
    footprint: Footprint,
    block_bytes: int,
    num_layers: int,
    min_blocks: int,
) -> KVCachePlan:
    """The KV budget the memory leaves besides the model's footprint.

    With a limit: (1 - HEADROOM) of it (or of resident + available, when the host has
    less), less the footprint and SERVING_ALLOWANCE. Without one: NO_LIMIT_SHARE of
    `available` less the same, at most NO_LIMIT_KV_CAP. The torch attention path gathers
    a layer's context into scratch of up to twice one layer's share of the cache, so the
    budget is what remains divided by (1 + 2 / num_layers). Raises ValueError, with the
    limit that would do, when fewer than `min_blocks` blocks fit.
    """
    mib = _mib
    scratch = 1 + 2 / num_layers
    used = footprint.resident + footprint.pending + footprint.activations + SERVING_ALLOWANCE
    if host.limit is not None:
        usable = min(host.limit, footprint.resident + host.available)
        headroom = int(usable * HEADROOM)
        left = usable - headroom - used
        bound = (
            f"the memory limit {mib(host.limit)} ({host.source})"
            if usable == host.limit
            else f"the host's available memory {mib(footprint.resident + host.available)} "
            f"(below the limit {mib(host.limit)} of {host.source})"
        )
        rest = f"headroom {HEADROOM:.0%} ({mib(headroom)})"
    else:
        left = int(host.available * NO_LIMIT_SHARE) - (used - footprint.resident)
        bound = (
            f"{NO_LIMIT_SHARE:.0%} of the available memory {mib(host.available)} ({host.source})"
        )
        rest = f"at most {mib(NO_LIMIT_KV_CAP)} without a limit"
    budget = max(0, int(left / scratch))
    if host.limit is None:
        budget = min(budget, NO_LIMIT_KV_CAP)
    blocks = budget // block_bytes
    terms = (
        f"the process holds {mib(footprint.resident)}, the CPU backend builds "
        f"{mib(footprint.pending)} more until it serves, one step's activations and logits "
        f"take {mib(footprint.activations)}, serving {mib(SERVING_ALLOWANCE)}, the attention "
        f"scratch 2/{num_layers} of the cache, {rest}"
    )
    reason = f"KV cache budget {mib(budget)} from {bound}: {terms}"
    if blocks < min_blocks:
        needed = (used + min_blocks * block_bytes * scratch) / (1 - HEADROOM)
        raise ValueError(
            f"{bound} cannot hold the model and one KV block per sequence: {terms}; "
            f"{min_blocks} blocks (max_num_seqs) of {mib(block_bytes)} need "
            f"{mib(min_blocks * block_bytes)}, a limit of at least {mib(int(needed))}. "
            f"Raise the memory limit, lower --max-num-seqs (to at most {blocks} here), or "
            "set --kv-cache-memory"
        )
    return KVCachePlan(budget=budget, num_blocks=blocks, reason=reason)


def check_kv_cache_memory(budget: int, host: HostMemory, resident: int) -> None:
    """Refuses a `--kv-cache-memory` the process could never hold (ValueError), so that
    the cache's allocation does not fail with a bare ENOMEM."""
    room = host.limit - resident if host.limit is not None else host.available
    if budget > room:
        where = (
            f"the memory limit {_mib(host.limit)} ({host.source}) less the "
            f"{_mib(resident)} the process holds"
            if host.limit is not None
            else f"the host's available memory ({host.source})"
        )
        raise ValueError(
            f"--kv-cache-memory {_mib(budget)} is more than this process can hold: "
            f"{_mib(max(room, 0))} is left by {where}; give less, or leave the flag out "
            "to size the cache from the memory"
        )


def parse_limit(text: str, total: int) -> int | None:
    """A cgroup limit file's content -> bytes, or None for no limit ("max", or a value at
    or above the machine's total memory, as cgroup v1 writes "unlimited")."""
    value = text.strip()
    if value == "max":
        return None
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"not a cgroup memory limit: {value!r}") from None
    return None if limit >= total else limit


def cgroup_paths(proc_self_cgroup: str) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory controller path) of /proc/self/cgroup's lines
    `hierarchy-id:controllers:path`; None where that hierarchy is absent."""
    v2 = v1 = None
    for line in proc_self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def meminfo_bytes(meminfo: str, key: str) -> int:
    """One `Key: N kB` field of /proc/meminfo, in bytes."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise ValueError(f"/proc/meminfo has no {key} field")


def read_host_memory(
    proc_root: Path = Path("/proc"), cgroup_root: Path | None = None
) -> HostMemory:
    """The memory limit of this process's cgroup and the host's available memory.

    The limit is the smallest one set on the process's cgroup or any cgroup above it
    (cgroup v2 `memory.max` and `memory.high`, else v1 `memory.limit_in_bytes`). A
    container whose own cgroup is mounted as the root (no cgroup namespace) finds its
    path missing under the mount: then the mount's root files are its own.
    """
    if cgroup_root is None:
        cgroup_root = Path(os.environ.get(CGROUP_ROOT_ENV) or DEFAULT_CGROUP_ROOT)
    meminfo = (proc_root / "meminfo").read_text()
    total, available = meminfo_bytes(meminfo, "MemTotal"), meminfo_bytes(meminfo, "MemAvailable")
    try:
        v2, v1 = cgroup_paths((proc_root / "self" / "cgroup").read_text())
    except OSError:
        v2 = v1 = None
    for path, mount, names in (
        (v2, cgroup_root, ("memory.max", "memory.high")),
        (v1, cgroup_root / "memory", ("memory.limit_in_bytes",)),
    ):
        if path is None:
            continue
        found = _smallest_limit(mount, path, names, total)
        if found is not None:
            return HostMemory(limit=found[0], source=str(found[1]), available=available)
    return HostMemory(limit=None, source="no cgroup memory limit", available=available)


def _smallest_limit(
    mount: Path, path: str, names: tuple[str, ...], total: int
) -> tuple[int, Path] | None:
    own = mount / path.lstrip("/")
    directory = own if own.is_dir() else mount
    best: tuple[int, Path] | None = None
    while True:
        for name in names:
            file = directory / name
            if file.is_file():
                limit = parse_limit(file.read_text(), total)
                if limit is not None and (best is None or limit < best[0]):
                    best = (limit, file)
        if directory == mount or mount not in directory.parents:
            return best
        directory = directory.parent


def release_free_heap() -> None:
    """Hand the heap pages malloc holds free back to the kernel (glibc's malloc_trim),
    so that the resident set counts what the process uses: a model load frees hundreds
    of MiB of staging buffers that would otherwise stay resident and unused."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


# madvise(2) advice that faults a range in writable without changing its contents
# (Linux 5.14 and later); Python's mmap module does not name it before 3.13.
MADV_POPULATE_WRITE = 23


def zeroed_cpu_tensors(
    count: int, shape: tuple[int, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    """`count` zero-filled CPU tensors of `shape`, in one anonymous mapping: the kernel
    supplies zeroed pages, so allocating costs nothing on the way to serving, and a
    background thread faults every page in at once (MADV_POPULATE_WRITE, which leaves
    what serving has already written intact), so the memory is held from the start as a
    cache zeroed in place would hold it. Where the kernel lacks that advice, pages are
    faulted in as they are first written."""
    import mmap

    import torch

    each = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(1, count * each))
    flat = torch.frombuffer(region, dtype=torch.uint8)
    tensors = [flat[i * each : (i + 1) * each].view(dtype).view(shape) for i in range(count)]
    if count and each:
        threading.Thread(
            target=_populate,
            args=(flat.data_ptr(), count * each),
            name="pagedinfer-kv-populate",
            daemon=True,
        ).start()
    return tensors


def _populate(address: int, length: int) -> None:
    """Fault in [address, address + length) for writing; ctypes drops the GIL meanwhile."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise(address, length, MADV_POPULATE_WRITE)


def resident_bytes(proc_root: Path = Path("/proc")) -> int:
    """This process's resident set (VmRSS), in bytes."""
    for line in (proc_root / "self" / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{proc_root}/self/status has no VmRSS line")


def _mib(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.2f} MiB"
