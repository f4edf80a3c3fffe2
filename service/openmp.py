"""How the CPU engine's OpenMP threads wait, set where an engine starts, before torch loads.

OpenMP's threads (torch's and MKL's, from GNU libgomp) spin after each parallel region
before they sleep, 300,000 times by default: milliseconds in which they hold the cores
that the CPU backend's compiled kernels need right after torch's ops. 30,000 spins still
bridge the gaps between torch's back-to-back ops. libgomp reads its settings once, when
torch loads it, so the entry points that start an engine (the `pagedinfer` command's
`serve` and `generate`, the offline `LLM`, the benchmarks) apply `spin_env()` before
they import torch. Importing this module (or `pagedinfer.service`) changes nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

OPENMP_SPIN_COUNT = "30000"
# An operator's own choice of either wins: libgomp lets GOMP_SPINCOUNT override the policy.
OPERATOR_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def spin_env(
    environ: Mapping[str, str] | None = None, torch_loaded: bool | None = None
) -> dict[str, str]:
    """The variables to add to the environment before torch loads: GOMP_SPINCOUNT, unless
    torch (and so libgomp) is loaded already, which makes it too late to matter, or the
    operator set GOMP_SPINCOUNT or OMP_WAIT_POLICY. Use as `os.environ.update(spin_env())`."""
    environ = os.environ if environ is None else environ
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded or any(name in environ for name in OPERATOR_SETTINGS):
        return {}
    return {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
