"""A `pagedinfer serve` process with its OpenAI-compatible HTTP API on 127.0.0.1, for
the tests that drive it with clients from the ecosystem (load generators, eval harnesses).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 300  # the first start converts the embedded model (about 30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HTTPServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT, without /v1
    log: Path

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return json.load(response)

    @property
    def model(self) -> str:
        """The name the server answers to (the first of GET /v1/models)."""
        return self.get_json("/v1/models")["data"][0]["id"]

    def vllm_gauges(self) -> dict[str, float]:
        """The `vllm:` series of GET /metrics that carry no label but model_name."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^(vllm:\w+)\{model_name="[^"]*"\} (\S+)$', text, re.MULTILINE)
        }

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Until nothing runs or waits and every KV block is free again (cached blocks
        count as free); fails with the last scrape otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.vllm_gauges()
            if (
                gauges.get("vllm:num_requests_running") == 0
                and gauges.get("vllm:num_requests_waiting") == 0
                and gauges.get("vllm:kv_cache_usage_perc") == 0
            ):
                return gauges
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become idle; last vllm: gauges {gauges}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def start_http_server(directory: Path, *extra: str) -> HTTPServer:
    """Starts a server with a small KV cache and one CPU thread, and waits until
    GET /health answers 200."""
    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.pop("PAGEDINFER_AUTH_TOKEN", None)
    env["OMP_NUM_THREADS"] = "1"  # these tests check behaviour on a shared CPU, not speed
    args = [sys.executable, "-m", "pagedinfer.service.cli", "serve", "--host", "127.0.0.1",
            "--http-port", str(http_port), "--port", str(free_port()),
            "--metrics-port", str(free_port()), "--kv-cache-memory", "128MiB", *extra]  # fmt: skip
    log = directory / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=directory,
                                   env=env)  # fmt: skip
    server = HTTPServer(process, f"http://127.0.0.1:{http_port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass  # 503 while loading, or not listening yet
        if time.monotonic() > deadline:
            stop_http_server(server)
            pytest.fail(f"the server did not become healthy:\n{server.log_tail()}")
        time.sleep(0.2)


def stop_http_server(server: HTTPServer, timeout: float = 60) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode
