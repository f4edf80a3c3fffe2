"""Serving over the OpenAI-compatible HTTP API, side by side with the offline API.

Drives a pagedinfer server over HTTP, every response streamed as server-sent events,
with throughput.py's workloads (fixed output lengths, EOS ignored): `mixed`, its random
token ids with lognormal lengths and a fixed seed, sent to `POST /v1/completions`; or
`chat`, real chat prompts (benchmarks/workloads/) sent as messages to
`POST /v1/chat/completions`. All requests at once, and a sweep of concurrency levels (at
most C requests in flight; the next is sent as one finishes). Each level reports output
tokens/s, time to first token, inter-token latency (the gaps between streamed chunks)
and time per output token, as percentiles. In the same run the offline API
(`pagedinfer.service.LLM`) serves the same work with the same engine settings and at
most C sequences running, and the HTTP/offline ratio of output tokens/s is reported:
serving at 32 streams should reach at least 0.9 of the offline rate
(docs/architecture.md section 11).

No run finds an earlier one's prompts in the server's prefix cache: each mixed run gets
prompts of its own (the workload's lengths, fresh random tokens), each chat run a
`cache_salt` of its own. A server started here is measured once its CPU executor serves
(it compiles in the background while the torch forward serves); warm a server given by
--url yourself.

With --structured, the ratio's level also runs with every request constrained by a JSON
schema (`STRUCTURED_SCHEMA`, through `structured_outputs`), taking turns with the free
runs, and the constrained/free ratio of output tokens/s is reported (target: 0.9), with
the schema's compile time (first and cached) on the model's tokenizer.

    python benchmarks/serving.py --json          # starts a server on 127.0.0.1 itself
    python benchmarks/serving.py --json --workload chat
    python benchmarks/serving.py --url http://127.0.0.1:8000 --no-offline

Prints one JSON object and saves a PNG plot.
"""

from __future__ import annotations

# First, before torch loads: the engine's OpenMP settings (`pagedinfer.service.openmp`).
import os  # isort: skip

from pagedinfer.service.openmp import spin_env  # isort: skip

os.environ.update(spin_env())
import argparse
import asyncio
import dataclasses
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import throughput
from throughput import Workload

from pagedinfer.service.config import EngineConfig

STARTUP_TIMEOUT_S = 600  # a first start converts the embedded model
# What the server logs once its CPU executor serves every step, or where it never will.
EXECUTOR_SERVING = "CPU executor: kernels ready"
EXECUTOR_NOT_SERVING = ("CPU executor: not used", "CPU executor: warm-up failed")
DEFAULT_LEVELS = "1,4,16,32"
RATIO_TARGET = 0.9
# --structured's requests: records in an array too long to end within the context, so
# that every token of a fixed-length output is JSON sampled under the grammar (not an
# end-of-text the grammar allows alone once it is complete).
STRUCTURED_SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "year": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "city", "year", "tags"],
        "additionalProperties": False,
    },
}


@dataclass
class StreamResult:
    """One streamed completion as the client saw it (times in seconds from its send)."""

    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between chunks after the first
    error: str | None = None


