"""Throughput side by side in one run: pagedinfer (paged, paged with n-gram speculative
decoding, contiguous) against its peers, vLLM's CPU build and llama.cpp's server (each
in its own environment, `benchmarks/peers/`), and Hugging Face.

Workloads (docs/architecture.md section 11), each with fixed output lengths (EOS ignored) so every
system does the same work, all requests arriving at once (offline batch): `mixed`, N
requests of random token ids with ShareGPT-like lognormal lengths scaled down for a CPU,
fixed seed; `chat`, real chat prompts under the model's chat template; `extraction`, real
extraction and editing prompts whose answers repeat their passage, rendered the same way
(`benchmarks/workloads/`). Another workload shares one long system prompt and compares
prefix caching on and off.

    python benchmarks/throughput.py --json            # the full comparison
    python benchmarks/throughput.py --systems paged --num-requests 8   # a quick look
    python benchmarks/throughput.py --systems paged,vllm,llamacpp --workload chat

Prints one JSON object keyed by system and saves a PNG plot.
"""

from __future__ import annotations

# First, before torch loads: the engine's OpenMP settings (`pagedinfer.service.openmp`).
import os  # isort: skip

from pagedinfer.service.openmp import spin_env  # isort: skip

os.environ.update(spin_env())
import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peers.run_llamacpp import DEFAULT_DIR as DEFAULT_LLAMACPP_DIR
from peers.run_vllm import DEFAULT_VENV as DEFAULT_VLLM_VENV
from workloads.chat import CHAT_PROMPTS, chat_workload
from workloads.extraction import extraction_workload

from pagedinfer.service.config import GGUF_ACTIVATIONS, EngineConfig
from pagedinfer.service.engine import LLMEngine
from pagedinfer.service.loader import load_model
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.threads import openmp_spin

SYSTEMS = ("paged", "paged_spec", "contiguous", "vllm", "llamacpp", "hf_static", "hf_continuous")
# Systems set up outside the project's environment: skipped, with the reason, when absent.
PEERS = ("vllm", "llamacpp")
WORKLOADS = ("mixed", "chat", "extraction")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def mixed_workload(
    n: int, vocab: int, seed: int, prompt_mean: int, output_mean: int, max_len: int
) -> Workload:
    """Lognormal prompt and output lengths (ShareGPT's shape, scaled to the given means)."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu_p = math.log(prompt_mean) - sigma**2 / 2
    mu_o = math.log(output_mean) - sigma**2 / 2
    prompts, outs = [], []
    for _ in range(n):
        p = int(np.clip(rng.lognormal(mu_p, sigma), 4, max_len // 2))
        o = int(np.clip(rng.lognormal(mu_o, sigma), 4, max_len - p))
        # Ordinary vocabulary ids: skip the first few hundred, where special tokens live.
        prompts.append(rng.integers(300, vocab, size=p).tolist())
        outs.append(o)
    return Workload(prompts, outs)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The mixed workload's options (`workload_from_args`), shared by the drivers."""
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-mean", type=int, default=96)
    ap.add_argument("--output-mean", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace, vocab: int) -> Workload:
    return mixed_workload(
        args.num_requests, vocab, args.seed, args.prompt_mean, args.output_mean, args.max_model_len
    )


def shared_prefix_workload(
    n: int, vocab: int, seed: int, prefix_len: int, out_len: int
) -> Workload:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(300, vocab, size=prefix_len).tolist()
    prompts = [
        prefix + rng.integers(300, vocab, size=int(rng.integers(8, 32))).tolist() for _ in range(n)
    ]
    return Workload(prompts, [out_len] * n)


def matmul_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """The matmul rate of this machine right now in `dtype`: the physical limit for the model."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9


def read_bandwidth(size_bytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s this machine reads from memory right now (a reduction over 1 GiB)."""
    data = torch.ones(size_bytes // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t)
    return size_bytes / best


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q))


def summarise(name, wl, elapsed, params, gflops, ttfts=None, tpots=None, extra=None) -> dict:
    total = wl.prompt_tokens + wl.output_tokens
    result = {
        "system": name,
        "requests": len(wl.prompts),
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(wl.output_tokens / elapsed, 2),
        "total_tokens_per_s": round(total / elapsed, 2),
        "mfu": round(2 * params * total / elapsed / (gflops * 1e9), 4),
    }
    for label, values in (("ttft", ttfts), ("tpot", tpots)):
        if values:
            result[f"{label}_mean_s"] = round(statistics.fmean(values), 4)
            result[f"{label}_p50_s"] = round(percentile(values, 50), 4)
            result[f"{label}_p99_s"] = round(percentile(values, 99), 4)
    result.update(extra or {})
    return result


