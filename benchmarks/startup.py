"""Start-up time and footprint: `pagedinfer serve` to health SERVING and a first token,
and `pagedinfer generate "..." --chat` to its answer, with cold and warm caches.

Cold: the numba kernel cache (NUMBA_CACHE_DIR) and pagedinfer's model cache
(PAGEDINFER_CACHE_DIR: the embedded model converted from GGUF) point at empty
directories; a cold server serves on the torch forward while its kernels compile, and
the run waits for them (`kernels_compiled_s`). Warm: a second start over the same
directories. Each server run then takes a load of concurrent gRPC streams and reports
its peak resident set (VmHWM), and the peak of the server and its child processes
together (sampled proportional set sizes: what a pod's memory limit counts, a child
compiling kernels included); a cold server takes the load again once its kernels are compiled.

    python benchmarks/startup.py                          # cold and warm, serve and generate
    python benchmarks/startup.py --modes warm --json benchmarks/results/startup_xeon.json

Prints one JSON object; the targets of issue 32 are printed beside the figures (not
asserted): warm SERVING within 5 s, warm generate answering within 8 s, cold SERVING
within 30 s, at most 1.5 GiB resident under load. `--memory-limit` runs the servers as
under a container's memory limit, which sizes their KV cache (and, cold, decides whether
they serve while a child compiles or compile first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("cold", "warm")
COMMANDS = ("serve", "generate")
QUESTION = "What is the capital of France?"
TARGETS = {
    "warm_serve_serving_s": 5.0,
    "warm_generate_answer_s": 8.0,
    "cold_serve_serving_s": 30.0,
    "peak_rss_under_load_gib": 1.5,
}
START_TIMEOUT_S = 900.0
# Names a prebuilt kernel cache that seeds an empty one (kernels/cpu/numba_support.py).
PREBUILT_CACHE_ENV = "PAGEDINFER_NUMBA_PREBUILT"


@dataclass
class Caches:
    """The two cache directories a run points the server at (None: the environment's)."""

    numba: Path | None
    models: Path | None
    cold: bool = False

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.cold:  # no kernels copied in from an image's prebuilt cache either
            env.pop(PREBUILT_CACHE_ENV, None)
        if self.numba is not None:
            env["NUMBA_CACHE_DIR"] = str(self.numba)
        if self.models is not None:
            env["PAGEDINFER_CACHE_DIR"] = str(self.models)
        return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="cold,warm",
                    help="comma-separated: cold (empty caches), warm (a second start over "
                    "the same caches)")  # fmt: skip
    ap.add_argument("--commands", default="serve,generate", help="comma-separated: serve, generate")
    ap.add_argument("--caches", default=None, metavar="DIR",
                    help="keep the caches under DIR (default: a temporary directory, removed "
                    "after the run); 'environment' uses the caches the environment names, "
                    "as they are (warm runs only)")  # fmt: skip
    ap.add_argument("--streams", type=int, default=64, help="concurrent gRPC streams of the load")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each stream generates")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    ap.add_argument("--memory-limit", default=None, metavar="SIZE",
                    help="run as under a container memory limit of SIZE (e.g. 1.5GiB): a "
                    "cgroup tree whose memory.max the server reads instead of its own")  # fmt: skip
    ap.add_argument("serve_args", nargs="*", metavar="-- ARG",
                    help="extra `pagedinfer serve`/`generate` engine flags, after --")  # fmt: skip
    args = ap.parse_args(argv)
    if args.memory_limit is not None:
        from pagedinfer.service.config import parse_bytes

        try:
            args.memory_limit = parse_bytes(args.memory_limit)
        except ValueError as err:
            ap.error(f"--memory-limit: {err}")
    args.modes = _choices(ap, "--modes", args.modes, MODES)
    args.commands = _choices(ap, "--commands", args.commands, COMMANDS)
    if args.caches == "environment" and "cold" in args.modes:
        ap.error("--caches environment cannot give cold runs: the environment's caches are warm")
    for name in ("streams", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _choices(ap: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]):
    picked = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in picked if item not in allowed]
    if unknown or not picked:
        ap.error(f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return [item for item in allowed if item in picked]  # cold before warm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def descendants(pid: int) -> list[int]:
    """A process's children, their children and so on (Linux's per-thread child lists)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def pss_kib(pid: int) -> int | None:
    """A process's proportional set size: its resident pages, each shared page divided
    among the processes that map it, so that a tree's sum counts a page once."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        return vm_kib(pid, "VmRSS")
    return vm_kib(pid, "VmRSS")


class TreePeak:
    """Samples the memory of a process and all its descendants together (what a pod's
    memory limit counts: the server and a child compiling its kernels, which shares the
    weights with it) as the sum of their proportional set sizes, and keeps the highest
    sum seen."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            pids = [self.pid, *descendants(self.pid)]
            total = sum(pss_kib(p) or 0 for p in pids)
            self.peak_kib = max(self.peak_kib, total)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return mib(self.peak_kib or None)


def reset_peak_rss(pid: int) -> None:
    """Set a process's peak resident set (VmHWM) back to its current one (Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5\n")


def wait_for_exit(process: subprocess.Popen) -> int:
    """The child's peak resident set in KiB (its rusage), reaped here."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss


def cli(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagedinfer.service.cli", command, *args]


def run_serve(caches: Caches, streams: int, max_tokens: int, extra: list[str]) -> dict[str, Any]:
    """Start a server, time its health SERVING and a first token, load it, stop it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedinfer.service.proto import inference_pb2 as pb
    from pagedinfer.service.proto import inference_pb2_grpc

    port = free_port()
    args = cli("serve", "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", str(free_port()), "--http-port", str(free_port()), *extra)  # fmt: skip
    result: dict[str, Any] = {"command": "serve"}
    with tempfile.TemporaryFile() as log:
        start = time.monotonic()
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=caches.env())
        tree = TreePeak(process.pid)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"the server exited with {process.returncode}:\n{tail}")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                except grpc.RpcError:
                    reply = None
                if reply is not None:
                    result.setdefault("listening_s", round(time.monotonic() - start, 3))
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                if time.monotonic() - start > START_TIMEOUT_S:
                    raise RuntimeError(f"no health SERVING within {START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
            result["serving_s"] = round(time.monotonic() - start, 3)
            result["rss_serving_mib"] = mib(vm_kib(process.pid, "VmRSS"))
            # The start's peak (the model load's staging buffers), then the peak counter
            # reset, so that the peak under load is the load's own.
            result["peak_rss_start_mib"] = mib(vm_kib(process.pid, "VmHWM"))
            reset_peak_rss(process.pid)
            stub = inference_pb2_grpc.InferenceStub(channel)
            chat = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=QUESTION)],
                sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            )
            for reply in stub.Generate(chat, timeout=600):
                if reply.token_ids:
                    result["first_token_s"] = round(time.monotonic() - start, 3)
                    break
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            result["num_blocks"] = info.num_blocks
            result["load"] = run_load(stub, pb, streams, max_tokens)
            result["rss_after_load_mib"] = mib(vm_kib(process.pid, "VmRSS"))
            result["peak_rss_under_load_mib"] = mib(vm_kib(process.pid, "VmHWM"))
            if caches.cold and caches.numba is not None:
                # Until its kernels are compiled a cold server serves on the torch
                # forward; the next start is warm only once they are all in the cache.
                compiled = wait_for_compile_record(caches.numba, process, start)
                result["kernels_compiled_s"] = compiled
                # The same load again, now on the compiled kernels: what the server
                # holds for the rest of its life.
                reset_peak_rss(process.pid)
                result["load_compiled"] = run_load(stub, pb, streams, max_tokens)
                result["peak_rss_compiled_load_mib"] = mib(vm_kib(process.pid, "VmHWM"))
                result["rss_after_compiled_load_mib"] = mib(vm_kib(process.pid, "VmRSS"))
            result["peak_tree_rss_mib"] = tree.stop()
        finally:
            tree.stop()
            channel.close()
            if process.poll() is None:
                process.terminate()
            if process.returncode is None:
                wait_for_exit(process)
    return result