def fresh_tokens(wl: Workload, vocab: int, seed: int) -> Workload:
    """The same lengths with new random tokens (ordinary vocabulary ids, as the workload's)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(300, vocab, size=len(p)).tolist() for p in wl.prompts]
    return Workload(prompts, list(wl.output_lens))


def model_dir(model: str | None) -> Path:
    """The Hugging Face directory of the model the server runs (config and tokenizer)."""
    from pagedinfer.service.loader import ensure_converted_gguf, ensure_default_model

    path = Path(model) if model else ensure_default_model()
    return ensure_converted_gguf(path) if path.suffix == ".gguf" else path


def chat_requests(directory: Path, args: argparse.Namespace) -> tuple[Workload, list]:
    """The chat workload's first --num-requests prompts: their messages, as sent to
    /v1/chat/completions, and their token ids under the model's chat template, as the
    offline API gets them (and as the server's usage must count them)."""
    from transformers import AutoTokenizer
    from workloads.chat import CHAT_PROMPTS, chat_workload, load_chat_prompts

    path = args.chat_prompts or CHAT_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(directory)
    wl = Workload(*chat_workload(tokenizer, args.num_requests, args.max_model_len, path))
    messages = [p["messages"] for p in load_chat_prompts(path)[: args.num_requests]]
    return wl, messages


# --- the server -------------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log: Path) -> Server:
    """`pagedinfer serve` on 127.0.0.1 with this run's engine settings; returns at once."""
    http_port = free_port()
    command = [
        sys.executable, "-m", "pagedinfer.service.cli", "serve", "--host", "127.0.0.1",
        "--http-port", str(http_port), "--port", str(free_port()),
        "--metrics-port", str(free_port()), *engine_flags(args),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.pop("PAGEDINFER_AUTH_TOKEN", None)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(process, f"http://127.0.0.1:{http_port}", log)


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
        "--num-speculative-tokens", str(args.num_speculative_tokens),
        "--num-threads", str(args.threads), "--device", args.device,
    ]  # fmt: skip
    if args.model:
        flags += ["--model", args.model]
    return flags


def wait_ready(server: Server, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Until GET /health answers 200 (503 while the model loads)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"the server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready in {timeout} s:\n{server.log_tail()}")
        time.sleep(0.5)


def stop_server(server: Server, timeout: float = 60) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def wait_for_cpu_executor(server: Server, url: str, model: str, timeout: float) -> str:
    """Until the server's CPU executor serves, or its log says it will not.

    The server compiles the CPU kernels in the background while the model's torch
    forward serves, and the executor takes over at the first step after they are ready:
    small requests keep steps coming until the log reports which of the two serves.
    """
    deadline = time.monotonic() + timeout
    probe = Workload([[300, 301, 302, 303]], [2])
    while True:
        log = server.log.read_text(errors="replace")
        if EXECUTOR_SERVING in log:
            return "serving"
        for marker in EXECUTOR_NOT_SERVING:
            if marker in log:
                return marker
        if time.monotonic() > deadline:
            return f"not reported within {timeout:.0f} s"
        run_http(url, model, Run(probe), 1)
        time.sleep(0.5)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


# --- the HTTP client --------------------------------------------------------------------


@dataclass
class Run:
    """One run's requests: the workload's token ids and output lengths, and for the chat
    workload the messages that render to those ids (sent to /v1/chat/completions)."""

    wl: Workload
    messages: list[list[dict]] | None = None
    cache_salt: str | None = None  # keeps the server's prefix cache to this run's requests
    structured: dict | None = None  # a JSON schema every request's output must match

    def payload(self, model: str, i: int) -> tuple[str, dict]:
        """The request for the i-th prompt: exactly its output length, greedy, EOS ignored,
        streamed with usage."""
        body: dict = {
            "model": model,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.structured is not None:
            body["structured_outputs"] = {"json": self.structured}
        if self.messages is None:
            body.update(prompt=self.wl.prompts[i], max_tokens=self.wl.output_lens[i])
            return "/v1/completions", body
        body.update(messages=self.messages[i], max_completion_tokens=self.wl.output_lens[i])
        return "/v1/chat/completions", body


def carries_text(chunk: dict) -> bool:
    """Whether a streamed chunk brings output text (a completion's `text`, a chat delta's
    `content`); the chat stream's first chunk carries only the role."""
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def stream_request(
    session: aiohttp.ClientSession, url: str, path: str, body: dict, prompt_tokens: int
) -> StreamResult:
    """One streamed request, checked against the work it was meant to do: its usage must
    count the prompt's tokens and the output length asked for."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    result = StreamResult()
    start = time.perf_counter()
    last = start
    usage = None
    try:
        async with session.post(f"{url}{path}", json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {text}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    return result
                now = time.perf_counter()
                if carries_text(chunk):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if usage is None:
        result.error = "the stream carried no usage (stream_options.include_usage)"
    elif usage["completion_tokens"] != max_tokens:
        result.error = f"{usage['completion_tokens']} tokens streamed, {max_tokens} asked for"
    elif usage["prompt_tokens"] != prompt_tokens:
        result.error = f"a prompt of {usage['prompt_tokens']} tokens, {prompt_tokens} expected"
    else:
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
    return result


async def serve_run(
    url: str, model: str, run: Run, concurrency: int
) -> tuple[list[StreamResult], float]:
    """Every request of the run, in order, with at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)

    async def one(session, i):
        path, body = run.payload(model, i)
        async with gate:
            return await stream_request(session, url, path, body, len(run.wl.prompts[i]))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session, i) for i in range(len(run.wl.prompts))))
        elapsed = time.perf_counter() - start
    return list(results), elapsed


def stats(label: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{label}_mean_s": round(statistics.fmean(values), 6),
        **{f"{label}_p{q}_s": round(throughput.percentile(values, q), 6) for q in (50, 90, 99)},
    }


