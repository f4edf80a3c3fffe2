"""The gRPC server, end to end: a real `pagedinfer serve` process on 127.0.0.1 with the
embedded model and a small KV cache, called through the generated stubs."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedinfer.service.client import generate_remote
from pagedinfer.service.proto import inference_pb2 as pb
from pagedinfer.service.proto import inference_pb2_grpc
from pagedinfer.service.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300  # the first start converts the embedded model (about 30 s)
KV_CACHE = "64MiB"  # about 90 blocks of 16 tokens for the embedded model
CHAT = [pb.ChatMessage(role="user", content="What is the capital of France?")]
TOKEN = "s3cret-token"
SHORT_TOKENS = 8  # the request that runs through a SIGTERM
LONG_TOKENS = 2040  # the one cut at the grace period's end: the context (2048) less its prompt


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are chosen, so the
    kernel cannot hand the same port out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    metrics_port: int
    log: Path
    channel: grpc.Channel
    metadata: tuple = ()
    http_port: int = -1  # the OpenAI-compatible HTTP API's

    @property
    def stub(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    def generate(self, timeout: float | None = 120, **request):
        call = self.stub.Generate(pb.GenerateRequest(**request), metadata=self.metadata,
                                  timeout=timeout)  # fmt: skip
        return call

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"^(pagedinfer_\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE)
        }

    def aborts(self) -> float:
        """vllm:request_success_total{finished_reason="abort"}, summed over models."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        pattern = r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$'
        return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))

    def wait_for_metric(self, name: str, predicate, timeout: float = 20) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if name in metrics and predicate(metrics[name], metrics):
                return metrics
            if time.monotonic() > deadline:
                pytest.fail(f"{name} never met the condition; last scrape: {metrics}")
            time.sleep(0.05)

    def wait_all_blocks_free(self, timeout: float = 20) -> dict[str, float]:
        return self.wait_for_metric(
            "pagedinfer_kv_cache_blocks_free",
            lambda free, m: (
                free == m["pagedinfer_kv_cache_blocks_total"]
                and m["pagedinfer_requests_running"] == 0
                and m["pagedinfer_requests_waiting"] == 0
            ),
            timeout,
        )

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def start_server(directory: Path, *extra: str, token: str | None = None,
                 tls: tuple[Path, Path] | None = None,
                 ports: tuple[int, int, int] | None = None) -> Server:  # fmt: skip
    """A server in `directory` on `ports` (gRPC, metrics, HTTP; default: free ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    port, metrics_port, http_port = ports or free_ports(3)
    log = directory / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.pop("PAGEDINFER_AUTH_TOKEN", None)
    # One intra-op thread: these tests check behaviour, not speed, and on a shared CPU
    # OpenMP threads that spin-wait for each other slow every step down tenfold.
    env["OMP_NUM_THREADS"] = "1"
    args = [sys.executable, "-m", "pagedinfer.service.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", str(metrics_port),
            "--http-port", str(http_port), "--kv-cache-memory", KV_CACHE, *extra]  # fmt: skip
    if token:
        env["PAGEDINFER_AUTH_TOKEN"] = token
    if tls:
        args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, cwd=directory,
                                   env=env)  # fmt: skip
    if tls:
        credentials = grpc.ssl_channel_credentials(root_certificates=tls[0].read_bytes())
        channel = grpc.secure_channel(f"127.0.0.1:{port}", credentials)
    else:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    server = Server(process, port, metrics_port, log, channel, metadata, http_port)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return server
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            pytest.fail(f"the server did not become SERVING:\n{server.log_tail()}")
        time.sleep(0.2)


def stop_server(server: Server, timeout: float = 60) -> int:
    server.channel.close()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shared server: defaults plus a small KV cache."""
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """TLS, a bearer token, one running sequence, a waiting queue of one and a 5 s grace
    period; the last test stops it with SIGTERM."""
    directory = tmp_path_factory.mktemp("strict")
    # A cache that holds a whole context (the shutdown test's second request).
    server = start_server(directory, "--max-num-seqs", "1", "--max-queue", "1",
                          "--grace-period", "5", "--kv-cache-memory", "160MiB", token=TOKEN,
                          tls=make_certificate(directory))  # fmt: skip
    yield server
    stop_server(server)


def collect(call) -> list:
    return list(call)


def greedy(max_tokens: int, **extra) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


# ------------------------------------------------------------------ the happy path


