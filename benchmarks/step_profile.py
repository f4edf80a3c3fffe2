"""Where a pagedinfer run's time goes, phase by phase of its compiled steps.

Serves a workload in one engine twice: a first turn as a warm-up, then a turn with the
fused step compiled with cycle counters (`kernels.cpu.fused_step.PHASES`; the counters read
the CPU's time-stamp counter at each barrier, about 30 reads a layer, and change no
result). Steps that carry any prompt token and decode steps are reported apart, each
with:

- every phase's seconds, working and then waiting at the barrier that ends it (the mean
  over the workers: a worker that waits there had less work, or started late);
- the seconds outside the compiled step: Python (scheduling, the step's inputs,
  sampling, detokenising) and handing the step to the worker threads;
- the rate of the layer GEMMs (their FLOPs over their phases' seconds), and its share of
  the machine's fp32 matmul rate when given.

`throughput.py` runs this on its own workload with n-gram drafts (its paged_spec system);
on its own:

    python benchmarks/step_profile.py                 # the default workload, JSON
    python benchmarks/step_profile.py --num-requests 8
    python benchmarks/step_profile.py --workload chat --num-requests 49 --model noisy \
        --num-speculative-tokens 0
"""

from __future__ import annotations

# First, before torch loads: the engine's OpenMP settings (`pagedinfer.service.openmp`).
import os  # isort: skip

from pagedinfer.service.openmp import spin_env  # isort: skip

os.environ.update(spin_env())
import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import limits
import numpy as np
import torch

from pagedinfer.kernels.cpu import fused_step
from pagedinfer.kernels.cpu.numba_support import cycles
from pagedinfer.service.config import GGUF_ACTIVATIONS, EngineConfig
from pagedinfer.service.engine import LLMEngine
from pagedinfer.service.sampling_params import SamplingParams

GEMM_PHASES = ("qkv", "o", "gate_up", "down")


def cycles_per_second(seconds: float = 0.2) -> float:
    """The cycle counter's rate (constant on the CPUs this runs on), against the clock."""
    start_cycles, start = cycles(), time.perf_counter()
    time.sleep(seconds)
    return (cycles() - start_cycles) / (time.perf_counter() - start)


def profiling_engine(config: EngineConfig) -> LLMEngine:
    """An engine for `profile_run`: the config's, without prefix caching, so that the
    profiled turn computes every prompt, as a first serving of them would."""
    return LLMEngine(dataclasses.replace(config, enable_prefix_caching=False))


def profile_run(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_lens: list[int],
    warm_prompts: list[list[int]],
    warm_output_lens: list[int],
    matmul_gflops: float | None = None,
) -> dict[str, Any]:
    """Serve the requests (greedy, fixed lengths) once to warm up, then once profiled, in
    an engine from `profiling_engine`: the phases of the prompt steps and of the decode
    steps (module doc)."""
    if engine.config.enable_prefix_caching:
        raise ValueError("step profile: the engine caches prefixes (use profiling_engine)")
    executor = engine.runner.executor
    # Ready: active, or activated by the engine's next step.
    if executor is None or executor.fused is None or not executor.ready:
        raise RuntimeError("step profile: this model gets no fused step on this machine")
    workers = torch.get_num_threads()
    profile = np.zeros((workers, len(fused_step.PHASES), 2), dtype=np.int64)
    executor.step_profile = profile
    try:  # compiles the kernel with the counters; the second turn fills the caches
        for p, o in ((warm_prompts, warm_output_lens), (prompts, output_lens)):
            _serve(engine, p, o)
    finally:
        executor.step_profile = None
    profile[:] = 0
    kinds: dict[str, dict[str, Any]] = {
        kind: {"steps": 0, "tokens": 0, "seconds": 0.0, "cycles": np.zeros_like(profile)}
        for kind in ("prompt_steps", "decode_steps")
    }
    execute = engine.runner.execute

    def profiled(out):
        kind = kinds[
            "prompt_steps"
            if any(
                s.request.num_computed_tokens < s.request.num_prompt_tokens for s in out.scheduled
            )
            else "decode_steps"
        ]
        before = profile.copy()
        start = time.perf_counter()
        result = execute(out)
        kind["seconds"] += time.perf_counter() - start
        kind["steps"] += 1
        kind["tokens"] += out.num_batched_tokens
        kind["cycles"] += profile - before
        return result

    executor.step_profile = profile
    engine.runner.execute = profiled
    try:
        start = time.perf_counter()
        _serve(engine, prompts, output_lens)
        seconds = time.perf_counter() - start
    finally:
        del engine.runner.execute  # back to the class's method
        executor.step_profile = None
    rate = cycles_per_second()
    flops_per_token = limits.layer_flops_per_token(engine.runner.model)
    result: dict[str, Any] = {
        "workers": workers,
        "seconds": round(seconds, 3),
        "cycle_counter_ghz": round(rate / 1e9, 3),
    }
    for name, kind in kinds.items():
        result[name] = _summary(kind, rate, flops_per_token, matmul_gflops)
    return result


def _serve(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> None:
    for prompt, n in zip(prompts, output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _summary(
    kind: dict[str, Any], rate: float, flops_per_token: int, matmul_gflops: float | None
) -> dict[str, Any]:
    per_worker = kind["cycles"] / rate  # seconds [workers, phases, work | wait]
    mean = per_worker.mean(axis=0)
    kernel = float(per_worker.sum(axis=(1, 2)).max())
    phases = {
        name: {"work_s": round(float(work), 4), "wait_s": round(float(wait), 4)}
        for name, (work, wait) in zip(fused_step.PHASES, mean, strict=True)
    }
    gemm = sum(phases[name]["work_s"] for name in GEMM_PHASES)
    summary: dict[str, Any] = {
        "steps": kind["steps"],
        "tokens": kind["tokens"],
        "seconds": round(kind["seconds"], 3),
        "compiled_step_s": round(kernel, 3),
        "outside_compiled_step_s": round(kind["seconds"] - kernel, 3),
        "phases": phases,
        "wait_s": round(float(mean[:, 1].sum()), 4),
    }
    if kind["steps"] and gemm > 0:
        # The rows that reach no LM head skip the last layer's o and MLP: a little less.
        gflops = kind["tokens"] * flops_per_token / gemm / 1e9
        summary["layer_gemm_gflops"] = round(gflops, 1)
        if matmul_gflops:
            summary["layer_gemm_share_of_matmul_rate"] = round(gflops / matmul_gflops, 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    import throughput  # the workload (throughput imports this module)

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    throughput.add_workload_args(ap)
    ap.add_argument("--kv-cache-memory", type=int, default=256 * 2**20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--workload",
        choices=("mixed", "chat"),
        default="mixed",
        help="mixed: random token ids (the options above); chat: the first --num-requests "
        "real chat prompts, as throughput.py's chat workload",
    )
    ap.add_argument(
        "--model",
        default="embedded",
        help="as throughput.py's --model: embedded, noisy, noisy-bf16, or a local Hugging "
        "Face directory or .gguf file",
    )
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument(
        "--gguf-activations",
        default=EngineConfig.gguf_activations,
        choices=GGUF_ACTIVATIONS,
        help="a GGUF model's GEMM products, as the server's flag",
    )
    args = ap.parse_args(argv)
    engine_model = throughput.resolve_model(args.model)[0]
    config = EngineConfig(
        **({"model": engine_model} if engine_model is not None else {}),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        gguf_activations=args.gguf_activations,
    )
    engine = profiling_engine(config)
    vocab = engine.vocab_size
    if args.workload == "chat":
        wl = throughput.Workload(
            *throughput.chat_workload(engine.tokenizer, args.num_requests, args.max_model_len)
        )
    else:
        wl = throughput.workload_from_args(args, vocab)
    warm = throughput.mixed_workload(
        4, vocab, args.seed + 1, args.prompt_mean, 8, args.max_model_len
    )
    gflops = throughput.matmul_gflops(torch.float32)
    result = profile_run(engine, wl.prompts, wl.output_lens, warm.prompts, warm.output_lens, gflops)
    result["matmul_gflops"] = round(gflops, 1)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