def summarise_http(
    concurrency: int, wl: Workload, results: list[StreamResult], elapsed: float
) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    summary = {
        "concurrency": concurrency,
        "requests": len(results),
        "successful": len(ok),
        "errors": len(errors),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(output / elapsed, 2),
        "total_tokens_per_s": round((prompt + output) / elapsed, 2),
        "requests_per_s": round(len(ok) / elapsed, 3),
    }
    if errors:
        summary["first_error"] = errors[0]
    summary.update(stats("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(stats("itl", [g for r in ok for g in r.gaps]))
    summary.update(
        stats(
            "tpot",
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.ttft is not None and r.output_tokens > 1
            ],
        )
    )
    summary.update(stats("e2e", [r.latency for r in ok]))
    summary["expected_output_tokens"] = wl.output_tokens
    return summary


def run_http(url: str, model: str, run: Run, concurrency: int) -> dict:
    results, elapsed = asyncio.run(serve_run(url, model, run, concurrency))
    return summarise_http(concurrency, run.wl, results, elapsed)


def grammar_compile_ms(directory: Path) -> dict[str, float]:
    """What STRUCTURED_SCHEMA costs to compile on the model's tokenizer, as the engine
    compiles it: the grammar engine's view of the tokenizer (once per server), the
    schema's first compile and a repeated one (cached per schema)."""
    from pagedinfer.service.structured_output import GrammarCompiler, StructuredOutput
    from pagedinfer.service.tokenizer import load_tokenizer

    config = json.loads((directory / "config.json").read_text())
    eos = config.get("eos_token_id")
    compiler = GrammarCompiler(
        load_tokenizer(directory), config["vocab_size"], eos if isinstance(eos, list) else [eos]
    )
    schema = StructuredOutput.json_schema(STRUCTURED_SCHEMA)

    def ms(step: Callable[[], object]) -> float:
        start = time.perf_counter()
        step()
        return round((time.perf_counter() - start) * 1e3, 3)

    return {
        "tokenizer": ms(compiler.ll_tokenizer),
        "schema_first": ms(lambda: compiler.check(schema)),
        "schema_cached": ms(lambda: compiler.check(schema)),
    }


# --- the offline API --------------------------------------------------------------------


def offline_config(args: argparse.Namespace, max_num_seqs: int) -> EngineConfig:
    """The server's engine settings, with at most `max_num_seqs` running: what a client
    that keeps that many requests in flight lets the server's engine run."""
    return EngineConfig(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        num_speculative_tokens=args.num_speculative_tokens,
        num_threads=args.threads,
        device=args.device,
    )


def run_offline(llm, wl: Workload) -> dict:
    """`LLM.generate` over the whole workload in one call, as a batch job would."""
    from pagedinfer.service import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in wl.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(wl.prompts, params)
    elapsed = time.perf_counter() - start
    output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "requests": len(outputs),
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": output,
        "expected_output_tokens": wl.output_tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(output / elapsed, 2),
        "total_tokens_per_s": round((wl.prompt_tokens + output) / elapsed, 2),
    }


# --- the run ----------------------------------------------------------------------------


