"""Engine throughput with KV-cache events on and off (service/kv_events.py).

Two engines on the same model and settings, one publishing its events over ZeroMQ (a
bound PUB socket with a replay socket, as a pod serves llm-d's router), run the same
workload in turns: requests sharing a few system prompts, with a cache small enough
that blocks are evicted, so every step has blocks to announce. The figure is the ratio
of output tokens/s over alternating repetitions (on, off, on, off, ...): the best run
of each, the least disturbed on a shared machine, and the process's CPU seconds per
output token (every thread, the publisher's included), which other processes' load
barely moves. The engine thread's own cost of publishing (taking the step's records
and queueing them) and the publisher thread's (encoding and sending) are timed with
their threads' CPU clocks: their share of the process's CPU time is the events' cost,
a figure that other processes' load does not move.

    python benchmarks/kv_events.py --json benchmarks/results/kv_events.json
    python benchmarks/kv_events.py --model path/to/tiny --num-threads 1   # the worst case
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from pagedinfer.service import LLM, SamplingParams


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(300, 40000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(300, 40000) for _ in range(args.suffix_len)]
        for _ in range(args.requests)
    ]
    return prompts


def timed_publish(llm: LLM) -> list[float]:
    """Wrap the engine's publishing step to record its engine-thread CPU seconds."""
    engine, costs = llm.engine, []
    publish = engine._publish_kv_events

    def wrapper() -> None:
        start = time.thread_time()
        publish()
        costs.append(time.thread_time() - start)

    engine._publish_kv_events = wrapper
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=96)
    parser.add_argument("--suffix-len", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-gpu-blocks", type=int, default=160)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also save the summary here")
    args = parser.parse_args()

    settings = dict(
        max_model_len=512,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=256,
        num_threads=args.num_threads,
    )
    events = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    engines = {
        "off": LLM(args.model, **settings),
        "on": LLM(args.model, **settings, kv_events_config=events),
    }
    costs = timed_publish(engines["on"])
    prompts = workload(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engines["off"].generate(prompts[:4], params)  # warm both up
    engines["on"].generate(prompts[:4], params)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    on_cpu_seconds = 0.0  # the process's CPU time over the runs with events on
    cpu: dict[str, list[float]] = {"on": [], "off": []}  # CPU ms per output token
    for _ in range(args.repeats):
        for name in ("on", "off"):
            llm = engines[name]
            assert llm.engine.reset_prefix_cache()
            start, start_cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params)
            if name == "on":
                assert llm.engine.kv_events.flush()  # the publisher's work counts too
            seconds = time.perf_counter() - start
            cpu_seconds = time.process_time() - start_cpu
            if name == "on":
                on_cpu_seconds += cpu_seconds
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / seconds)
            cpu[name].append(1e3 * cpu_seconds / tokens)
    publisher = engines["on"].engine.kv_events
    publisher.flush()
    # Both threads' time over the measured runs: the warm-up's share is negligible.
    events_cpu = sum(costs) + publisher.thread_cpu_seconds
    stats = engines["on"].engine.stats()
    on, off = max(rates["on"]), max(rates["off"])
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    summary = {
        "benchmark": "kv_events",
        "cpu": cpu_name(),
        "model": Path(args.model).name if args.model else "embedded SmolLM2-135M-Instruct",
        "threads": args.num_threads,
        "requests": args.requests,
        "prompt_tokens": args.prefix_len + args.suffix_len,
        "output_tokens": args.max_tokens,
        "num_gpu_blocks": args.num_gpu_blocks,
        "repeats": args.repeats,
        "output_tokens_per_s_on": round(on, 2),
        "output_tokens_per_s_off": round(off, 2),
        "on_over_off": round(on / off, 4),
        "cpu_ms_per_output_token_on": round(cpu_on, 3),
        "cpu_ms_per_output_token_off": round(cpu_off, 3),
        "cpu_on_over_off": round(cpu_on / cpu_off, 4),
        "runs_on": [round(r, 2) for r in rates["on"]],
        "runs_off": [round(r, 2) for r in rates["off"]],
        "batches_published": publisher.published,
        "batches_dropped": publisher.dropped,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4),
        "engine_thread_publish_us_per_step": round(1e6 * statistics.mean(costs), 2),
        "publisher_thread_us_per_batch": round(
            1e6 * publisher.thread_cpu_seconds / max(publisher.published, 1), 2
        ),
        "events_share_of_cpu": round(events_cpu / on_cpu_seconds, 5),
    }
    for llm in engines.values():
        llm.engine.close()
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
