"""One request alone, the single-user case llama.cpp is built for: pagedinfer's decode rate
against llama.cpp's own `llama-bench` (tg128) on the same weights and threads.

One real chat prompt (`workloads/chat_prompts.json`, under the model's chat template)
with a fixed number of output tokens, greedy, EOS ignored, served by pagedinfer's offline
engine alone: after one warm-up, `--repeats` timed runs, each figure their median. The
decode rate is the output tokens after the first over the time after the first; the
end-to-end rate all output tokens over the whole request, prompt included. llama.cpp's
`llama-bench -p 0 -n N -r R` decodes N tokens from an empty context on the same file
(its `avg_ts`), and its `llama-server` serves the same request (`--no-server` skips it).

Pairs (`--pairs`): `embedded` (the embedded model against its Q4_1 file); each file
`peers/make_gguf_files.sh` makes (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0), served by both from
the file itself; the same at a real size (`1b-Q4_K_M`, ...: each file
`peers/make_real_gguf_files.sh` makes from the Llama-3.2-1B-shaped checkpoint with
llama.cpp's own converter and quantiser); `noisy` (an ordinary fp32 checkpoint, `peers/noisy_checkpoint.py`,
against llama.cpp's F32 copy), `noisy-bf16` (that checkpoint stored in bf16, as most are
published, against the BF16 copy) and `bf16` (the same with `--dtype bfloat16`, on CPUs
with native bf16). `--model` and `--gguf` name one pair of your own
instead.

Each pair's weights are read once a decode step, so beside each rate stands the rate
at which it reads the file's tensor bytes (`file_gb_per_s`), and its share of the
machine's read bandwidth, measured at the start (`machine.read_gb_per_s`).

    python benchmarks/single_request.py --json > benchmarks/results/single_request_MACHINE.json
    python benchmarks/single_request.py --pairs embedded,noisy --profile embedded

A peer or file not set up is skipped, with the reason in the JSON.
"""

from __future__ import annotations

# First, before torch loads: the engine's OpenMP settings (`pagedinfer.service.openmp`).
import os  # isort: skip

from pagedinfer.service.openmp import spin_env  # isort: skip

os.environ.update(spin_env())
import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from peers import run_llamacpp
from peers.paths import shown
from throughput import matmul_gflops, read_bandwidth, resolve_model
from workloads.chat import CHAT_PROMPTS, load_chat_prompts, render

from pagedinfer.kernels import torch_ops
from pagedinfer.service.config import GGUF_ACTIVATIONS, EngineConfig
from pagedinfer.service.engine import LLMEngine
from pagedinfer.service.gguf_convert import read_header
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.threads import openmp_spin

HERE = Path(__file__).resolve().parent
DEFAULT_GGUF_DIR = HERE / "peers" / ".gguf"
# The files make_gguf_files.sh makes, each served by both engines.
MADE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")
# The real-size files make_real_gguf_files.sh makes (its default TYPES the first three),
# named after the shaped checkpoint they come from.
REAL_STEM = "llama-3.2-1b-shaped-bfloat16"
REAL_TYPES = ("Q4_K_M", "Q8_0", "Q4_0", "Q4_K_S", "Q5_K_M", "Q6_K", "IQ4_XS")
PAIRS = (
    "embedded",
    *MADE_TYPES,
    *(f"1b-{kind}" for kind in REAL_TYPES),
    "noisy",
    "noisy-bf16",
    "bf16",
)


@dataclass(frozen=True)
class Pair:
    """What each engine serves: pagedinfer's `--model` (throughput.py's terms) and the
    GGUF file llama.cpp gets (None: the model's own, where it is one)."""

    name: str
    model: str
    gguf: Path | None = None
    setup: str = "bash benchmarks/peers/make_gguf_files.sh"
    dtype: str = "float32"  # pagedinfer's --dtype


