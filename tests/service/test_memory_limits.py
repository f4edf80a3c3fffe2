"""Each example InferenceService's memory limit holds its server under load.

The server starts with the arguments the operator gives the example's container and no
`--kv-cache-memory` unless the example sets one, so the KV cache is sized from the
memory limit. No cgroup can be created here: the limit comes from a fake cgroup tree
whose `memory.max` holds the example's limit (`PAGEDINFER_CGROUP_ROOT`), read by the
same code that reads the real one. Concurrent streams then run, and the peak resident
set (VmHWM) of the server process must stay below the limit.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedinfer.operator.resources import SERVER_CONTAINER, build_deployment
from pagedinfer.service.memory import CGROUP_ROOT_ENV
from pagedinfer.service.proto import inference_pb2 as pb
from pagedinfer.service.proto import inference_pb2_grpc

pytestmark = pytest.mark.slow


def example_services() -> list[tuple[str, dict[str, Any]]]:
    """(file/name, body) of every InferenceService in examples/*.yaml."""
    found = []
    for file in sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")):
        for body in yaml.safe_load_all(file.read_text()):
            if body and body.get("kind") == "InferenceService":
                found.append((f"{file.stem}/{body['metadata']['name']}", body))
    return found


EXAMPLES = [pytest.param(name, body, id=name) for name, body in example_services()]
STARTUP_TIMEOUT_S = 600  # a first start converts the model and compiles the kernels
NUM_STREAMS = 48
MAX_TOKENS = 24
QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                  "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}  # fmt: skip


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity ('2Gi', '1500M', '1073741824') in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT]|)", str(text))
    if match is None:
        raise ValueError(f"not a memory quantity: {text!r}")
    return int(float(match.group(1)) * QUANTITY_UNITS[match.group(2)])


def server_container(body: dict[str, Any]) -> dict[str, Any]:
    deployment = build_deployment(body, replicas=1, default_image="pagedinfer:test")
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == SERVER_CONTAINER
    ]  # fmt: skip
    return container


def runnable_here(container: dict[str, Any]) -> str | None:
    """Why this machine cannot run the example's server, or None."""
    limits = container.get("resources", {}).get("limits", {})
    if any(key.endswith("/gpu") for key in limits):
        return "the example asks for a GPU"
    args = container["args"]
    if "--model" in args:
        model = Path(args[args.index("--model") + 1])
        if not model.exists():
            return f"the example's model {model} is not on this machine"
    if "memory" not in limits:
        return "the example sets no memory limit"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    """VmHWM of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"process {pid} has no VmHWM")


def wait_serving(process: subprocess.Popen, channel: grpc.Channel, log: Path) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not become SERVING:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def stream(stub: inference_pb2_grpc.InferenceStub, i: int) -> str:
    """One chat completion; every other stream samples, so logits rows are kept too."""
    topic = " and ".join(["the sea", "mountains", "a city at night"][: 1 + i % 3])
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    if i % 2:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=i)
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=f"Write about {topic}. ({i})")],
        sampling=sampling,
    )
    reasons = [r.finish_reason for r in stub.Generate(request, timeout=600) if r.finish_reason]
    return pb.FinishReason.Name(reasons[-1]) if reasons else "none"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("name", "body"), EXAMPLES)
def test_the_example_memory_limit_holds_the_server_under_load(name, body, tmp_path):
    container = server_container(body)
    why_not = runnable_here(container)
    if why_not:
        pytest.skip(why_not)
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{limit}\n")

    port = free_port()
    # The operator's arguments, with this machine's address and free ports appended
    # (argparse keeps the last value of a flag).
    args = [*container["args"], "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", "-1", "--http-port", "-1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    env[CGROUP_ROOT_ENV] = str(cgroup)
    env["OMP_NUM_THREADS"] = "1"  # a shared CPU: behaviour, not speed, is checked here
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedinfer.service.cli", *args],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
        )  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(process, channel, log)
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            reasons = list(pool.map(lambda i: stream(stub, i), range(NUM_STREAMS)))
        peak = peak_rss(process.pid)
    finally:
        channel.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text()
    plan = re.search(r"KV cache budget [^\"]*", text)
    print(f"\n{name}: peak RSS {peak / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB; "
          f"{info.num_blocks} blocks; {plan.group(0) if plan else 'KV budget given'}")  # fmt: skip
    if "--kv-cache-memory" not in args:
        assert f"from the memory limit {limit / 2**30:.2f} GiB" in text, text[-4000:]
    assert info.num_blocks > 0
    assert set(reasons) <= {"STOP", "LENGTH"}, reasons
    assert peak < limit, (
        f"peak RSS {peak / 2**20:.0f} MiB exceeds the limit {limit / 2**20:.0f} MiB "
        f"of {name}:\n{text[-3000:]}"
    )