def concurrency_levels(spec: str, num_requests: int) -> list[int]:
    """The sweep's levels up to the workload's size, then all requests at once."""
    try:
        levels = sorted({int(s) for s in spec.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {spec!r}") from None
    if not levels or levels[0] < 1:
        raise ValueError(f"--concurrency levels must be at least 1, got {spec!r}")
    return [c for c in levels if c < num_requests] + [num_requests]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    levels = sorted(results["http"].values(), key=lambda r: r["concurrency"])
    xs = [r["concurrency"] for r in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(xs, [r["output_tokens_per_s"] for r in levels], "o-", label="HTTP streaming")
    if "offline" in results:
        offline = results["offline"]
        ax1.axhline(
            offline["output_tokens_per_s"],
            color="tab:gray",
            linestyle="--",
            label=f"offline LLM, at most {offline['max_num_seqs']} running",
        )
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("output tokens/s")
    server = results["server"]
    ax1.set_title(f"{results['workload']['name'].capitalize()} workload over {server['endpoint']}")
    ax1.legend()
    for key, style in (("ttft", "o-"), ("itl", "s-")):
        for q, alpha in (("p50", 1.0), ("p99", 0.5)):
            values = [r.get(f"{key}_{q}_s") for r in levels]
            if all(v is not None for v in values):
                ax2.plot(xs, values, style, alpha=alpha, label=f"{key.upper()} {q}")
    ax2.set_yscale("log")
    ax2.set_ylabel("seconds")
    ax2.set_title("Latency percentiles")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("concurrent streams")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    throughput.add_workload_args(ap)
    d = EngineConfig()
    ap.add_argument(
        "--workload",
        choices=("mixed", "chat"),
        default="mixed",
        help="mixed: random token ids to /v1/completions (--prompt-mean, --output-mean, "
        "--seed); chat: real chat prompts to /v1/chat/completions (benchmarks/workloads/)",
    )
    ap.add_argument("--chat-prompts", type=Path, default=None, help="the chat workload's JSON")
    ap.add_argument("--url", default=None, help="a running server; default: start one here")
    ap.add_argument("--model", default=None, help="the server's model (default: embedded)")
    ap.add_argument(
        "--concurrency",
        default=DEFAULT_LEVELS,
        help="the sweep's levels (comma-separated); all requests at once is always run",
    )
    ap.add_argument(
        "--ratio-concurrency",
        type=int,
        default=32,
        help="streams at which HTTP is compared with the offline API (capped at the workload)",
    )
    ap.add_argument("--no-offline", action="store_true", help="skip the offline API's run")
    ap.add_argument(
        "--structured",
        action="store_true",
        help="also run the ratio's level with JSON-schema-constrained requests, taking turns "
        "with the free runs, and report the constrained/free ratio",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run offline and HTTP at the ratio's level this many times, taking turns; "
        "each reports its fastest",
    )
    # Engine settings of the server started here and of the offline run (throughput.py's).
    ap.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", help="of the server started here and offline")
    ap.add_argument(
        "--executor-timeout",
        type=float,
        default=600,
        help="seconds to wait for the CPU executor of the server started here",
    )
    ap.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "serving.png")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    try:
        levels = concurrency_levels(args.concurrency, args.num_requests)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.ratio_concurrency < 1:
        ap.error(f"--ratio-concurrency must be at least 1, got {args.ratio_concurrency}")
    ratio_level = min(args.ratio_concurrency, args.num_requests)
    if ratio_level not in levels:
        levels = sorted({*levels, ratio_level})

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    load_at_start = os.getloadavg()[0]
    server = None
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as scratch:
        if args.url is None:
            # Starts loading while this process builds its own engine.
            server = start_server(args, Path(scratch) / "server.log")
        try:
            return _run(args, levels, ratio_level, server, load_at_start, say)
        except ValueError as exc:  # a workload that cannot run with these settings
            ap.error(str(exc))
        finally:
            if server is not None:
                stop_server(server)


def _run(args, levels, ratio_level, server, load_at_start, say) -> int:
    directory = model_dir(args.model)
    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    seeds = iter(range(args.seed + 1000, args.seed + 100000))
    if args.workload == "chat":
        wl, messages = chat_requests(directory, args)

        def new_run() -> Run:
            # Real prompts cannot be made afresh: a salt of its own keeps each run's
            # prompts out of the other runs' prefix-cache entries.
            return Run(wl, messages, cache_salt=f"serving-{next(seeds)}")

    else:
        wl = throughput.workload_from_args(args, vocab)

        def new_run() -> Run:
            return Run(fresh_tokens(wl, vocab, next(seeds)))

    warm = throughput.mixed_workload(
        4, vocab, args.seed + 1, args.prompt_mean, 8, args.max_model_len
    )
    llm = None
    offline_seqs = min(args.max_num_seqs, ratio_level)

    def new_llm():
        from pagedinfer.service import LLM

        say("building the offline engine ...")
        engine = LLM(**offline_config(args, offline_seqs).__dict__)
        # It first serves a few other requests, as the server has.
        run_offline(engine, fresh_tokens(warm, vocab, next(seeds)))
        return engine

    if not args.no_offline:
        llm = new_llm()
    url = args.url.rstrip("/") if args.url else server.url
    if server is not None:
        say("waiting for the server ...")
        wait_ready(server)
    model = served_model(url)
    executor = "unknown: the server's log is not this run's"
    if server is not None and args.device == "cpu":
        say("waiting for the server's CPU executor ...")
        executor = wait_for_cpu_executor(server, url, model, args.executor_timeout)
    say(
        f"{args.workload} workload: {len(wl.prompts)} requests, {wl.prompt_tokens} prompt + "
        f"{wl.output_tokens} output tokens; levels {levels}; model {model}"
    )
    warmup = run_http(url, model, Run(fresh_tokens(warm, vocab, next(seeds))), len(warm.prompts))
    if warmup["errors"]:
        raise RuntimeError(f"the warm-up requests failed: {warmup['first_error']}")

    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            # Other processes' load: these machines are shared; the ratio, measured side
            # by side, is fairer than the absolute figures when it is not zero.
            "load_average_at_start": round(load_at_start, 2),
        },
        "workload": {
            "name": args.workload,
            "requests": len(wl.prompts),
            "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens,
            "max_model_len": args.max_model_len,
            **(
                {
                    "prompt_mean": args.prompt_mean,
                    "output_mean": args.output_mean,
                    "seed": args.seed,
                }
                if args.workload == "mixed"
                else {}
            ),
        },
        "server": {
            "started_here": server is not None,
            "cpu_executor": executor,
            "model": model,
            "endpoint": "/v1/chat/completions" if args.workload == "chat" else "/v1/completions",
            "stream": True,
        },
        "http": {},
    }
    if server is not None or llm is not None:
        # Of the server started here and of the offline run; --url's server has its own.
        results["engine"] = {
            "kv_cache_memory": args.kv_cache_memory,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "num_speculative_tokens": args.num_speculative_tokens,
            "threads": args.threads,
        }
    # The ratio's pair first, side by side; then the rest of the sweep.
    offline_runs, ratio_runs, structured_runs = [], [], []
    for round_ in range(args.repeats):
        if llm is not None:
            if round_ and args.workload == "chat":
                llm = new_llm()  # its prefix cache holds the workload's prompts by now
            say(f"offline, at most {offline_seqs} running (run {round_ + 1}) ...")
            offline = run_offline(llm, new_run().wl)
            offline["max_num_seqs"] = offline_seqs
            say(json.dumps(offline))
            offline_runs.append(offline)
        say(f"HTTP at {ratio_level} streams (run {round_ + 1}) ...")
        ratio_runs.append(run_http(url, model, new_run(), ratio_level))
        say(json.dumps(ratio_runs[-1]))
        if args.structured:
            say(f"HTTP at {ratio_level} JSON-schema-constrained streams (run {round_ + 1}) ...")
            constrained = dataclasses.replace(new_run(), structured=STRUCTURED_SCHEMA)
            structured_runs.append(run_http(url, model, constrained, ratio_level))
            say(json.dumps(structured_runs[-1]))
    results["http"][str(ratio_level)] = max(ratio_runs, key=lambda r: r["output_tokens_per_s"])
    for level in levels:
        if level == ratio_level:
            continue
        say(f"HTTP at {level} streams ...")
        results["http"][str(level)] = run_http(url, model, new_run(), level)
        say(json.dumps(results["http"][str(level)]))
    results["http"] = {str(c): results["http"][str(c)] for c in levels}
    results["http"][str(ratio_level)]["runs_output_tokens_per_s"] = [
        r["output_tokens_per_s"] for r in ratio_runs
    ]
    errors = sum(r["errors"] for r in results["http"].values())
    if structured_runs:
        best = max(structured_runs, key=lambda r: r["output_tokens_per_s"])
        best["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in structured_runs]
        free = results["http"][str(ratio_level)]["output_tokens_per_s"]
        ratio = round(best["output_tokens_per_s"] / free, 3)
        results["structured"] = {
            "schema": STRUCTURED_SCHEMA,
            "compile_ms": grammar_compile_ms(directory),
            "http": best,
            "constrained_vs_free_output_tokens_per_s": ratio,
            "target": RATIO_TARGET,
            "meets_target": ratio >= RATIO_TARGET,
        }
        errors += sum(r["errors"] for r in structured_runs)
    if offline_runs:
        best = max(offline_runs, key=lambda r: r["output_tokens_per_s"])
        best["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in offline_runs]
        results["offline"] = best
        http = results["http"][str(ratio_level)]
        ratio = round(http["output_tokens_per_s"] / best["output_tokens_per_s"], 3)
        results["ratio"] = {
            "concurrency": ratio_level,
            "http_vs_offline_output_tokens_per_s": ratio,
            "target": RATIO_TARGET,
            "meets_target": ratio >= RATIO_TARGET,
        }
        if best["output_tokens"] != best["expected_output_tokens"]:
            errors += 1
    results["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    plot(results, args.plot)
    # Relative to the working directory when possible: no machine paths in saved results.
    plot_path = args.plot.resolve()
    results["plot"] = str(
        plot_path.relative_to(Path.cwd()) if plot_path.is_relative_to(Path.cwd()) else args.plot
    )
    print(json.dumps(results, indent=None if args.json else 2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
