"""llama.cpp's `llama-server` as a system of benchmarks/throughput.py.

The server (`setup_llamacpp.sh`) serves the GGUF file itself, with one parallel slot
per request of the workload so that all of them decode together, each slot holding
`max_model_len` tokens of context. Every request goes to its `/completion` endpoint as
token ids (the same ids every other system gets), greedy, with a fixed number of
output tokens and EOS ignored; the figure is the wall time from sending all of them
at once to the last answer.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from peers.paths import shown

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / ".llamacpp"
HOST = "127.0.0.1"


@dataclass
class LlamaCppJob:
    gguf: Path
    threads: int
    max_model_len: int  # context per slot
    batch_tokens: int  # tokens per forward pass (llama.cpp's logical and physical batch)


def server_binary(root: Path = DEFAULT_DIR) -> Path:
    return root / "bin" / "llama-server"


def version(root: Path = DEFAULT_DIR) -> str | None:
    """The llama-cpp-python release whose vendored llama.cpp was built, if recorded."""
    path = root / "bin" / "VERSION"
    return path.read_text().strip() if path.is_file() else None


def unavailable(root: Path = DEFAULT_DIR) -> str | None:
    """Why llama.cpp cannot run here, or None when its server is built."""
    if not server_binary(root).is_file():
        return f"no llama-server under {shown(root)} (bash benchmarks/peers/setup_llamacpp.sh)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _request(port: int, method: str, path: str, body: dict | None, timeout: float):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            body=json.dumps(body) if body is not None else None,
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        data = response.read()
        return response.status, data
    finally:
        conn.close()


class LlamaServer:
    """A llama-server on a free loopback port, for as long as the `with` block lasts."""

    def __init__(self, job: LlamaCppJob, slots: int, root: Path = DEFAULT_DIR) -> None:
        self.job, self.slots, self.root = job, slots, root
        self.port = _free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log")  # noqa: SIM115  # closed in __exit__
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        job = self.job
        cmd = [
            str(server_binary(self.root)),
            "--model", str(job.gguf),
            "--host", HOST,
            "--port", str(self.port),
            "--threads", str(job.threads),
            "--threads-batch", str(job.threads),
            "--parallel", str(self.slots),
            "--ctx-size", str(self.slots * job.max_model_len),
            "--batch-size", str(job.batch_tokens),
            "--ubatch-size", str(job.batch_tokens),
            "--no-webui",
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self._proc.returncode}):\n{self.log()}")
            try:
                status, _ = _request(self.port, "GET", "/health", None, timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become ready in 300 s:\n{self.log()}")

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def log(self, lines: int = 30) -> str:
        with open(self._log.name, errors="replace") as handle:
            return "\n".join(handle.read().splitlines()[-lines:])

    def complete(self, prompt: list[int], n_predict: int, timeout: float) -> dict:
        """One greedy completion of exactly `n_predict` tokens; its response as a dict."""
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
        }
        status, data = _request(self.port, "POST", "/completion", body, timeout)
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {data[:500]!r}")
        return json.loads(data)

    def serve(self, prompts: list[list[int]], output_lens: list[int], timeout: float):
        """All requests at once; (wall seconds, the responses in request order)."""
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            start = time.perf_counter()
            futures = [
                pool.submit(self.complete, p, n, timeout)
                for p, n in zip(prompts, output_lens, strict=True)
            ]
            responses = [f.result() for f in futures]
            return time.perf_counter() - start, responses


def run_llamacpp(
    job: LlamaCppJob,
    workload: tuple[list[list[int]], list[int]],
    warmup: tuple[list[list[int]], list[int]],
    root: Path = DEFAULT_DIR,
    timeout: float = 3600,
) -> dict:
    """Serve `warmup`, then `workload` (prompts, output lengths) on a fresh llama-server.

    Raises RuntimeError with the server's log tail when it fails, or when it produced
    other lengths than asked.
    """
    if reason := unavailable(root):
        raise RuntimeError(reason)
    prompts, output_lens = workload
    start = time.perf_counter()
    with LlamaServer(job, slots=len(prompts), root=root) as server:
        startup = time.perf_counter() - start
        server.serve(*warmup, timeout)
        seconds, responses = server.serve(prompts, output_lens, timeout)
    got = [r["tokens_predicted"] for r in responses]
    if got != list(output_lens):
        raise RuntimeError(
            f"llama-server returned {sum(got)} output tokens, not {sum(output_lens)}"
        )
    evaluated = [r.get("tokens_evaluated") for r in responses]
    return {
        "seconds": seconds,
        "startup_seconds": round(startup, 2),
        "slots": len(prompts),
        "prompt_tokens_evaluated": sum(e for e in evaluated if e is not None),
        "output_token_ids": [r.get("tokens") for r in responses],
        "llama_cpp_python_sdist": version(root),
    }
