"""`pagedinfer serve` reports a user's mistake as one line naming the flag or file, with
exit code 2 and no traceback, and a port it cannot have with the flag that chose it
(exit code 1). Every case starts a real server process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def serve(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pagedinfer.service.cli", "serve", "--host", "127.0.0.1",
            "--port", "0", "--http-port", "0", "--metrics-port", "-1", *flags]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text file named .gguf and a GPT-2 model directory."""
    root = tmp_path_factory.mktemp("mistakes")
    (root / "notes.gguf").write_text("these are my notes, not a model\n")
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2}'
    )
    return root


MISTAKES = [
    (["--model", "no/such/model"], "model path not found: no/such/model"),
    (["--model", "notes.gguf"], "notes.gguf: not a GGUF file"),
    (["--model", "gpt2"], "unsupported architecture: model_type='gpt2'"),
    (["--max-model-len", "100000"], "give --max-model-len 8192 or less"),
    (["--max-num-seqs", "100000000"], "lower --max-num-seqs"),
    (["--kv-cache-memory", "1000000GiB"], "--kv-cache-memory 1000000.00 GiB is more than"),
    (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key must be given together"),
    (["--grace-period", "-1"], "--grace-period must be >= 0"),
    (["--tls-cert", "cert.pem", "--tls-key", "key.pem"], "--tls-cert cert.pem: no such file"),
    (["--host", "999.1.1.1"], "--host 999.1.1.1: not an address"),
    (["--num-threads", "100000"], "--num-threads 100000 is far more than"),
]
if not torch.cuda.is_available():
    MISTAKES.append((["--device", "cuda"], "--device cuda: torch is built without CUDA"))


@pytest.mark.parametrize(("flags", "message"), MISTAKES, ids=[" ".join(f) for f, _ in MISTAKES])
def test_a_mistake_is_one_line_naming_it_with_exit_code_2(
    flags: list[str], message: str, mistakes: Path, default_model_dir: Path
) -> None:
    done = serve(*flags, cwd=mistakes)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedinfer serve: error: "), done.stderr[-3000:]
    assert message in last


def reuseport_listener() -> socket.socket:
    """A listener as another gRPC server holds its port: with SO_REUSEPORT, which a
    second socket that sets it too could share."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_taken_port_is_named_with_its_flag(flag: str, tmp_path: Path) -> None:
    with reuseport_listener() as held:
        port = str(held.getsockname()[1])
        done = serve(flag, port, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"cannot start the server: {flag} {port}: cannot listen on 127.0.0.1:{port}" in (
        done.stderr
    )