def default_pairs(gguf_dir: Path, stem: str) -> dict[str, Pair]:
    """The pairs by name: `stem` is the embedded file's name without its type."""
    pairs = {"embedded": Pair("embedded", "embedded")}
    for kind in MADE_TYPES:
        path = gguf_dir / f"{stem}.{kind}.gguf"
        pairs[kind] = Pair(kind, str(path), path)
    for kind in REAL_TYPES:
        path = gguf_dir / f"{REAL_STEM}.{kind}.gguf"
        setup = f"TYPES={kind} bash benchmarks/peers/make_real_gguf_files.sh"
        pairs[f"1b-{kind}"] = Pair(f"1b-{kind}", str(path), path, setup)
    pairs["noisy"] = Pair("noisy", "noisy", gguf_dir / f"{stem}.F32.gguf")
    pairs["noisy-bf16"] = Pair("noisy-bf16", "noisy-bf16", gguf_dir / f"{stem}.BF16.gguf")
    pairs["bf16"] = Pair("bf16", "noisy-bf16", gguf_dir / f"{stem}.BF16.gguf", dtype="bfloat16")
    return pairs


def embedded_stem() -> str:
    from pagedinfer.service.loader import default_gguf_path

    return default_gguf_path().stem.rsplit(".", 1)[0]  # SmolLM2-135M-Instruct.Q4_1 -> ...


# -- pagedinfer ------------------------------------------------------------------------


def serve_once(engine: LLMEngine, prompt: list[int], output_tokens: int) -> dict[str, float]:
    """One greedy request alone, `output_tokens` long: its timings, and the seconds its
    decode steps spent in the model runner's forward and outside it."""
    execute = engine.runner.execute
    forward = {"seconds": 0.0, "steps": 0}
    started: list[float] = []

    def timed(out):
        begin = time.perf_counter()
        result = execute(out)
        if started:  # a decode step: the first token is out
            forward["seconds"] += time.perf_counter() - begin
            forward["steps"] += 1
        return result

    engine.runner.execute = timed
    try:
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(prompt, params)
        tokens = 0
        while engine.has_unfinished():
            for delta in engine.step():
                tokens += len(delta.token_ids)
            if tokens and not started:
                started.append(time.perf_counter())
        end = time.perf_counter()
    finally:
        del engine.runner.execute  # back to the class's method
    if tokens != output_tokens:
        raise RuntimeError(f"pagedinfer returned {tokens} output tokens, not {output_tokens}")
    first = started[0]
    steps = max(forward["steps"], 1)
    return {
        "ttft_s": first - start,
        "seconds": end - start,
        "decode_tokens_per_s": (tokens - 1) / (end - first),
        "end_to_end_output_tokens_per_s": tokens / (end - start),
        "decode_step_ms": 1e3 * (end - first) / steps,
        "decode_forward_ms": 1e3 * forward["seconds"] / steps,
    }


def run_pagedinfer(
    pair: Pair, prompt: list[int], args: argparse.Namespace, profile: bool
) -> dict[str, Any]:
    """The pair's model in an engine of its own: one warm-up, then `args.repeats` runs."""
    engine_model, _, gguf = resolve_model(pair.model)
    config = EngineConfig(
        model=engine_model,
        dtype=pair.dtype,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        gguf_activations=args.gguf_activations,
        kv_cache_memory=32 * 2**20,
        # Every run computes its prompt, as the first serving of it would.
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    serve_once(engine, prompt, args.output_tokens)
    runs = [serve_once(engine, prompt, args.output_tokens) for _ in range(args.repeats)]
    executor = engine.runner.executor
    active = executor is not None and executor.active
    result: dict[str, Any] = {
        "weights": gguf.name if gguf else Path(pair.model).name,
        "cpu_executor": executor.mode if active else None,
        "gguf_activations": config.gguf_activations,
        # What the fused step reads a step: the weights in the executor's own layouts.
        "executor_weight_bytes": executor.fused.nbytes if active and executor.fused else None,
        **{key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]},
        "runs_decode_tokens_per_s": [round(r["decode_tokens_per_s"], 2) for r in runs],
    }
    result["decode_outside_forward_ms"] = round(
        result["decode_step_ms"] - result["decode_forward_ms"], 4
    )
    if profile:
        result["step_profile"] = profile_decode(engine, prompt, args.output_tokens)
    del engine
    gc.collect()
    return result


