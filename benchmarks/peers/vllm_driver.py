"""Serve one workload with vLLM's offline `LLM` API; runs inside vLLM's own virtualenv.

benchmarks/peers/run_vllm.py starts it with that venv's Python and the CPU settings from
vLLM's docs in the environment. It reads a job (JSON) naming the model directory, dtype
and limits, the warm-up requests and the workload, all as token ids; serves the warm-up,
then the whole workload at once (greedy, EOS ignored, the given output lengths), and
writes the timings and what came out as JSON (no per-request latencies: the offline API
keeps none unless its stats logging is on, which is not its default):

    python vllm_driver.py JOB.json RESULT.json

It imports nothing from pagedinfer: the project's environment is not this one.
"""

from __future__ import annotations

import json
import sys
import time


def _requests(batch: dict) -> tuple[list[dict], list]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(p)} for p in batch["prompts"]]
    params = [
        SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        for n in batch["output_lens"]
    ]
    return prompts, params


def _serve(llm, batch: dict) -> tuple[float, list]:
    prompts, params = _requests(batch)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as handle:
        job = json.load(handle)
    import torch
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_num_seqs=job["max_num_seqs"],
        kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        enable_prefix_caching=job["enable_prefix_caching"],
        seed=0,
    )
    startup = time.perf_counter() - start
    warmup_seconds, _ = _serve(llm, job["warmup"])
    seconds, outputs = _serve(llm, job["workload"])
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "startup_seconds": round(startup, 2),
        "warmup_seconds": round(warmup_seconds, 2),
        "seconds": seconds,
        "output_token_ids": tokens,
        "prefix_cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_driver.py JOB.json RESULT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