def run_pagedinfer(
    name: str,
    wl: Workload,
    config: EngineConfig,
    params: int,
    gflops: float,
    engine: LLMEngine | None = None,
    warmup: Workload | None = None,
    passes: list[tuple[int, int]] | None = None,
) -> tuple[dict, list]:
    """Serve the workload; `passes`, when given, receives (tokens, logits rows) per forward."""
    engine = engine or LLMEngine(config)
    if warmup is not None:
        run_pagedinfer("warmup", warmup, config, params, gflops, engine)
    if passes is None:
        return _serve(name, wl, params, gflops, engine)
    execute = engine.runner.execute

    def recording(out):
        result = execute(out)
        passes.append((out.num_batched_tokens, result.logits.shape[0]))
        return result

    engine.runner.execute = recording
    try:
        return _serve(name, wl, params, gflops, engine)
    finally:
        del engine.runner.execute  # back to the class's method


def _serve(
    name: str, wl: Workload, params: int, gflops: float, engine: LLMEngine
) -> tuple[dict, list]:
    before = engine.stats()
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    ids = []
    for prompt, out_len in zip(wl.prompts, wl.output_lens, strict=True):
        sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(prompt, sp, arrival_time=time.monotonic()))
    peak = 0
    passes = 0
    timeline = []
    while engine.has_unfinished():
        deltas = engine.step()
        passes += 1
        now = time.perf_counter() - start
        stats = engine.stats()
        peak = max(peak, stats.running)
        timeline.append((now, stats.running, stats.kv.used / max(stats.kv.total, 1)))
        for d in deltas:
            first.setdefault(d.request_id, now)
            if d.finish_reason is not None:
                done[d.request_id] = now
    elapsed = time.perf_counter() - start
    ttfts = [first[r] for r in ids]
    tpots = [
        (done[r] - first[r]) / (n - 1) for r, n in zip(ids, wl.output_lens, strict=True) if n > 1
    ]
    stats = engine.stats()
    extra = {
        "peak_running": peak,
        "steps": passes,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "kv_blocks": stats.kv.total,
        "prefix_cache_hit_rate": round(
            (stats.prefix_cache_hits - before.prefix_cache_hits)
            / max(stats.prefix_cache_queries - before.prefix_cache_queries, 1),
            4,
        ),
    }
    drafts = stats.draft_tokens - before.draft_tokens
    if drafts:
        accepted = stats.accepted_draft_tokens - before.accepted_draft_tokens
        extra["draft_tokens"] = drafts
        extra["accepted_draft_tokens"] = accepted
        extra["draft_acceptance_rate"] = round(accepted / drafts, 4)
    return summarise(name, wl, elapsed, params, gflops, ttfts, tpots, extra), timeline


