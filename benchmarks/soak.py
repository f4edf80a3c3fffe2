"""A soak: one server under steady load for minutes, with the memory and the KV cache
sampled throughout; prints one JSON.

The load is what a server meets in a day: real chat prompts (benchmarks/workloads/) at a
fixed concurrency, answers of random lengths, some streamed, some abandoned by their
client mid-stream, some refused as malformed. Every few seconds the server's resident
memory and its /metrics (free blocks, running and waiting requests) are sampled. At
the end the load stops and the server must drain to every block free.

Reported: requests by outcome, the resident memory of the first and last quarter and
its slope over the second half (MiB per minute; a leak shows as a steady climb), and
the blocks not free once idle (0 unless blocks leak). Exit status 1 when blocks leaked
or a request failed unexpectedly: those are bugs, not figures.

    .venv/bin/python benchmarks/soak.py --minutes 20 --concurrency 8 --json soak.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import serving
import startup
from workloads.chat import load_chat_prompts

SAMPLE_EVERY_S = 5.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=20.0, help="how long the load runs")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="the longest answer asked for")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--model", default=None, help="the server's model (default: embedded)")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--minutes, --concurrency and --max-tokens must be positive")

    with tempfile.TemporaryDirectory(prefix="soak-") as directory:
        server = serving.start_server(args, Path(directory) / "server.log")
        try:
            serving.wait_ready(server)
            result = soak(server, args)
        finally:
            serving.stop_server(server)
    result["machine"] = {**startup.machine(), "threads": args.threads}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["blocks_leaked"] == 0 and result["requests"]["failed"] == 0 else 1


def soak(server: serving.Server, args: argparse.Namespace) -> dict:
    model = serving.served_model(server.url)
    prompts = load_chat_prompts()
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                outcome = one_request(server.url, model, rng, prompts, args.max_tokens)
            except Exception as exc:  # every failure is counted and shown
                outcome = "failed"
                with lock:
                    failures.append(repr(exc)[:300])
            with lock:
                outcomes[outcome] += 1

    workers = [threading.Thread(target=client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.concurrency)]  # fmt: skip
    started = time.monotonic()
    for worker in workers:
        worker.start()
    samples = []
    while (elapsed := time.monotonic() - started) < args.minutes * 60:
        samples.append({"t_s": round(elapsed, 1), "rss_mib": rss_mib(server.process.pid),
                        **scrape(server.url)})  # fmt: skip
        time.sleep(min(SAMPLE_EVERY_S, max(0.0, args.minutes * 60 - elapsed)))
    stop.set()
    for worker in workers:
        worker.join(timeout=300)
    idle = wait_idle(server.url)
    return summarise(samples, outcomes, failures, idle, time.monotonic() - started)


def one_request(url: str, model: str, rng: random.Random, prompts: list, max_tokens: int) -> str:
    """One request of the day's mix; returns its outcome."""
    prompt = rng.choice(prompts)
    body: dict = {"model": model, "messages": prompt["messages"],
                  "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.7])}  # fmt: skip
    kind = rng.choices(["whole", "stream", "abandoned", "malformed"], [4, 4, 1, 1])[0]
    if kind == "malformed":
        body["max_tokens"] = -1
    if kind in ("stream", "abandoned"):
        body["stream"] = True
    host = urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        if kind == "malformed":
            response.read()
            if response.status != 400:
                raise RuntimeError(f"a malformed request got {response.status}")
            return "refused"
        if response.status != 200:
            raise RuntimeError(f"{kind} request got {response.status}: {response.read()[:200]}")
        if kind == "abandoned":
            response.readline()  # the first event, then the client goes away
            conn.sock.shutdown(2)
            return "abandoned"
        data = response.read()
        if kind == "stream" and not data.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError("a stream ended without [DONE]")
        return kind
    finally:
        conn.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for process {pid}")


def scrape(url: str) -> dict[str, float]:
    """The server's block and request gauges from its /metrics."""
    with serving.urllib.request.urlopen(f"{url}/metrics", timeout=30) as page:
        text = page.read().decode()
    names = {"pagedinfer_kv_cache_blocks_free": "blocks_free",
             "pagedinfer_kv_cache_blocks_total": "blocks_total",
             "pagedinfer_requests_running": "running",
             "pagedinfer_requests_waiting": "waiting"}  # fmt: skip
    found = {}
    for name, key in names.items():
        match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        if match:
            found[key] = float(match.group(1))
    return found


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    """The gauges once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = scrape(url)
        idle = not gauges.get("running") and not gauges.get("waiting")
        if idle and gauges.get("blocks_free") == gauges.get("blocks_total"):
            return gauges
        if time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def summarise(samples: list[dict], outcomes: Counter, failures: list[str], idle: dict,
              seconds: float) -> dict:  # fmt: skip
    rss = [s["rss_mib"] for s in samples]
    quarter = max(1, len(rss) // 4)
    second_half = samples[len(samples) // 2 :]
    slope = 0.0
    if len(second_half) >= 2:
        times = [s["t_s"] / 60 for s in second_half]
        slope = statistics.linear_regression(times, [s["rss_mib"] for s in second_half]).slope
    return {
        "seconds": round(seconds, 1),
        "requests": {
            "total": sum(outcomes.values()),
            "failed": outcomes["failed"],
            **{k: v for k, v in sorted(outcomes.items()) if k != "failed"},
        },
        "first_failures": failures[:5],
        "rss_mib": {
            "first_quarter_mean": round(statistics.fmean(rss[:quarter]), 1),
            "last_quarter_mean": round(statistics.fmean(rss[-quarter:]), 1),
            "max": max(rss),
            "second_half_slope_per_min": round(slope, 2),
        },
        "blocks_total": idle.get("blocks_total"),
        "blocks_leaked": int(idle.get("blocks_total", 0) - idle.get("blocks_free", 0)),
        "samples": samples,
    }


if __name__ == "__main__":
    raise SystemExit(main())
