"""`pagedinfer simulate`: replay a request trace through the real scheduler, no model.

A stand-in model emits a predetermined token for every request that samples, so each
policy does exactly the same work. The run is repeated under the `paged` and the
`contiguous` allocation policy with one fixed KV budget, and reports per policy:

- kv_waste_pct: time-averaged share of allocated (or reserved) KV slots holding no
  token, summed over the running requests at the end of every step;
- mean_running / peak_running: requests holding KV at the end of a step;
- steps: scheduler steps until the whole trace has finished;
- preemptions: requests sent back to the queue for lack of blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler

POLICIES = ("paged", "contiguous")
VOCAB_SIZE = 32000
DEFAULT_PLOT = "benchmarks/results/fragmentation.png"


@dataclass
class TraceRequest:
    arrival_step: int
    prompt_token_ids: list[int]
    num_output_tokens: int


def make_trace(
    num_requests: int,
    seed: int = 0,
    max_model_len: int = 2048,
    arrival_rate: float = 2.0,
    mean_prompt: float = 161.0,
    mean_output: float = 338.0,
    sigma: float = 1.0,
) -> list[TraceRequest]:
    """ShareGPT-like lengths (lognormal with the given means), Poisson arrivals of
    arrival_rate requests per step, prompt + output clipped to max_model_len."""
    rng = random.Random(seed)

    def lognormal(mean: float) -> float:
        return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)

    trace, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(arrival_rate)
        prompt_len = min(max(round(lognormal(mean_prompt)), 1), max_model_len - 1)
        output_len = min(max(round(lognormal(mean_output)), 1), max_model_len - prompt_len)
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]
        trace.append(TraceRequest(int(t), prompt, output_len))
    return trace


@dataclass
class PolicyResult:
    policy: str
    steps: int = 0
    preemptions: int = 0
    empty_slot_steps: int = 0
    slot_steps: int = 0
    running: list[int] = field(default_factory=list)  # per step
    waste_pct: list[float] = field(default_factory=list)  # per step

    def summary(self) -> dict[str, float | int]:
        return {
            "kv_waste_pct": round(100.0 * self.empty_slot_steps / max(self.slot_steps, 1), 2),
            "mean_running": round(sum(self.running) / max(len(self.running), 1), 2),
            "peak_running": max(self.running, default=0),
            "steps": self.steps,
            "preemptions": self.preemptions,
        }


def simulate(trace: list[TraceRequest], config: EngineConfig, num_blocks: int) -> PolicyResult:
    """Run the trace to completion under config's allocation policy."""
    scheduler = Scheduler(config, num_blocks)
    result = PolicyResult(config.allocation_policy)
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_step, reverse=True)
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and trace[pending[-1]].arrival_step <= step:
            i = pending.pop()
            params = SamplingParams(max_tokens=trace[i].num_output_tokens, ignore_eos=True)
            request = Request(str(i), trace[i].prompt_token_ids, params, step)
            scheduler.check_fits(request)
            scheduler.add_request(request)
        output = scheduler.schedule()
        # The stand-in model: a fixed token per (request, position) for every sampler.
        sampled = {
            s.request.request_id: (7919 * int(s.request.request_id) + s.request.num_tokens)
            % VOCAB_SIZE
            for s in output.scheduled
            if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens
        }
        scheduler.update_from_output(output, sampled)
        for s in output.scheduled:  # as the engine does: every output runs to max_tokens
            if s.request.num_output_tokens >= s.request.sampling_params.max_tokens:
                scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_LENGTH)

        filled = sum(r.num_computed_tokens for r in scheduler.running)
        slots = sum(len(r.block_table) for r in scheduler.running) * config.block_size
        result.empty_slot_steps += slots - filled
        result.slot_steps += slots
        result.running.append(scheduler.num_running)
        result.waste_pct.append(100.0 * (slots - filled) / slots if slots else 0.0)
        step += 1
    result.steps = step
    result.preemptions = scheduler.num_preemptions
    return result


def plot(results: dict[str, PolicyResult], path: str | Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pagedinfer[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_waste, ax_running) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for policy, result in results.items():
        summary = result.summary()
        ax_waste.plot(result.waste_pct, lw=0.8, label=f"{policy} ({summary['kv_waste_pct']}%)")
        ax_running.plot(result.running, lw=0.8, label=f"{policy} (mean {summary['mean_running']})")
    ax_waste.set_ylabel("KV waste (% of allocated slots)")
    ax_waste.set_ylim(0, 100)
    ax_running.set_ylabel("running requests")
    ax_running.set_xlabel("scheduler step")
    for ax in (ax_waste, ax_running):
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle("Same trace, same KV budget: paged vs contiguous allocation")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="requests per step")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV budget in blocks (default: room for 12 contiguous requests)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path ('' for none)")


def run_benchmark(args: argparse.Namespace) -> dict:
    """Both policies on one trace; returns the JSON summary and writes the plot."""
    if args.num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {args.num_requests}")
    if not args.arrival_rate > 0:
        raise ValueError(f"arrival_rate must be positive, got {args.arrival_rate}")
    configs = {
        policy: EngineConfig(
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            allocation_policy=policy,
        )
        for policy in POLICIES
    }
    per_request = configs["paged"].max_blocks_per_seq
    num_blocks = 12 * per_request if args.num_blocks is None else args.num_blocks
    if num_blocks < per_request:
        raise ValueError(
            f"num_blocks ({num_blocks}) must hold one request of max_model_len "
            f"{args.max_model_len} ({per_request} blocks)"
        )
    trace = make_trace(args.num_requests, args.seed, args.max_model_len, args.arrival_rate)
    results = {policy: simulate(trace, config, num_blocks) for policy, config in configs.items()}
    summary: dict = {policy: result.summary() for policy, result in results.items()}
    paged, contiguous = summary["paged"], summary["contiguous"]
    summary["comparison"] = {
        "mean_running_ratio": round(
            paged["mean_running"] / max(contiguous["mean_running"], 1e-9), 2
        ),
        "steps_ratio": round(paged["steps"] / contiguous["steps"], 3),
    }
    summary["setup"] = {
        "num_requests": len(trace),
        "seed": args.seed,
        "mean_prompt_tokens": round(sum(len(r.prompt_token_ids) for r in trace) / len(trace), 1),
        "mean_output_tokens": round(sum(r.num_output_tokens for r in trace) / len(trace), 1),
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "num_blocks": num_blocks,
        "kv_slots": num_blocks * args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "arrival_rate_per_step": args.arrival_rate,
    }
    if args.plot:
        plot(results, args.plot)
        summary["setup"]["plot"] = str(args.plot)
    return summary


def run(args: argparse.Namespace) -> int:
    summary = run_benchmark(args)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{'policy':<12}{'waste %':>9}{'mean run':>10}{'peak run':>10}{'steps':>8}{'preempt':>9}")
    for policy in POLICIES:
        s = summary[policy]
        print(
            f"{policy:<12}{s['kv_waste_pct']:>9}{s['mean_running']:>10}{s['peak_running']:>10}"
            f"{s['steps']:>8}{s['preemptions']:>9}"
        )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fragmentation", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
