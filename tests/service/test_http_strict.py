"""The HTTP API of a locked-down server: TLS with the gRPC server's certificate flags, a
bearer token, one running sequence and a waiting queue of one; the last test stops it
with SIGTERM while a stream is in flight."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
from pathlib import Path

import openai
import pytest
from test_server import Server, make_certificate, start_server, stop_server

pytestmark = pytest.mark.slow

TOKEN = "http-s3cret"
PROMPT = "The history of the printing press begins"
GRACE_PERIOD_S = 120  # the drained stream must finish well within it, even on a slow CPU


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("http-tls"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, certificate):
    server = start_server(
        tmp_path_factory.mktemp("http-strict"),
        "--max-num-seqs", "1", "--max-queue", "1", "--grace-period", str(GRACE_PERIOD_S),
        "--max-model-len", "1024", token=TOKEN, tls=certificate,
    )  # fmt: skip
    yield server
    stop_server(server)


class Https:
    def __init__(self, server: Server, cert: Path) -> None:
        self.server = server
        self.context = ssl.create_default_context(cafile=str(cert))

    def connection(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            "127.0.0.1", self.server.http_port, context=self.context, timeout=120
        )

    def request(self, method: str, path: str, body: dict | None = None,
                token: str | None = TOKEN) -> tuple[int, dict, bytes]:  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn = self.connection()
        try:
            conn.request(method, path, json.dumps(body).encode() if body else None, headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def start_stream(self, max_tokens: int) -> tuple[http.client.HTTPSConnection, object]:
        """A streamed completion whose first event has arrived."""
        conn = self.connection()
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200
        while not response.readline().startswith(b"data: "):
            pass
        return conn, response

    def client(self, token: str) -> openai.OpenAI:
        factory = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient
        return openai.OpenAI(
            base_url=f"https://127.0.0.1:{self.server.http_port}/v1",
            api_key=token,
            max_retries=0,
            http_client=factory(verify=self.context),
        )


@pytest.fixture(scope="module")
def https(server, certificate) -> Https:
    return Https(server, certificate[0])


@pytest.mark.timeout(120)
def test_a_missing_or_wrong_token_gets_401(https):
    with pytest.raises(openai.AuthenticationError) as refused:
        https.client("wrong").completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert refused.value.body["code"] == "invalid_api_key"
    status, headers, body = https.request("GET", "/v1/models", token=None)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"]["message"] == "missing or invalid bearer token"
    # Probes and scrapers send no credentials.
    assert https.request("GET", "/health", token=None)[0] == 200
    status, _, metrics = https.request("GET", "/metrics", token=None)
    assert status == 200 and b"vllm:num_requests_running" in metrics


@pytest.mark.timeout(120)
def test_the_token_over_tls_serves(https):
    client = https.client(TOKEN)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                           temperature=0)  # fmt: skip
    assert completion.usage.completion_tokens == 3


@pytest.mark.timeout(240)
def test_a_full_waiting_queue_gets_429(https, server):
    running = https.start_stream(400)  # the one running sequence
    waiting = https.connection()  # fills the queue of one
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    waiting.request("POST", "/v1/completions", body,
                    {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    server.wait_for_metric("pagedinfer_requests_waiting", lambda v, m: v == 1)
    with pytest.raises(openai.RateLimitError) as refused:
        https.client(TOKEN).completions.create(model=None, prompt=PROMPT, max_tokens=2)
    assert refused.value.response.headers["retry-after"] == "1"
    assert "queue is full" in refused.value.body["message"]
    for conn in (running[0], waiting):
        conn.sock.shutdown(2)
        conn.close()
    server.wait_all_blocks_free()


@pytest.mark.timeout(300)
def test_sigterm_drains_in_flight_streams_and_health_turns_503(https, server):
    """Runs last: it stops the server."""
    conn, response = https.start_stream(100)
    server.process.send_signal(signal.SIGTERM)
    status, _, body = https.request("GET", "/health", token=None)
    assert (status, json.loads(body)) == (503, {"status": "draining"})
    status, _, body = https.request("POST", "/v1/completions", {"prompt": PROMPT})
    assert status == 503 and "shutting down" in json.loads(body)["error"]["message"]
    rest = response.read().decode()  # the stream runs to its end
    conn.close()
    events = [e.removeprefix("data: ") for e in rest.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=GRACE_PERIOD_S) == 0
