"""vLLM's CPU build as a system of benchmarks/throughput.py.

vLLM lives in its own virtualenv (`setup_vllm.sh`), so it is driven as a subprocess:
`vllm_driver.py` under that venv's Python, given the same token ids, output lengths,
model directory, dtype and thread count as pagedinfer, with the settings vLLM's CPU
docs ask for: the KV cache size (`VLLM_CPU_KVCACHE_SPACE`), the cores its OpenMP
threads are bound to (`VLLM_CPU_OMP_THREADS_BIND`), and tcmalloc preloaded. The KV
cache gets pagedinfer's budget to the byte, as the engine argument `kv_cache_memory_bytes`
(`VLLM_CPU_KVCACHE_SPACE`, its older form in whole GiB, would override it, so it is unset).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from peers.paths import shown

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE / ".venv-vllm"
DRIVER = HERE / "vllm_driver.py"


@dataclass
class VllmJob:
    """What one vLLM run serves, and with which limits (pagedinfer's own)."""

    model: Path
    dtype: str  # "float32" or "bfloat16"
    threads: int
    kv_cache_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def unavailable(venv: Path = DEFAULT_VENV) -> str | None:
    """Why vLLM cannot run here, or None when its venv is set up."""
    if not (venv / "READY").is_file() or not python_of(venv).is_file():
        return f"no vLLM environment at {shown(venv)} (bash benchmarks/peers/setup_vllm.sh)"
    return None


def version(venv: Path = DEFAULT_VENV) -> str | None:
    """vLLM's and torch's versions in the venv, as its setup recorded them."""
    path = venv / "READY"
    return path.read_text().strip() if path.is_file() else None


def tcmalloc_path() -> str | None:
    """The tcmalloc library to preload (a name the loader finds), where the system has one."""
    return ctypes.util.find_library("tcmalloc_minimal")


def bound_cores(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as vLLM's bind list ("0,1")."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise ValueError(f"{threads} threads asked for, but only {len(cpus)} CPUs are usable")
    return ",".join(str(c) for c in cpus[:threads])


def environment(job: VllmJob) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = bound_cores(job.threads)
    env["OMP_NUM_THREADS"] = str(job.threads)
    # No telemetry, and nothing looked up on a model hub: the model is a local directory.
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if tcmalloc := tcmalloc_path():
        env["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, env.get("LD_PRELOAD")) if p)
    # The project's own package and the benchmark's modules are not vLLM's business.
    env.pop("PYTHONPATH", None)
    return env


def run_vllm(
    job: VllmJob,
    workload: tuple[list[list[int]], list[int]],
    warmup: tuple[list[list[int]], list[int]],
    venv: Path = DEFAULT_VENV,
    timeout: float = 3600,
) -> dict:
    """Serve `warmup`, then `workload` (prompts, output lengths) in a fresh vLLM process.

    Returns the driver's result: `seconds` for the workload, the output token ids, and
    vLLM's own versions and start-up time. Raises RuntimeError with vLLM's log tail when
    it fails, or when it produced other lengths than asked.
    """
    if reason := unavailable(venv):
        raise RuntimeError(reason)
    body = {
        "model": str(job.model),
        "dtype": job.dtype,
        "max_model_len": job.max_model_len,
        "max_num_batched_tokens": job.max_num_batched_tokens,
        "max_num_seqs": job.max_num_seqs,
        "kv_cache_memory_bytes": job.kv_cache_bytes,
        "enable_prefix_caching": job.enable_prefix_caching,
        "warmup": {"prompts": warmup[0], "output_lens": warmup[1]},
        "workload": {"prompts": workload[0], "output_lens": workload[1]},
    }
    with tempfile.TemporaryDirectory(prefix="vllm-job-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(body))
        proc = subprocess.run(
            [str(python_of(venv)), str(DRIVER), str(job_path), str(result_path)],
            env=environment(job),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(result_path.read_text())
    got = [len(t) for t in result["output_token_ids"]]
    if got != list(workload[1]):
        raise RuntimeError(f"vLLM returned {sum(got)} output tokens, not {sum(workload[1])}")
    return result