@pytest.mark.timeout(120)
def test_health_is_serving_once_ready(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "pagedinfer.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(120)
def test_reflection_lists_the_services(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    (reply,) = list(stub.ServerReflectionInfo(requests, timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"pagedinfer.v1.Inference", "grpc.health.v1.Health"} <= names
    requests = iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="pagedinfer.v1.Inference")])  # fmt: skip
    (reply,) = list(stub.ServerReflectionInfo(requests, timeout=10))
    assert reply.file_descriptor_response.file_descriptor_proto


@pytest.mark.timeout(120)
def test_model_info_describes_model_and_kv_cache(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name
    assert info.block_size == 16
    assert info.max_model_len == 2048
    assert info.vocab_size > 1000
    assert info.num_blocks == server.metrics()["pagedinfer_kv_cache_blocks_total"]


@pytest.mark.timeout(120)
def test_streamed_chat_completion(server):
    responses = collect(server.generate(messages=CHAT, sampling=greedy(12)))
    assert len(responses) > 1, "the answer arrives in pieces"
    *pieces, last = responses
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in pieces)
    assert last.finish_reason in (pb.STOP, pb.LENGTH)
    assert {r.request_id for r in responses} == {last.request_id}
    text = "".join(r.text for r in responses)
    assert text.strip()
    token_ids = [t for r in responses for t in r.token_ids]
    assert last.usage.completion_tokens == len(token_ids)
    prompt_ids = server.stub.Tokenize(pb.TokenizeRequest(messages=CHAT), timeout=10).token_ids
    assert last.usage.prompt_tokens == len(prompt_ids) > 0


@pytest.mark.timeout(120)
def test_greedy_output_is_reproducible_and_prompt_is_cached(server):
    prompt = "The history of the printing press begins " * 4  # several full blocks
    first = collect(server.generate(prompt=prompt, sampling=greedy(4)))
    again = collect(server.generate(prompt=prompt, sampling=greedy(4)))
    assert [t for r in first for t in r.token_ids] == [t for r in again for t in r.token_ids]
    assert again[-1].usage.cached_tokens >= 16


@pytest.mark.timeout(120)
def test_parallel_samples_and_logprobs(server):
    responses = collect(server.generate(
        prompt="Once upon a time", request_id="samples-1",
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=2, logprobs=2,
                                   ignore_eos=True)))  # fmt: skip
    finished = {r.index: r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert set(finished) == {0, 1}
    assert all(f.finish_reason == pb.LENGTH and f.usage.completion_tokens == 4
               for f in finished.values())  # fmt: skip
    assert {r.request_id for r in responses} == {"samples-1"}
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)
        for entry, token in zip(r.logprobs, r.token_ids, strict=True):
            assert entry.token_id == token and entry.logprob <= 0.0
            assert len(entry.top) == 2


@pytest.mark.timeout(240)
def test_sixteen_concurrent_requests_complete_while_metrics_move(server):
    idle = server.wait_all_blocks_free()
    total = idle["pagedinfer_kv_cache_blocks_total"]
    assert idle["pagedinfer_kv_cache_free_ratio"] == 1.0
    assert idle["pagedinfer_kv_cache_blocks_demand"] == 0
    prompt = "Tell me a long story about a lighthouse keeper and the sea. " * 3
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            samples.append(server.metrics())
            time.sleep(0.05)

    def one(i: int) -> list:  # distinct first tokens: no prompt blocks are shared
        return collect(server.generate(prompt=f"{i}: {prompt}",
                                       sampling=greedy(6, ignore_eos=True)))  # fmt: skip

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
    finally:
        done.set()
        scraper.join()
    for responses in results:
        assert responses[-1].finish_reason == pb.LENGTH
        assert responses[-1].usage.completion_tokens == 6
    assert len({r[-1].request_id for r in results}) == 16
    # Under load the pool fills and the autoscaling signal drops ...
    assert min(s["pagedinfer_kv_cache_blocks_free"] for s in samples) < total
    assert min(s["pagedinfer_kv_cache_free_ratio"] for s in samples) < 1.0
    assert max(s["pagedinfer_kv_cache_blocks_demand"] for s in samples) > 0
    assert max(s["pagedinfer_requests_running"] for s in samples) > 1
    assert all(s["pagedinfer_kv_cache_blocks_total"] == total for s in samples)
    # ... and recovers once the requests are done.
    after = server.wait_all_blocks_free()
    assert after["pagedinfer_kv_cache_blocks_demand"] == 0
    queried = after["pagedinfer_prefix_cache_queries_total"]
    assert queried > idle["pagedinfer_prefix_cache_queries_total"]


