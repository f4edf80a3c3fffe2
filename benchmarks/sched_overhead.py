"""Scheduler + block manager CPU time as a share of the step time, at 256 running sequences.

The real `Scheduler` (and its `KVCacheManager`) runs a steady decode load: 256 running
requests, each finished one replaced by a new waiting one, so every step schedules 256
decodes plus the admissions, allocates blocks as sequences cross block boundaries, and
frees finished requests. A stand-in model answers each step with fixed token ids, so
the CPU time measured (`time.process_time`, insensitive to other processes' load) is
the scheduler's and the block manager's alone. The step time it is compared with is a
real forward pass of the model on the scheduler's own output for 256 running sequences
(`ModelRunner.execute`, the embedded default model, fp32).

    python benchmarks/sched_overhead.py --json
    python benchmarks/sched_overhead.py --no-model    # scheduler timings only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler, SchedulerOutput


class SteadyLoad:
    """A scheduler kept at `running` sequences: every finished request is replaced."""

    def __init__(self, config: EngineConfig, num_blocks: int, args: argparse.Namespace):
        self.scheduler = Scheduler(config, num_blocks)
        self.rng = np.random.default_rng(args.seed)
        self.args = args
        self.count = 0
        for _ in range(args.running):
            self.add()

    def add(self) -> None:
        a = self.args
        prompt = self.rng.integers(300, 40000, size=a.prompt_len).tolist()
        max_tokens = int(self.rng.integers(a.min_output, a.max_output + 1))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add_request(Request(f"r{self.count}", prompt, params))
        self.count += 1

    def step(self, out: SchedulerOutput) -> None:
        """What the engine does after the model: one token per request that sampled,
        after the whole draft where it had one (the most bookkeeping a step can need),
        then it ends the requests that reached max_tokens."""
        sampled = {
            s.request.request_id: [*s.draft_token_ids, 1000]
            for s in out.scheduled
            if s.request.num_computed_tokens + s.num_tokens - len(s.draft_token_ids)
            == s.request.num_tokens
        }
        self.scheduler.update_from_output(out, sampled)
        for s in out.scheduled:
            request = s.request
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    def refill(self) -> None:
        while len(self.scheduler.requests) < self.args.running:
            self.add()


def measure_scheduler(load: SteadyLoad, steps: int) -> tuple[list[float], list[int]]:
    """CPU seconds per step of schedule + update_from_output, and the sequences per step."""
    times, sizes = [], []
    for _ in range(steps):
        load.refill()  # the engine's add_request: not scheduler time
        t = time.process_time()
        out = load.scheduler.schedule()
        load.step(out)
        times.append(time.process_time() - t)
        sizes.append(len(out.scheduled))
    return times, sizes


def measure_forward(load: SteadyLoad, runner, repeats: int) -> float:
    """Median wall seconds of one real forward pass on the scheduler's current output."""
    load.refill()
    out = load.scheduler.schedule()
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - t)
    load.step(out)
    return statistics.median(times[1:])  # the first call warms buffers up


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="scheduler steps measured")
    ap.add_argument("--forward-repeats", type=int, default=3)
    ap.add_argument("--no-model", action="store_true", help="skip the real forward pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="n-gram drafts per decode (the stand-in model keeps every draft token)",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)

    config = EngineConfig(
        max_num_seqs=args.running,
        max_num_batched_tokens=max(2048, args.running),
        max_model_len=args.prompt_len + args.max_output + 16,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    blocks_per_seq = config.max_blocks_per_seq
    num_blocks = args.running * blocks_per_seq + 16  # no preemption: the steady state
    runner = None
    if not args.no_model:
        from pagedinfer.service.loader import load_model
        from pagedinfer.service.model_runner import ModelRunner

        config.num_gpu_blocks = num_blocks
        device = torch.device("cpu")
        loaded = load_model(None, device, torch.float32, max_model_len=config.max_model_len)
        runner = ModelRunner(config, loaded, device)

    load = SteadyLoad(config, num_blocks, args)
    # Prefill everything first (large steps), then measure the decode steady state.
    while any(r.num_output_tokens == 0 for r in load.scheduler.requests.values()):
        load.step(load.scheduler.schedule())
    measure_scheduler(load, 20)  # warm-up
    times, sizes = measure_scheduler(load, args.steps)
    sched_s = statistics.median(times)
    result = {
        "running": args.running,
        "steps": args.steps,
        "mean_seqs_per_step": round(statistics.fmean(sizes), 1),
        "sched_cpu_ms_per_step_p50": round(sched_s * 1e3, 3),
        "sched_cpu_ms_per_step_p99": round(float(np.percentile(times, 99)) * 1e3, 3),
        "threads": torch.get_num_threads(),
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if runner is not None:
        forward_s = measure_forward(load, runner, args.forward_repeats)
        result["forward_ms_per_step"] = round(forward_s * 1e3, 1)
        result["sched_share_of_step_pct"] = round(100 * sched_s / (sched_s + forward_s), 2)
        result["target_pct"] = 5.0
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
