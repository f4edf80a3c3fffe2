"""How many threads the CPU forward pass uses: the CPUs this process may really run on.

torch sizes its intra-op pool by the CPUs it can see. In a container that is the whole
node, while the pod's CPU limit (a CFS quota) lets it run on far fewer: with 64 threads
on a 2-CPU quota, every parallel region waits on threads the kernel has throttled, and
a step takes several times longer. So the engine caps the pool at the quota, unless the
operator chose a number (`--num-threads`) or set OMP_NUM_THREADS, which torch honours.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the CFS quota allows (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`); None when there is no quota or it cannot be read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


MAX_THREADS_PER_CPU = 4  # beyond this many threads a CPU, --num-threads is a mistake


def configure_cpu_threads(num_threads: int | None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Set torch's intra-op threads for a CPU engine and return how many it uses.

    num_threads: the operator's choice, or None: OMP_NUM_THREADS when set, else what
    torch sees, capped at the CFS quota (rounded down, at least 1).
    """
    if num_threads is not None:
        cpus = os.cpu_count() or 1
        # Past the CPUs threads only wait for each other at every barrier; far past them
        # the process cannot even start them.
        if num_threads > MAX_THREADS_PER_CPU * cpus:
            raise ValueError(
                f"--num-threads {num_threads} is far more than the {cpus} CPUs of this "
                f"machine; give at most {cpus}, or leave it out to use them all"
            )
        torch.set_num_threads(num_threads)
        reason = "--num-threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        reason = "OMP_NUM_THREADS"
    else:
        limit = cgroup_cpu_limit(cgroup_root)
        reason = "visible CPUs"
        if limit is not None and limit < torch.get_num_threads():
            torch.set_num_threads(max(1, math.floor(limit)))
            reason = f"CPU quota of {limit:g}"
    threads = torch.get_num_threads()
    log.info("CPU forward pass: %d threads (%s), OpenMP spin %s", threads, reason, openmp_spin())
    return threads


def openmp_spin() -> str:
    """How OpenMP's threads wait after a parallel region, as libgomp was told (see
    `pagedinfer.service.openmp`): GOMP_SPINCOUNT (which libgomp takes over the policy), else
    OMP_WAIT_POLICY, else "default" (300,000 spins)."""
    return os.environ.get("GOMP_SPINCOUNT") or os.environ.get("OMP_WAIT_POLICY", "default")