def profile_decode(engine: LLMEngine, prompt: list[int], output_tokens: int) -> dict[str, Any]:
    """The request's compiled steps phase by phase (`step_profile.py`), per decode step."""
    import step_profile  # the CPU's compiled step (numba): only for this profile

    try:
        out = step_profile.profile_run(
            engine,
            [prompt],
            [output_tokens],
            [prompt],
            [output_tokens],
            matmul_gflops(torch.float32),
        )
    except RuntimeError as err:  # no fused step serves this model here
        return {"skipped": str(err)}
    decode = out["decode_steps"]
    steps = max(decode["steps"], 1)

    def per_step(seconds: float) -> float:
        return round(1e3 * seconds / steps, 4)

    return {
        "decode_steps": decode["steps"],
        "step_ms": per_step(decode["seconds"]),
        "compiled_step_ms": per_step(decode["compiled_step_s"]),
        "outside_compiled_step_ms": per_step(decode["outside_compiled_step_s"]),
        "phases_work_ms": {k: per_step(v["work_s"]) for k, v in decode["phases"].items()},
        "wait_ms": per_step(decode["wait_s"]),
        "layer_gemm_gflops": decode.get("layer_gemm_gflops"),
        "layer_gemm_share_of_matmul_rate": decode.get("layer_gemm_share_of_matmul_rate"),
    }


# -- llama.cpp ---------------------------------------------------------------------------


def bench_binary(root: Path) -> Path:
    return root / "bin" / "llama-bench"