@pytest.mark.timeout(120)
def test_cancelling_mid_stream_frees_every_block(server):
    total = server.wait_all_blocks_free()["pagedinfer_kv_cache_blocks_total"]
    call = server.generate(prompt="A very long essay on paging. " * 20,
                           sampling=greedy(600, ignore_eos=True))  # fmt: skip
    first = next(call)
    assert first.token_ids
    held = server.metrics()
    assert held["pagedinfer_kv_cache_blocks_free"] < total
    assert held["pagedinfer_requests_running"] == 1
    call.cancel()
    server.wait_all_blocks_free(timeout=10)


@pytest.mark.timeout(120)
def test_expired_deadline_aborts_the_request(server):
    server.wait_all_blocks_free()
    before = server.aborts()
    call = server.generate(prompt="Count to a thousand:", timeout=1.5,
                           sampling=greedy(1000, ignore_eos=True))  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        collect(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_all_blocks_free(timeout=10)
    deadline = time.monotonic() + 30  # counted once the call's handler has ended
    while server.aborts() < before + 1:
        assert time.monotonic() < deadline, "the cut request was never counted as an abort"
        time.sleep(0.05)
    assert server.aborts() == before + 1


@pytest.mark.timeout(120)
def test_client_streams_a_chat_answer_to_the_terminal(server):
    out = io.StringIO()
    rc = generate_remote(f"127.0.0.1:{server.port}", prompt=None,
                         messages=[{"role": "user", "content": "Say hello."}],
                         params=SamplingParams(max_tokens=4, temperature=0.0), out=out)  # fmt: skip
    assert rc == 0
    assert out.getvalue().strip()
    rc = generate_remote(f"127.0.0.1:{server.port}", prompt="hi", messages=None,
                         params=SamplingParams(max_tokens=4000), out=io.StringIO())  # fmt: skip
    assert rc == 2


# ------------------------------------------------------------------- bad input


def invalid_cases(vocab_size: int = 49152, max_model_len: int = 2048):
    """(case id, request fields, the field the error must name)."""
    ok = greedy(4)
    return [
        ("empty prompt", {"prompt": "", "sampling": ok}, "prompt"),
        ("no input", {"sampling": ok}, "prompt"),
        ("prompt and token ids", {"prompt": "hi", "prompt_token_ids": [1, 2], "sampling": ok},
         "prompt_token_ids"),
        ("prompt and messages", {"prompt": "hi", "messages": CHAT, "sampling": ok}, "messages"),
        ("token id beyond vocabulary", {"prompt_token_ids": [1, vocab_size], "sampling": ok},
         "prompt_token_ids"),
        ("negative token id", {"prompt_token_ids": [1, -3], "sampling": ok}, "prompt_token_ids"),
        ("max_tokens 0", {"prompt": "hi", "sampling": greedy(0)}, "max_tokens"),
        ("max_tokens beyond max_model_len",
         {"prompt": "hi", "sampling": greedy(max_model_len + 1)}, "max_tokens"),
        ("max_tokens beyond the KV cache", {"prompt": "hi", "sampling": greedy(1999)},
         "max_tokens"),
        ("prompt longer than max_model_len",
         {"prompt_token_ids": [42] * (max_model_len + 5), "sampling": ok}, "prompt"),
        ("negative temperature",
         {"prompt": "hi", "sampling": pb.SamplingParams(temperature=-0.5)}, "temperature"),
        ("NaN temperature",
         {"prompt": "hi", "sampling": pb.SamplingParams(temperature=math.nan)}, "temperature"),
        ("top_p 0", {"prompt": "hi", "sampling": pb.SamplingParams(top_p=0.0)}, "top_p"),
        ("top_p above 1", {"prompt": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, "top_p"),
        ("top_k below -1", {"prompt": "hi", "sampling": pb.SamplingParams(top_k=-2)}, "top_k"),
        ("min_p above 1", {"prompt": "hi", "sampling": pb.SamplingParams(min_p=1.5)}, "min_p"),
        ("repetition_penalty 0",
         {"prompt": "hi", "sampling": pb.SamplingParams(repetition_penalty=0.0)},
         "repetition_penalty"),
        ("presence_penalty 3",
         {"prompt": "hi", "sampling": pb.SamplingParams(presence_penalty=3.0)},
         "presence_penalty"),
        ("frequency_penalty -3",
         {"prompt": "hi", "sampling": pb.SamplingParams(frequency_penalty=-3.0)},
         "frequency_penalty"),
        ("n 0", {"prompt": "hi", "sampling": pb.SamplingParams(n=0)}, "n "),
        ("n absurdly large", {"prompt": "hi", "sampling": pb.SamplingParams(n=1_000_000)}, "n "),
        ("negative seed", {"prompt": "hi", "sampling": pb.SamplingParams(seed=-1)}, "seed"),
        ("empty stop string", {"prompt": "hi", "sampling": pb.SamplingParams(stop=["ok", ""])},
         "stop"),
        ("negative stop token id",
         {"prompt": "hi", "sampling": pb.SamplingParams(stop_token_ids=[-1])}, "stop_token_ids"),
        ("too many logprobs", {"prompt": "hi", "sampling": pb.SamplingParams(logprobs=1000)},
         "logprobs"),
        ("unknown chat role",
         {"messages": [pb.ChatMessage(role="wizard", content="hi")], "sampling": ok}, "role"),
    ]  # fmt: skip


@pytest.mark.timeout(180)
def test_invalid_input_is_invalid_argument_naming_the_field(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    cases = invalid_cases(info.vocab_size, info.max_model_len)
    assert len(cases) >= 20
    failures = []
    for name, request, field in cases:
        try:
            collect(server.generate(timeout=30, **request))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in exc.details():
                failures.append(f"{name}: {exc.code().name}: {exc.details()}")
        else:
            failures.append(f"{name}: accepted")
    assert not failures, "\n".join(failures)
    # The server is unharmed and nothing leaked.
    responses = collect(server.generate(prompt="Still there?", sampling=greedy(3)))
    assert responses[-1].finish_reason in (pb.STOP, pb.LENGTH)
    server.wait_all_blocks_free()


@pytest.mark.timeout(60)
def test_tokenize_rejects_bad_input_naming_the_field(server):
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Tokenize(pb.TokenizeRequest(prompt=""), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in info.value.details()
    ids = server.stub.Tokenize(pb.TokenizeRequest(prompt="hello world"), timeout=10).token_ids
    assert len(ids) >= 2


@pytest.mark.timeout(120)
def test_duplicate_request_id_is_invalid_argument(server):
    call = server.generate(prompt="Write a poem.", request_id="dup-1",
                           sampling=greedy(500, ignore_eos=True))  # fmt: skip
    next(call)
    try:
        with pytest.raises(grpc.RpcError) as info:
            collect(server.generate(prompt="hi", request_id="dup-1", sampling=greedy(2)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in info.value.details()
    finally:
        call.cancel()
    server.wait_all_blocks_free()


# ------------------------------------------- authentication, TLS and backpressure


@pytest.mark.timeout(120)
def test_missing_or_wrong_token_is_unauthenticated(strict_server):
    stub = strict_server.stub
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            collect(stub.Generate(pb.GenerateRequest(prompt="hi", sampling=greedy(2)),
                                  metadata=metadata, timeout=10))  # fmt: skip
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Probes cannot send credentials: health stays open.
    health = health_pb2_grpc.HealthStub(strict_server.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The right token over TLS works.
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=strict_server.metadata, timeout=10)
    assert info.model_name


@pytest.mark.timeout(180)
def test_full_waiting_queue_is_resource_exhausted(strict_server):
    strict_server.wait_all_blocks_free()
    long = greedy(600, ignore_eos=True)
    running = strict_server.generate(prompt="First request:", sampling=long)
    next(running)  # admitted: the one running sequence
    waiting = strict_server.generate(prompt="Second request:", sampling=long)
    first_of_waiting = ThreadPoolExecutor(1).submit(next, waiting)
    try:
        strict_server.wait_for_metric("pagedinfer_requests_waiting", lambda v, m: v == 1)
        with pytest.raises(grpc.RpcError) as info:
            collect(strict_server.generate(prompt="Third request:", sampling=greedy(2)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in info.value.details()
    finally:
        running.cancel()
        waiting.cancel()
    with pytest.raises(grpc.RpcError):
        first_of_waiting.result(timeout=30)
    strict_server.wait_all_blocks_free()
    # Backpressure is temporary: with the queue drained, requests are served again.
    responses = collect(strict_server.generate(prompt="Fourth request:", sampling=greedy(2)))
    assert responses[-1].finish_reason in (pb.STOP, pb.LENGTH)


# -------------------------------------------------------------------- shutdown


@pytest.mark.timeout(180)
def test_sigterm_lets_running_requests_finish_and_aborts_the_rest(strict_server):
    """Runs last: it stops the strict server (one sequence at a time, grace period 5 s).

    Nothing here waits on the machine's speed: the running request needs a few more
    steps, which any CPU takes within the grace period, and the other, queued behind it
    or refused at the signal, asks for more tokens than a 135M model decodes on one
    thread in that time (over 400 a second)."""
    server = strict_server
    server.wait_all_blocks_free()
    short = server.generate(prompt="Short:", sampling=greedy(SHORT_TOKENS, ignore_eos=True))
    first_short = next(short)  # running
    long = server.generate(prompt="Long:", sampling=greedy(LONG_TOKENS, ignore_eos=True))
    server.process.send_signal(signal.SIGTERM)
    rest = collect(short)
    assert rest[-1].finish_reason == pb.LENGTH
    assert len(first_short.token_ids) + sum(len(r.token_ids) for r in rest) == SHORT_TOKENS
    with pytest.raises(grpc.RpcError) as info:
        collect(long)  # cannot finish within the grace period
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert server.process.wait(60) == 0
    log = server.log_tail()
    assert '"msg": "shutting down"' in log and '"msg": "stopped"' in log


def test_a_server_stopped_while_its_kernels_still_compile_exits_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an empty kernel cache the CPU backend compiles in the background while the
    torch forward serves, and logs its progress: each warm-up step, each kernel compiled
    and a heartbeat, with the seconds since it began. A SIGTERM then must still end the
    process with status 0 (not an abort from LLVM torn down under the compile)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "empty-numba-cache"))
    monkeypatch.delenv("PAGEDINFER_NUMBA_PREBUILT", raising=False)
    server = start_server(tmp_path)
    try:
        reply = next(iter(server.stub.Generate(
            pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2)),
            metadata=server.metadata, timeout=120,
        )))  # fmt: skip
        assert reply.token_ids
        step = wait_for_log(server, r"CPU executor: warm-up step 1 of (\d+), 0 kernels compiled")
        # The first kernel alone compiles for minutes; a heartbeat says it is moving.
        beat = wait_for_log(
            server, r"CPU executor: still compiling, warm-up step (\d+) of (\d+), "
            r"(\d+) kernels compiled, (\d+) s"
        )  # fmt: skip
        assert beat.group(2) == step.group(1) and int(beat.group(4)) > 0
    finally:
        code = stop_server(server)
    log = server.log.read_text()
    assert code == 0, log[-4000:]
    assert "still compile in the background" in log
    assert "compiling the kernels in a child process" in log
    # Every line is JSON, gRPC's own when the backend forks its compiler too.
    for line in log.splitlines():
        assert isinstance(json.loads(line), dict), line


def wait_for_log(server: Server, pattern: str, timeout: float = 600) -> re.Match:
    """The first match of `pattern` in the server's log, once it is there."""
    deadline = time.monotonic() + timeout
    while (found := re.search(pattern, server.log.read_text())) is None:
        assert server.process.poll() is None, server.log_tail()
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{server.log_tail()}"
        time.sleep(0.5)
    return found


def _serve_args(port: int, http_port: int) -> list[str]:
    return [sys.executable, "-m", "pagedinfer.service.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", "-1", "--http-port", str(http_port),
            "--kv-cache-memory", KV_CACHE]  # fmt: skip


def test_a_taken_port_exits_at_once_though_the_model_has_begun_loading(tmp_path: Path) -> None:
    """The model starts loading before the listeners bind: a port in use must still end
    the process with status 1 and the reason, not wait for (or abort under) the load."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http_port = taken.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(_serve_args(free_port(), http_port), env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot start the server" in done.stderr


def test_a_server_stopped_while_its_model_loads_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM as soon as the listeners are up, seconds before the model is loaded: the
    load thread (torch imports, perhaps numba loading kernels) must not stall or abort
    the exit."""
    log = tmp_path / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        process = subprocess.Popen(_serve_args(*free_ports(2)), env=env, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 120
        while "listening; loading the model" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert "stopped while loading the model" in text, text[-2000:]