def wait_for_compile_record(numba_cache: Path, process: subprocess.Popen, start: float) -> float:
    """Seconds from start until the server recorded its kernels as compiled in the cache
    (`kernels/cpu/compile_record.py`), waiting for it."""
    while not any(numba_cache.glob("pagedinfer-compiled-*")):
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} while compiling")
        if time.monotonic() - start > START_TIMEOUT_S:
            raise RuntimeError(f"kernels not compiled within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.2)
    return round(time.monotonic() - start, 3)


def run_load(stub: Any, pb: Any, streams: int, max_tokens: int) -> dict[str, Any]:
    """`streams` concurrent chats of `max_tokens` tokens each (half greedy, half sampled)."""

    def one(i: int) -> int:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if i % 2:
            sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9,
                                         seed=i, ignore_eos=True)  # fmt: skip
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=f"Tell me a story about {i} cats.")],
            sampling=sampling,
        )
        return sum(len(r.token_ids) for r in stub.Generate(request, timeout=900))

    start = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    seconds = time.monotonic() - start
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def run_generate(caches: Caches, extra: list[str]) -> dict[str, Any]:
    """`pagedinfer generate QUESTION --chat`: time to its first output and to its exit."""
    start = time.monotonic()
    process = subprocess.Popen(
        cli("generate", QUESTION, "--chat", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=caches.env(),
    )  # fmt: skip
    result: dict[str, Any] = {"command": "generate"}
    stderr: list[bytes] = []
    drain = threading.Thread(target=lambda: stderr.append(process.stderr.read()), daemon=True)
    drain.start()
    answer = b""
    while chunk := process.stdout.read1(4096):
        if not answer.strip() and chunk.strip():
            result["first_token_s"] = round(time.monotonic() - start, 3)
        answer += chunk
    peak = wait_for_exit(process)
    result["answer_s"] = round(time.monotonic() - start, 3)
    drain.join()
    if process.returncode != 0:
        tail = b"".join(stderr).decode(errors="replace")[-3000:]
        raise RuntimeError(f"pagedinfer generate exited with {process.returncode}:\n{tail}")
    result["answer"] = answer.decode(errors="replace").strip()
    result["peak_rss_mib"] = mib(peak)
    return result


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }


def targets_met(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target beside the figure it bounds (the worst run's), where one was measured."""

    def worst(mode: str, command: str, key: str) -> float | None:
        values = [
            r[key] for r in runs if r["mode"] == mode and r["command"] == command and key in r
        ]
        return max(values) if values else None

    keys = ("peak_rss_under_load_mib", "peak_rss_compiled_load_mib", "peak_tree_rss_mib")
    rss = [r[key] for r in runs for key in keys if r.get(key) is not None]
    figures = {
        "warm_serve_serving_s": worst("warm", "serve", "serving_s"),
        "warm_generate_answer_s": worst("warm", "generate", "answer_s"),
        "cold_serve_serving_s": worst("cold", "serve", "serving_s"),
        "peak_rss_under_load_gib": round(max(rss) / 1024, 3) if rss else None,
    }
    return {
        name: {"target": TARGETS[name], "measured": value, "met": value <= TARGETS[name]}
        for name, value in figures.items()
        if value is not None
    }


def run_caches(root: Path | None, mode: str, command: str, engine_args: list[str]) -> Caches:
    """The caches of one run: fresh ones for a cold run, for a warm one those a cold run
    filled (or a first, unmeasured generate fills), None for the environment's own."""
    if root is None:
        return Caches(None, None)
    directory = root / (f"cold-{command}" if mode == "cold" else "warm")
    caches = Caches(directory / "numba", directory / "models", cold=mode == "cold")
    if mode == "cold":
        shutil.rmtree(directory, ignore_errors=True)
    elif not directory.exists():
        run_generate(caches, ["--max-tokens", "1", *engine_args])
    return caches


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.caches == "environment":
        root, keep = None, True
    elif args.caches:
        root, keep = Path(args.caches), True
        root.mkdir(parents=True, exist_ok=True)
    else:
        root, keep = Path(tempfile.mkdtemp(prefix="pagedinfer-startup-")), False
    results: dict[str, Any] = {"benchmark": "startup", "machine": machine(), "runs": []}
    results["settings"] = {
        "modes": args.modes,
        "commands": args.commands,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "engine_args": args.serve_args,
        "memory_limit_mib": None if args.memory_limit is None else mib(args.memory_limit // 1024),
    }
    if args.memory_limit is not None:
        # The server reads its limit where this variable points (service/memory.py).
        cgroup = Path(tempfile.mkdtemp(prefix="pagedinfer-cgroup-"))
        (cgroup / "memory.max").write_text(f"{args.memory_limit}\n")
        os.environ["PAGEDINFER_CGROUP_ROOT"] = str(cgroup)
    if root is not None and "cold" in args.modes:
        shutil.rmtree(root / "warm", ignore_errors=True)  # warm = after this cold run
    try:
        for mode in args.modes:
            for command in args.commands:
                caches = run_caches(root, mode, command, args.serve_args)
                print(f"{mode} {command} ...", file=sys.stderr, flush=True)
                if command == "serve":
                    run = run_serve(caches, args.streams, args.max_tokens, args.serve_args)
                else:
                    run = run_generate(caches, args.serve_args)
                results["runs"].append({"mode": mode, **run})
                if mode == "cold" and not (root / "warm").exists():
                    # The warm runs are the second start over the caches this one filled.
                    (root / f"cold-{command}").rename(root / "warm")
    finally:
        if not keep and root is not None:
            shutil.rmtree(root, ignore_errors=True)
    results["targets"] = targets_met(results["runs"])
    results["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