def critical_path(
    wl: Workload,
    config: EngineConfig,
    params: int,
    gflops: float,
    engine: LLMEngine,
) -> dict:
    """The workload's floor: its longest request served alone.

    Its output tokens come out one forward pass after another, and a batch that holds
    it costs at least what a step of it alone costs, so no schedule of this engine
    finishes the workload sooner. From it follow the most any schedule could gain over
    each baseline, and the highest MFU the workload allows (all its FLOPs done in the
    floor's time). Below it lies a floor for any engine: each of those steps reads every
    weight once, in the least bytes that hold it exactly (its quantisation grid where the
    model keeps one), at the machine's read bandwidth (of an array larger than the L3
    cache; weights that stay cached in a 300 MB L3 beat it).
    """
    longest = max(range(len(wl.prompts)), key=lambda i: (wl.output_lens[i], len(wl.prompts[i])))
    # Fresh tokens of the same length: its own prompt would now hit the prefix cache.
    rng = np.random.default_rng(len(wl.prompts))
    prompt = rng.integers(300, engine.vocab_size, size=len(wl.prompts[longest])).tolist()
    alone = Workload([prompt], [wl.output_lens[longest]])
    result, _ = run_pagedinfer("critical_path", alone, config, params, gflops, engine)
    floor = result["seconds"]
    total = wl.prompt_tokens + wl.output_tokens
    # Below any engine: every decode step reads every weight once (the tied LM head
    # counted once), at the machine's read bandwidth, and nothing else. The weights in
    # the least bytes that hold them exactly: their quantisation grid where the CPU
    # executor keeps one (`kernels.cpu.fused_step`), else as stored.
    model = engine.runner.model
    executor = engine.runner.executor
    fused = executor.fused if executor is not None and executor.active else None
    weight_bytes = (
        fused.nbytes
        if fused is not None
        else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    bandwidth = read_bandwidth()
    return {
        "prompt_tokens": len(alone.prompts[0]),
        "output_tokens": alone.output_lens[0],
        "seconds": floor,
        "step_ms": round(1e3 * floor / alone.output_lens[0], 1),
        "mfu_ceiling": round(min(1.0, 2 * params * total / floor / (gflops * 1e9)), 4),
        "read_gb_per_s": round(bandwidth / 1e9, 1),
        "weight_read_ms": round(1e3 * weight_bytes / bandwidth, 1),
        "weight_read_floor_s": round(alone.output_lens[0] * weight_bytes / bandwidth, 2),
    }


def gemm_limits(
    wl: Workload,
    engine: LLMEngine,
    passes: list[tuple[int, int]],
    spec_passes: list[tuple[int, int]] | None = None,
) -> dict:
    """The model's GEMMs alone (see limits.py), in the paged run's own passes (and the
    speculative run's, when given: each (tokens, logits rows)); and the floors for any
    engine on this machine's libraries that computes the logits of each output token:
    the GEMMs of any schedule of the workload, plus its decode attention. (This engine
    picks a greedy row's token without most of its logits, `kernels.cpu.greedy_argmax`, so its
    LM head can go below the floor's.)

    Ceilings are against the best matmul rate seen around and in the GEMM timings.
    """
    import limits  # scipy's linear programs: imported only for this analysis

    model, executor = engine.runner.model, engine.runner.executor
    every_pass = passes + (spec_passes or [])
    tokens = [m for m, _ in every_pass]
    rows = [r for _, r in every_pass if r]

    def grid(counts: list[int]) -> set[int]:
        return set(counts) | {2**i for i in range(12) if 2**i <= max(counts)}

    dtype = model.embed_tokens.weight.dtype
    rate_before = matmul_gflops(dtype)
    curve = limits.gemm_curve(model, grid(tokens), executor=executor)
    lm_curve = {r: limits.lm_head_seconds(model, r, executor=executor) for r in sorted(grid(rows))}
    # The runs' rows are greedy: the engine picks their tokens, maybe without the logits.
    pick_curve = {
        r: limits.lm_head_seconds(model, r, greedy=True, executor=executor)
        for r in sorted(set(rows))
    }

    def in_passes(run: list[tuple[int, int]]) -> float:
        return sum(curve[m] for m, _ in run) + sum(pick_curve[r] for _, r in run if r)

    # The floor: every row count up to 32 (where the times move most), then a sparser
    # grid; past the largest point measured, the best rate's line bounds the cost.
    token_profile = limits.token_profile([len(p) for p in wl.prompts], wl.output_lens)
    row_profile = limits.row_profile(wl.output_lens)
    sparse = (40, 48, 64, 96, 128, 192, 256, 384, 512)

    def floor_grid(largest: int) -> list[int]:
        return [m for m in (*range(1, 33), *sparse) if m <= largest]

    dense = load_model(engine.config.model, "cpu", dtype, engine.config.max_model_len)
    best, best_lm = limits.best_gemm_curves(
        dense.model, floor_grid(max(token_profile)), floor_grid(max(row_profile))
    )
    # The largest points once each: they take seconds, and vary little.
    big = [m for m in (1024, 2048) if m <= max(token_profile)]
    best.update(limits.best_gemm_curves(dense.model, big, [], repeats=1)[0])
    del dense
    # The engine's own form is one of those forms, timed separately: where its timing
    # came out faster (the machine's noise), it is the least seen.
    for fastest, own in ((best, curve), (best_lm, lm_curve)):
        for m, t in own.items():
            fastest[m] = min(t, fastest.get(m, t))
    # The machine's speed moves within minutes: its limit is the best rate seen, of the
    # big matmul before and after the curves and of every GEMM timed.
    per_token = limits.layer_flops_per_token(model)
    per_row = 2 * model.lm_head_weight().numel()
    rate = max(
        1e9 * max(rate_before, matmul_gflops(dtype)),
        *(m * per_token / t for m, t in (*curve.items(), *best.items())),
        *(r * per_row / t for r, t in (*lm_curve.items(), *best_lm.items())),
    )

    # No pass beats the best rate seen.
    layers_floor = limits.schedule_floor(
        limits.staircase(best, per_token / rate, max(token_profile)), token_profile
    )
    lm_floor = limits.schedule_floor(
        limits.staircase(best_lm, per_row / rate, max(row_profile)), row_profile
    )
    floor = layers_floor + lm_floor
    # Decode attention at its least cost per context position, over every batch a decode
    # pass can have: 1 to all the requests, contexts up to the longest.
    prompt_lens = [len(p) for p in wl.prompts]
    longest = max(p + o - 1 for p, o in zip(prompt_lens, wl.output_lens, strict=True))
    slot_seconds, slot_where = limits.attention_slot_seconds(
        model.config,
        {*(2**i for i in range(12) if 2**i < len(wl.prompts)), len(wl.prompts)},
        {*(2**i for i in range(4, 12) if 2**i < longest), longest},
        dtype,
    )
    slots = limits.decode_context_slots(prompt_lens, wl.output_lens)
    attention_floor = slot_seconds * slots * model.config.num_layers
    any_engine = floor + attention_floor
    params = sum(p.numel() for p in model.parameters())
    flops = 2 * params * (wl.prompt_tokens + wl.output_tokens)

    def shares(measured: dict[int, float]) -> dict[str, float]:
        return {
            str(m): round(m * per_token / measured[m] / rate, 3)
            for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
            if m in measured
        }

    paged_gemm = in_passes(passes)
    # The speculative engine's floor in its own schedule: its passes' GEMMs alone.
    spec = {}
    if spec_passes:
        spec_gemm = in_passes(spec_passes)
        spec = {
            "paged_spec_passes": len(spec_passes),
            "paged_spec_gemm_seconds": round(spec_gemm, 2),
            "paged_spec_mfu_ceiling": round(flops / spec_gemm / rate, 4),
        }
    return {
        "matmul_gflops_now": round(rate / 1e9, 1),
        "layer_gemm_share_of_matmul_rate": shares(curve),
        "best_form_layer_gemm_share_of_matmul_rate": shares(best),
        "paged_passes": len(passes),
        "paged_gemm_seconds": round(paged_gemm, 2),
        "paged_mfu_ceiling": round(flops / paged_gemm / rate, 4),
        **spec,
        "min_passes": len(row_profile),
        "any_schedule_floor_s": round(floor, 2),
        "any_schedule_lm_head_floor_s": round(lm_floor, 2),
        "any_schedule_mfu_ceiling": round(flops / floor / rate, 4),
        "decode_context_slots": slots,
        "decode_attention_ns_per_slot": round(1e9 * slot_seconds, 1),
        "decode_attention_least_at": {"sequences": slot_where[0], "context": slot_where[1]},
        "decode_attention_floor_s": round(attention_floor, 3),
        "any_engine_floor_s": round(any_engine, 2),
        "any_engine_mfu_ceiling": round(flops / any_engine / rate, 4),
    }


def _load_hf(dtype: torch.dtype, model_dir: Path | None = None):
    """Hugging Face's model of `model_dir` (the embedded model's directory when None)."""
    from transformers import AutoModelForCausalLM

    from pagedinfer.service.loader import ensure_default_model

    path = model_dir or ensure_default_model()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def resolve_model(model: str) -> tuple[str | None, Path, Path | None]:
    """`--model` as (pagedinfer's EngineConfig.model, a Hugging Face directory, a GGUF file).

    "embedded" is the default model (the GGUF file and its converted directory), "noisy"
    its weights on no grid (`peers/noisy_checkpoint.py`), "noisy-bf16" those weights
    stored in bf16 (as most checkpoints are published), "FAMILY-shaped" (and
    "FAMILY-shaped-bf16", stored in bf16) a checkpoint of random weights with the shapes of
    `peers/shaped_checkpoint.py`'s SHAPES[FAMILY], anything else a
    local Hugging Face directory or .gguf file. The GGUF file is None where the model has
    none, and llama.cpp is then skipped.
    """
    from pagedinfer.service.loader import (
        default_gguf_path,
        ensure_converted_gguf,
        ensure_default_model,
    )

    if model == "embedded":
        return None, ensure_default_model(), default_gguf_path()
    if model in ("noisy", "noisy-bf16"):
        from peers.noisy_checkpoint import ensure_noisy_model

        path = ensure_noisy_model(dtype=torch.bfloat16 if model == "noisy-bf16" else None)
        return str(path), path, None
    family, shaped, stored = model.partition("-shaped")
    if shaped and stored in ("", "-bf16"):
        from peers.shaped_checkpoint import SHAPES, ensure_shaped_model

        if family not in SHAPES:
            raise ValueError(f"--model {model!r}: no shape {family!r} (known: {', '.join(SHAPES)})")
        dtype = torch.bfloat16 if stored else torch.float32
        path = ensure_shaped_model(family=family, dtype=dtype)
        return str(path), path, None
    path = Path(model).resolve()
    if path.is_file() and path.suffix == ".gguf":
        return str(path), ensure_converted_gguf(path), path
    if (path / "config.json").is_file():
        return str(path), path, None
    raise ValueError(
        f"--model {model!r}: not 'embedded', 'noisy', 'noisy-bf16', 'FAMILY-shaped[-bf16]', "
        "a .gguf file or a directory with config.json"
    )


def run_peer(
    name: str,
    wl: Workload,
    warm: Workload,
    args: argparse.Namespace,
    hf_dir: Path,
    gguf: Path | None,
    params: int,
    gflops: float,
) -> dict:
    """Serve the workload with a peer (vLLM or llama.cpp) on the same token ids and threads.

    Returns the summary, or {"system", "skipped": reason} when the peer is not set up here
    or cannot serve this model.
    """
    from peers import run_llamacpp, run_vllm

    work, warmup = (wl.prompts, wl.output_lens), (warm.prompts, warm.output_lens)
    if name == "vllm":
        if reason := run_vllm.unavailable(args.vllm_venv):
            return {"system": name, "skipped": reason}
        job = run_vllm.VllmJob(
            model=hf_dir,
            dtype=args.peer_dtype or args.dtype,
            threads=args.threads,
            kv_cache_bytes=args.kv_cache_memory,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(len(wl.prompts), 1),
        )
        out = run_vllm.run_vllm(job, work, warmup, args.vllm_venv)
        extra = {
            "dtype": job.dtype,
            "vllm_version": out["vllm_version"],
            "vllm_torch": out["torch_version"],
            "startup_seconds": out["startup_seconds"],
            "kv_cache_bytes": job.kv_cache_bytes,
            "prefix_cache_hit_rate": round(out["prefix_cached_tokens"] / wl.prompt_tokens, 4),
        }
        return summarise(name, wl, out["seconds"], params, gflops, extra=extra)
    if gguf is None:
        return {
            "system": name,
            "skipped": f"llama.cpp serves GGUF files; --model {args.model} has none",
        }
    if reason := run_llamacpp.unavailable(args.llamacpp_dir):
        return {"system": name, "skipped": reason}
    job = run_llamacpp.LlamaCppJob(
        gguf=gguf,
        threads=args.threads,
        max_model_len=args.max_model_len,
        batch_tokens=args.max_num_batched_tokens,
    )
    out = run_llamacpp.run_llamacpp(job, work, warmup, args.llamacpp_dir)
    extra = {
        "weights": gguf.name,
        "slots": out["slots"],
        "llama_cpp_python_sdist": out["llama_cpp_python_sdist"],
        "startup_seconds": out["startup_seconds"],
        "prompt_tokens_evaluated": out["prompt_tokens_evaluated"],
    }
    return summarise(name, wl, out["seconds"], params, gflops, extra=extra)


def run_hf_static(
    wl: Workload,
    model,
    params: int,
    gflops: float,
    batch: int,
    pad_id: int,
    warmup: Workload | None = None,
) -> dict:
    """The naive server: fixed batches, left padding, every batch runs to its longest output."""
    if warmup is not None:
        run_hf_static(warmup, model, params, gflops, batch, pad_id)
    start = time.perf_counter()
    ttfts: list[float] = []
    order = list(range(len(wl.prompts)))  # arrival order
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(wl.output_lens[i] for i in idx)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        # Static batching returns nothing until the batch ends: that is its TTFT.
        ttfts.extend([time.perf_counter() - start] * len(idx))
    return summarise(
        "hf_static",
        wl,
        time.perf_counter() - start,
        params,
        gflops,
        ttfts,
        extra={"batch_size": batch, "peak_running": batch},
    )


def run_hf_continuous(
    wl: Workload,
    model,
    params: int,
    gflops: float,
    kv_tokens: int,
    warmup: Workload | None = None,
) -> dict:
    """kv_tokens: the KV budget in tokens, the same as pagedinfer's, in HF's own pages."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0
    )
    # The page size is `page_size` in newer transformers, `block_size` in 5.1x.
    defaults = ContinuousBatchingConfig()
    page = getattr(defaults, "page_size", None) or defaults.block_size
    cb = ContinuousBatchingConfig(num_blocks=max(1, kv_tokens // page), max_batch_tokens=512)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()

    def serve(batch: Workload, tag: str) -> float:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(batch.prompts, batch.output_lens, strict=True)):
            manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n)
        got = 0
        while got < len(batch.prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("Hugging Face continuous batching stopped early")
            if result.is_finished():
                got += 1
        return time.perf_counter() - start

    try:
        if warmup is not None:
            serve(warmup, "warmup")
        elapsed = serve(wl, "r")
    finally:
        manager.stop(block=True, timeout=30)
    return summarise("hf_continuous", wl, elapsed, params, gflops)


def plot(results: dict, timelines: dict, path: Path, workload: str = "mixed") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in SYSTEMS if n in results and "skipped" not in results[n]]
    ax1.bar(names, [results[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"{workload.capitalize()} workload, same model, dtype and threads")
    for name, tl in timelines.items():
        if tl:
            ax2.plot([t for t, _, _ in tl], [r for _, r, _ in tl], label=f"{name}: running")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("running sequences")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    # The prompt workloads serve all their prompts unless told otherwise; mixed, 32 requests.
    ap.set_defaults(num_requests=None)
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="mixed",
        help="mixed: random token ids, lognormal lengths; chat: real chat prompts; "
        "extraction: real extraction and editing prompts, answers that repeat their context",
    )
    ap.add_argument(
        "--chat-prompts",
        type=Path,
        default=CHAT_PROMPTS,
        help="the chat workload's prompts (JSON; see benchmarks/workloads/)",
    )
    ap.add_argument(
        "--model",
        default="embedded",
        help="embedded (the default model, weights on its GGUF file's Q4_1 grid), noisy "
        "(those weights times 1 + 1e-3 noise: an ordinary checkpoint on no grid), "
        "noisy-bf16 (those stored in bf16), FAMILY-shaped or FAMILY-shaped-bf16 (random "
        "weights in a published model's shapes, stored in fp32 or bf16; FAMILY is one of "
        "peers/shaped_checkpoint.py's SHAPES: qwen2, qwen3, qwen3-1.7b, llama3-1b, "
        "gemma3-1b, phi4-mini-8l, smollm3-12l), or a local Hugging Face directory or .gguf "
        "file; every system serves it",
    )
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--llamacpp-dir", type=Path, default=DEFAULT_LLAMACPP_DIR)
    # 256 MiB holds about 5,800 tokens of SmolLM2's KV: the whole default workload at
    # once with paging, about 10 sequences with contiguous max_model_len reservations.
    ap.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes, both policies")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="draft tokens per decode of the paged_spec system (n-gram prompt lookup)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument(
        "--prefix-requests", type=int, default=16, help="0 skips the shared-prefix workload"
    )
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations of every system; MFU is against this dtype's matmul rate",
    )
    ap.add_argument(
        "--peer-dtype",
        choices=["float32", "bfloat16"],
        help="vLLM's dtype where it differs (a bf16 checkpoint: pagedinfer computes in fp32 "
        "from its bf16 weights, vLLM in bf16); default --dtype",
    )
    ap.add_argument(
        "--gguf-activations",
        choices=GGUF_ACTIVATIONS,
        default=EngineConfig.gguf_activations,
        help="how pagedinfer multiplies a GGUF file's codes: fp32 (exact) or int8 (as llama.cpp)",
    )
    ap.add_argument(
        "--plot", type=Path, default=Path(__file__).parent / "results" / "throughput.png"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the systems this many times, taking turns; each reports its fastest run",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    ap.add_argument(
        "--no-critical-path",
        action="store_true",
        help="skip serving the longest request alone (the workload's floor)",
    )
    ap.add_argument(
        "--no-gemm-limits",
        action="store_true",
        help="skip timing the model's GEMMs alone (the floor for any schedule)",
    )
    ap.add_argument(
        "--no-step-profile",
        action="store_true",
        help="skip profiling the paged_spec run's compiled steps phase by phase",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(
            f"unknown systems: {', '.join(sorted(unknown))} (choose from {', '.join(SYSTEMS)})"
        )

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        engine_model, hf_dir, gguf = resolve_model(args.model)
    except ValueError as err:
        ap.error(str(err))
    base = EngineConfig(
        model=engine_model,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        gguf_activations=args.gguf_activations,
    )
    spec_config = EngineConfig(
        **{**base.__dict__, "num_speculative_tokens": args.num_speculative_tokens}
    )
    engine = LLMEngine(base)
    vocab = engine.vocab_size
    params = sum(p.numel() for p in engine.runner.model.parameters())
    if args.workload == "chat":
        try:
            wl = Workload(
                *chat_workload(
                    engine.tokenizer, args.num_requests, args.max_model_len, args.chat_prompts
                )
            )
        except ValueError as err:
            ap.error(str(err))
    elif args.workload == "extraction":
        try:
            wl = Workload(
                *extraction_workload(engine.tokenizer, args.num_requests, args.max_model_len)
            )
        except ValueError as err:
            ap.error(str(err))
    else:
        args.num_requests = args.num_requests or 32
        wl = workload_from_args(args, vocab)
    dtype = getattr(torch, args.dtype)
    # Every system first serves a few other requests, as a running server would have:
    # the first calls of a process pay one-off costs (allocations, kernel selection).
    warm = mixed_workload(4, vocab, args.seed + 1, args.prompt_mean, 8, args.max_model_len)
    gflops = matmul_gflops(dtype)
    gflops_fp32 = gflops if dtype == torch.float32 else matmul_gflops(torch.float32)
    say(
        f"{args.dtype} matmul: {gflops:.1f} GFLOP/s; {args.workload} workload, "
        f"{len(wl.prompts)} requests, "
        f"{wl.prompt_tokens} prompt + {wl.output_tokens} output tokens"
    )
    results: dict[str, dict] = {
        "machine": {
            "threads": torch.get_num_threads(),
            # OpenMP's spin after each parallel region, for every system alike.
            "openmp_spin": openmp_spin(),
            "dtype": args.dtype,
            "gguf_activations": args.gguf_activations,
            "matmul_gflops": round(gflops, 1),
            "matmul_gflops_fp32": round(gflops_fp32, 1),
            "params": params,
            # Other processes' load: these machines are shared, and ratios are fairer
            # than absolute figures when it is not zero.
            "load_average_at_start": round(os.getloadavg()[0], 2),
        },
        "workload": {
            "name": args.workload,
            "model": args.model,
            "requests": len(wl.prompts),
            "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens,
        },
    }
    timelines: dict[str, list] = {}
    # The matmul rate before each system: the machine's speed moves within minutes, and
    # MFU is finally taken against the best rate seen in the run (what the machine reached).
    rates = [gflops]
    runs: dict[str, list[float]] = {name: [] for name in systems}
    hf_static_model = None  # generate() leaves the model as it was: one copy serves every round
    passes: list[tuple[int, int]] = []  # each forward's (tokens, logits rows), first round
    spec_passes: list[tuple[int, int]] = []
    # With --repeats, the systems take turns, round after round, and each keeps its
    # fastest run: every system is then compared at the best the machine gave it.
    for round_ in range(args.repeats):
        first = round_ == 0
        for name in systems:
            say(f"running {name} (run {round_ + 1} of {args.repeats}) ...")
            before = matmul_gflops(dtype)
            rates.append(before)
            timeline = None
            if name == "paged":
                # Later rounds get an engine of their own: the first one's prefix cache
                # holds this very workload's prompts.
                result, timeline = run_pagedinfer(
                    name,
                    wl,
                    base,
                    params,
                    gflops,
                    engine if first else None,
                    warm,
                    passes if first else None,
                )
            elif name == "paged_spec":
                result, timeline = run_pagedinfer(
                    name,
                    wl,
                    spec_config,
                    params,
                    gflops,
                    warmup=warm,
                    passes=spec_passes if first else None,
                )
            elif name == "contiguous":
                cfg = EngineConfig(**{**base.__dict__, "allocation_policy": "contiguous"})
                result, timeline = run_pagedinfer(name, wl, cfg, params, gflops, warmup=warm)
            elif name in PEERS:
                result = run_peer(name, wl, warm, args, hf_dir, gguf, params, gflops)
                if "skipped" in result:
                    say(f"skipping {name}: {result['skipped']}")
                    results[name] = result
                    continue
            else:
                if name == "hf_static":
                    hf_static_model = hf_static_model or _load_hf(dtype, hf_dir)
                    eos = engine.tokenizer.eos_token_id or 0
                    result = run_hf_static(
                        wl,
                        hf_static_model,
                        params,
                        gflops,
                        args.hf_batch,
                        eos,
                        warm if first else None,
                    )
                else:
                    # Continuous batching sets the model up for itself: a fresh copy each run.
                    kv_tokens = engine.num_blocks * base.block_size
                    result = run_hf_continuous(
                        wl, _load_hf(dtype, hf_dir), params, gflops, kv_tokens, warm
                    )
            # The machine's speed just before: a system that ran while it was slow shows it.
            result["matmul_gflops_before"] = round(before, 1)
            say(json.dumps(result))
            runs[name].append(result["seconds"])
            if name not in results or result["seconds"] < results[name]["seconds"]:
                results[name] = result
                if timeline is not None:
                    timelines[name] = timeline
            if name == "paged" and first and not args.no_critical_path:
                # Right after: the machine's speed drifts, and the floor is compared with it.
                say("running critical_path ...")
                results["critical_path"] = critical_path(wl, base, params, gflops, engine)
                say(json.dumps(results["critical_path"]))
        if first and passes and not args.no_gemm_limits:
            # After the first round, so that the paged and speculative runs' passes are
            # timed in one window of the machine's speed.
            say("timing the model's GEMMs alone ...")
            results["gemm_limits"] = gemm_limits(wl, engine, passes, spec_passes)
            rates.append(results["gemm_limits"]["matmul_gflops_now"])
            say(json.dumps(results["gemm_limits"]))
        if first and "paged_spec" in systems and not args.no_step_profile:
            say("profiling the paged_spec run's steps ...")
            import step_profile  # the CPU's compiled step (numba): only for this profile

            results["step_profile"] = step_profile.profile_run(
                step_profile.profiling_engine(spec_config),
                wl.prompts,
                wl.output_lens,
                warm.prompts,
                warm.output_lens,
                max(rates),
            )
            say(json.dumps(results["step_profile"]))
    hf_static_model = None
    for name in systems:
        if "skipped" not in results[name]:
            results[name]["runs_seconds"] = runs[name]
    if "gemm_limits" in results:
        gl = results["gemm_limits"]  # the share of the fastest paged run
        gl["paged_gemm_share"] = round(gl["paged_gemm_seconds"] / results["paged"]["seconds"], 3)
        if "paged_spec_gemm_seconds" in gl:
            gl["paged_spec_gemm_share"] = round(
                gl["paged_spec_gemm_seconds"] / results["paged_spec"]["seconds"], 3
            )
    if args.prefix_requests:
        pwl = shared_prefix_workload(args.prefix_requests, vocab, args.seed, args.prefix_len, 16)
        cfg_len = max(args.max_model_len, args.prefix_len + 64)
        for name, caching in (("prefix_cache_on", True), ("prefix_cache_off", False)):
            say(f"running {name} ...")
            rates.append(matmul_gflops(dtype))
            cfg = EngineConfig(
                **{**base.__dict__, "max_model_len": cfg_len, "enable_prefix_caching": caching}
            )
            # Warm the cache with one request first, as a server would be warm.
            eng = LLMEngine(cfg)
            primer = Workload(pwl.prompts[:1], [1])
            run_pagedinfer("warm", primer, cfg, params, gflops, eng)
            results[name], _ = run_pagedinfer(name, pwl, cfg, params, gflops, eng)
            say(json.dumps(results[name]))
        on, off = results["prefix_cache_on"], results["prefix_cache_off"]
        results["prefix_cache_ttft_speedup"] = round(off["ttft_mean_s"] / on["ttft_mean_s"], 2)
    best = max(rates)
    results["machine"]["matmul_gflops_best"] = round(best, 1)
    for name, result in results.items():
        if not isinstance(result, dict):
            continue
        used = result.get("matmul_gflops_now", gflops) if name == "gemm_limits" else gflops
        for key in [k for k in result if k == "mfu" or k.endswith("mfu_ceiling")]:
            result[key] = round(result[key] * used / best, 4)
    if "critical_path" in results:
        cp = results["critical_path"]
        for name in ("paged", "hf_static", "hf_continuous"):
            if name in results:
                seconds = results[name]["seconds"]
                cp[f"max_speedup_vs_{name}"] = round(seconds / cp["seconds"], 2)
                cp[f"physical_max_speedup_vs_{name}"] = round(
                    seconds / cp["weight_read_floor_s"], 2
                )
    if "gemm_limits" in results:
        gl = results["gemm_limits"]
        for name in ("paged", "hf_static", "hf_continuous"):
            if name in results:
                seconds = results[name]["seconds"]
                gl[f"gemm_only_max_speedup_vs_{name}"] = round(
                    seconds / gl["any_schedule_floor_s"], 2
                )
                gl[f"max_speedup_vs_{name}"] = round(seconds / gl["any_engine_floor_s"], 2)
                if "paged_spec_gemm_seconds" in gl:
                    gl[f"paged_spec_gemm_only_max_speedup_vs_{name}"] = round(
                        seconds / gl["paged_spec_gemm_seconds"], 2
                    )
    ratios = {}
    baselines = ("vllm", "llamacpp", "hf_static", "hf_continuous")
    pairs = [(a, b) for a in ("paged", "paged_spec") for b in baselines]
    pairs += [("paged", "contiguous"), ("paged_spec", "paged")]
    served = {n for n, r in results.items() if isinstance(r, dict) and "output_tokens_per_s" in r}
    for a, b in pairs:
        if a in served and b in served:
            ratios[f"{a}_vs_{b}"] = round(
                results[a]["output_tokens_per_s"] / results[b]["output_tokens_per_s"], 2
            )
    results["ratios"] = ratios
    results["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    plot(results, timelines, args.plot, args.workload)
    # Relative to the working directory when possible: no machine paths in saved results.
    plot_path = args.plot.resolve()
    results["plot"] = str(
        plot_path.relative_to(Path.cwd()) if plot_path.is_relative_to(Path.cwd()) else args.plot
    )
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