def llama_bench_command(
    binary: Path, gguf: Path, threads: int, output_tokens: int, repeats: int
) -> list[str]:
    """llama-bench's decode test alone (`-p 0`): `output_tokens` from an empty context."""
    return [
        str(binary), "-m", str(gguf), "-t", str(threads),
        "-p", "0", "-n", str(output_tokens), "-r", str(repeats), "-o", "json",
    ]  # fmt: skip


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench's JSON (`-o json`): its decode test's rates, and what it ran on (the
    file's name only)."""
    tests = [t for t in json.loads(text) if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(tests) != 1:
        raise ValueError(f"expected one decode test in llama-bench's JSON, found {len(tests)}")
    test = tests[0]
    return {
        "weights": Path(test["model_filename"]).name,
        "model_type": test.get("model_type"),
        "model_size_bytes": test.get("model_size"),
        "threads": test["n_threads"],
        "output_tokens": test["n_gen"],
        "decode_tokens_per_s": round(test["avg_ts"], 2),
        "stddev_tokens_per_s": round(test.get("stddev_ts", 0.0), 2),
        "runs_tokens_per_s": [round(x, 2) for x in test.get("samples_ts", [])],
        "build_commit": test.get("build_commit"),
    }


def run_llama_bench(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench on `gguf`, or {"skipped": reason} where it or the file is not here."""
    binary = bench_binary(args.llamacpp_dir)
    if not binary.is_file():
        return {"skipped": f"no llama-bench under {shown(args.llamacpp_dir)} "
                "(bash benchmarks/peers/setup_llamacpp.sh)"}  # fmt: skip
    cmd = llama_bench_command(binary, gguf, args.threads, args.output_tokens, args.repeats)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited {done.returncode}:\n{done.stderr[-2000:]}")
    return parse_llama_bench(done.stdout)


def run_llama_server(gguf: Path, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """llama-server on `gguf` serving the request alone (one slot, no prompt cache):
    one warm-up, then `args.repeats` runs; the medians."""
    if reason := run_llamacpp.unavailable(args.llamacpp_dir):
        return {"skipped": reason}
    job = run_llamacpp.LlamaCppJob(
        gguf=gguf, threads=args.threads, max_model_len=args.max_model_len, batch_tokens=512
    )
    body = {
        "prompt": prompt,
        "n_predict": args.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,  # every run computes its prompt, as pagedinfer's do
    }
    runs = []
    with run_llamacpp.LlamaServer(job, slots=1, root=args.llamacpp_dir) as server:
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            status, data = run_llamacpp._request(server.port, "POST", "/completion", body, 600)
            seconds = time.perf_counter() - start
            if status != 200:
                raise RuntimeError(f"llama-server answered {status}: {data[:500]!r}")
            answer = json.loads(data)
            if answer["tokens_predicted"] != args.output_tokens:
                raise RuntimeError(f"llama-server returned {answer['tokens_predicted']} tokens")
            timings = answer.get("timings", {})
            runs.append(
                {
                    "seconds": seconds,
                    "end_to_end_output_tokens_per_s": args.output_tokens / seconds,
                    # llama-server's own figure: every output token over its decode time.
                    "predicted_per_second": timings.get("predicted_per_second", 0.0),
                }
            )
    runs = runs[1:]  # after the warm-up
    return {
        "weights": gguf.name,
        **{key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]},
        "llama_cpp_python_sdist": run_llamacpp.version(args.llamacpp_dir),
    }


# -- the run -----------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(llamacpp_dir: Path) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "pagedinfer_commit": commit or None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": version("numba"),
        "llama_cpp_python_sdist": run_llamacpp.version(llamacpp_dir),
    }


def run_pair(pair: Pair, prompt: list[int], args: argparse.Namespace, say) -> dict[str, Any]:
    """Both engines on one pair, back to back; what is missing is skipped with the reason."""
    files = [p for p in (Path(pair.model), pair.gguf) if p is not None and p.suffix == ".gguf"]
    missing = [p for p in files if not p.is_file()]
    if missing:
        return {"skipped": f"no {shown(missing[0])} ({pair.setup})"}
    if pair.dtype == "bfloat16" and not torch_ops.native_bf16():
        return {"skipped": "this CPU has no native bf16"}
    say(f"{pair.name}: pagedinfer ...")
    ours = run_pagedinfer(pair, prompt, args, pair.name in args.profile)
    entry: dict[str, Any] = {"pagedinfer": ours}
    gguf = pair.gguf or resolve_model(pair.model)[2]
    if gguf is None:
        entry["llama_bench"] = {"skipped": f"llama.cpp serves GGUF files; {pair.model} is none"}
        return entry
    say(f"{pair.name}: llama-bench on {gguf.name} ...")
    entry["llama_bench"] = run_llama_bench(gguf, args)
    if args.server:
        say(f"{pair.name}: llama-server on {gguf.name} ...")
        entry["llama_server"] = run_llama_server(gguf, prompt, args)
    if gguf.suffix == ".gguf" and gguf.stat().st_size:
        add_read_rates(entry, gguf, args.read_bandwidth)
    theirs = entry["llama_bench"].get("decode_tokens_per_s")
    if theirs:
        entry["decode_ratio_vs_llama_bench"] = round(ours["decode_tokens_per_s"] / theirs, 2)
    server = entry.get("llama_server", {}).get("end_to_end_output_tokens_per_s")
    if server:
        entry["end_to_end_ratio_vs_llama_server"] = round(
            ours["end_to_end_output_tokens_per_s"] / server, 2
        )
    return entry


def add_read_rates(entry: dict[str, Any], gguf: Path, bandwidth: float) -> None:
    """The bytes of the file's tensors (each read once a decode step: the tied LM head is
    the embedding) and, for each engine, the rate its decode reads them at and that
    rate's share of the machine's read bandwidth (bytes/s)."""
    file_bytes = sum(t.nbytes for t in read_header(gguf).tensors.values())
    entry["file_weight_bytes"] = file_bytes
    for engine in ("pagedinfer", "llama_bench"):
        rate = entry.get(engine, {}).get("decode_tokens_per_s")
        if rate:
            entry[engine]["file_gb_per_s"] = round(file_bytes * rate / 1e9, 2)
            entry[engine]["share_of_read_bandwidth"] = round(file_bytes * rate / bandwidth, 3)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"a subset of {', '.join(PAIRS)}")
    ap.add_argument("--model", help="one pair of your own: pagedinfer's --model (throughput.py)")
    ap.add_argument("--gguf", type=Path, help="with --model: llama.cpp's file (default its own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-index", type=int, default=0, help="which chat prompt")
    ap.add_argument("--chat-prompts", type=Path, default=CHAT_PROMPTS)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument(
        "--gguf-activations",
        choices=GGUF_ACTIVATIONS,
        default=EngineConfig.gguf_activations,
        help="how pagedinfer multiplies a GGUF file's codes: fp32 (exact) or int8 (as llama.cpp)",
    )
    ap.add_argument("--gguf-dir", type=Path, default=DEFAULT_GGUF_DIR)
    ap.add_argument("--llamacpp-dir", type=Path, default=run_llamacpp.DEFAULT_DIR)
    ap.add_argument("--no-server", dest="server", action="store_false", help="skip llama-server")
    ap.add_argument("--profile", default="", help="pairs whose decode steps to profile by phase")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.output_tokens < 2:
        ap.error("--repeats must be at least 1 and --output-tokens at least 2")
    args.profile = {p.strip() for p in args.profile.split(",") if p.strip()}
    return ap, args


def main(argv: list[str] | None = None) -> int:
    ap, args = parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    if args.model:
        pairs = [Pair(Path(args.model).name, args.model, args.gguf)]
    else:
        known = default_pairs(args.gguf_dir, embedded_stem())
        names = [n.strip() for n in args.pairs.split(",") if n.strip()]
        if unknown := [n for n in names if n not in known]:
            ap.error(f"unknown pairs: {', '.join(unknown)} (choose from {', '.join(PAIRS)})")
        pairs = [known[n] for n in names]
    torch.set_num_threads(args.threads)
    chat = load_chat_prompts(args.chat_prompts)
    if not 0 <= args.prompt_index < len(chat):
        ap.error(f"--prompt-index must be below {len(chat)}")
    from transformers import AutoTokenizer

    from pagedinfer.service.loader import ensure_default_model

    # One prompt for every pair: they all share the embedded model's tokenizer.
    tokenizer_dir = resolve_model(args.model)[1] if args.model else ensure_default_model()
    prompt = render(
        AutoTokenizer.from_pretrained(tokenizer_dir), chat[args.prompt_index]["messages"]
    )
    gflops = matmul_gflops(torch.float32)
    args.read_bandwidth = read_bandwidth()
    results: dict[str, Any] = {
        "machine": {
            "cpu": cpu_name(),
            "threads": args.threads,
            "openmp_spin": openmp_spin(),
            "matmul_gflops_fp32": round(gflops, 1),
            # Bytes/s a reduction over 1 GiB reads at `threads` threads (throughput.py's).
            "read_gb_per_s": round(args.read_bandwidth / 1e9, 2),
            "load_average_at_start": round(os.getloadavg()[0], 2),
        },
        "versions": versions(args.llamacpp_dir),
        "request": {
            "chat_prompt": args.prompt_index,
            "task": chat[args.prompt_index].get("task"),
            "prompt_tokens": len(prompt),
            "output_tokens": args.output_tokens,
            "repeats": args.repeats,
            "greedy": True,
            "ignore_eos": True,
        },
        "pairs": {},
    }
    for pair in pairs:
        results["pairs"][pair.name] = entry = run_pair(pair, prompt, args, say)
        say(json.dumps(entry))
    results["decode_ratios_vs_llama_bench"] = {
        name: entry["decode_ratio_vs_llama_bench"]
        for name, entry in results["pairs"].items()
        if "decode_ratio_vs_llama_bench" in entry
    }
    results["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
