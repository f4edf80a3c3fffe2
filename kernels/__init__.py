"""Paged-attention ops: Triton kernels on GPU, a vectorised torch path on CPU. `write_kv`
and `paged_attention` are the contract every backend matches: the model's torch forward
runs on them.

The CPU backend (`kernels.cpu`, behind `kernels.cpu.prepare`) runs a whole forward pass
with faster parts. Where a call's attention plan allows it (the backend's plans do), the
torch path of `paged_attention` hands fp32 new tokens to numba-compiled kernels
(`cpu.paged_decode`, `cpu.paged_verify`), which the backend's fused step also calls
directly.

KV cache per layer: `k_cache`, `v_cache`, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. The slot of context position p of a sequence is
`block_table[p // block_size] * block_size + p % block_size`.

Backend choice, per call: the Triton kernels for CUDA tensors, or for any tensors when
the environment has `TRITON_INTERPRET=1` (Triton's CPU interpreter, used by the tests;
it must be set before the kernels are first used); the torch path otherwise. Triton is
imported only when its kernels are first needed, so CPU serving does not need it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["AttentionMetadata", "paged_attention", "use_triton", "write_kv"]


def _yield_top_level_name() -> None:
    """Load the installed top-level package `kernels` in place of this folder.

    With a checkout's root on sys.path (`python -m ...` or `python -c` run there), this
    folder is found as a top-level package `kernels` and would shadow the PyPI package of
    that name, which transformers imports. pagedinfer imports this folder only as
    `pagedinfer.kernels`; where no other `kernels` is installed, the folder stays as found.
    """
    root = Path(__file__).resolve().parent.parent
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds
    spec.loader.exec_module(module)


# Imported under any other name (a process started at the repository root finds this
# folder as a top-level `kernels`), it hands the name to an installed package of that
# name, or else stays an empty module: it never imports pagedinfer, which such a process
# may not have.
if __name__ == "kernels":
    _yield_top_level_name()
else:
    from pagedinfer.kernels.dispatch import paged_attention, use_triton, write_kv
    from pagedinfer.kernels.metadata import AttentionMetadata
