"""The OpenAI-compatible HTTP API, end to end: a real `pagedinfer serve` process on
127.0.0.1 (embedded model, small KV cache), called with the `openai` SDK as
applications call it, and with raw HTTP where the bytes matter (server-sent events,
malformed bodies, dropped connections)."""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from test_server import Server, greedy, start_server, stop_server

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
GRACE_PERIOD_S = 1  # the last test's stream outlives it
MODEL = "pagedinfer-test"  # --served-model-name, first of two
ALIAS = "smollm2"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The history of the printing press begins"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Api:
    """Raw HTTP to the server's HTTP port, and the SDK's client of it."""

    server: Server
    token: str | None = None

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> Reply:  # fmt: skip
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        if self.token:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        conn = self.connection()
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return Reply(response.status, dict(response.getheaders()), response.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any) -> Reply:
        return self.request("POST", path, body)

    def events(self, path: str, body: dict) -> list[str]:
        """The `data:` payloads of a streamed response, [DONE] included."""
        reply = self.post(path, body)
        assert reply.status == 200, reply.body
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.body.decode()
        assert text.endswith("\n\n")
        return [e.removeprefix("data: ") for e in text.strip().split("\n\n")]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.server.http_port}/v1",
            api_key=self.token or "unused",
            max_retries=0,
            timeout=120,
        )

    def metrics(self) -> str:
        reply = self.request("GET", "/metrics")
        assert reply.status == 200
        return reply.body.decode()


def vllm_series(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every vllm: sample of a scrape."""
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(vllm:\S+) (\S+)$", text, re.MULTILINE)
    }


def vllm_value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of `name` whose labels include `labels`."""
    found = []
    for key, value in vllm_series(text).items():
        base, _, rest = key.partition("{")
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(pairs.get(k) == v for k, v in labels.items()):
            found.append(value)
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("http"),
        "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL, ALIAS,
        "--grace-period", str(GRACE_PERIOD_S),
        "--gguf-activations", "fp32",  # the exact logprobs transformers computes
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def api(server) -> Api:
    return Api(server)


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return api.client()


# -------------------------------------------------------------------- basics


@pytest.mark.timeout(120)
def test_health_models_and_served_names(api):
    assert api.request("GET", "/health").status == 200
    models = api.client().models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    card = api.request("GET", "/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.timeout(120)
def test_completion_matches_grpc_and_reports_usage(api, client, server):
    completion = client.completions.create(
        model=ALIAS, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.object == "text_completion"
    assert completion.model == MODEL  # the first served name, whichever was asked for
    (choice,) = completion.choices
    assert choice.finish_reason == "length" and choice.index == 0
    grpc_text = "".join(
        r.text for r in server.generate(prompt=PROMPT, sampling=greedy(8, ignore_eos=True))
    )
    assert choice.text == grpc_text and choice.text.strip()
    tokens = api.post("/tokenize", {"prompt": PROMPT}).json()
    usage = completion.usage
    assert usage.prompt_tokens == tokens["count"] == len(tokens["tokens"])
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8
    assert usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.timeout(120)
def test_every_prompt_form_and_n(client, api):
    ids = api.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=3, n=2, temperature=0.8,
        seed=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.completion_tokens == 4 * 3
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2,
                                      temperature=0)  # fmt: skip
    assert lists.choices[0].text == by_text.choices[0].text[: len(lists.choices[0].text)]
    assert lists.usage.prompt_tokens == len(ids) + 3


@pytest.mark.timeout(120)
def test_seed_stop_and_cached_tokens(client):
    kwargs = dict(model=MODEL, prompt=PROMPT * 4, max_tokens=12, temperature=1.0, seed=11)
    first, again = (client.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].text == again.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # full blocks reused
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=[stop]).choices[0]  # fmt: skip
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]


@pytest.mark.timeout(120)
def test_completion_logprobs_are_openais_format(client):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):  # fmt: skip
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the chosen token is the likeliest
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == completion.choices[0].text


@pytest.mark.timeout(180)
def test_echo_returns_the_prompt_logprobs_the_model_assigns(client, api, default_model_dir):
    import torch
    import transformers

    ids = api.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                           temperature=0, logprobs=1, echo=True)  # fmt: skip
    choice = completion.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir,
                                                              dtype=torch.float32)  # fmt: skip
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=2e-3)
    for i in range(1, len(ids)):  # the likeliest token at each position is in the top entry
        best = reference[i - 1].argmax().item()
        top = logprobs.top_logprobs[i]
        assert max(top.values()) == pytest.approx(reference[i - 1, best].item(), abs=2e-3)
    # max_tokens 0 with echo scores the prompt alone.
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=0,
                                       echo=True)  # fmt: skip
    assert scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=2e-3)
    assert len(scored.choices[0].logprobs.tokens) == len(ids)


@pytest.mark.timeout(120)
def test_streamed_completion_with_usage_ends_with_done(api):
    events = api.events("/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 1,
    })  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *pieces, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in pieces)
    assert [c["choices"][0]["finish_reason"] for c in pieces][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in pieces[:-1])
    tokens = [t for c in pieces for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 10
    whole = api.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 10,
                                         "temperature": 0, "ignore_eos": True}).json()  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in pieces) == whole["choices"][0]["text"]


# ------------------------------------------------------------------------ chat


@pytest.mark.timeout(120)
def test_chat_completion(client, server):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                          temperature=0)  # fmt: skip
    assert chat.object == "chat.completion"
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    grpc = list(server.generate(messages=[pb.ChatMessage(**m) for m in CHAT],
                                sampling=greedy(12)))  # fmt: skip
    assert choice.message.content == "".join(r.text for r in grpc)
    assert chat.usage.prompt_tokens == grpc[-1].usage.prompt_tokens
    parts = client.chat.completions.create(
        model=MODEL, max_completion_tokens=12, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}],
    )  # fmt: skip
    assert parts.choices[0].message.content == choice.message.content


@pytest.mark.timeout(120)
def test_streamed_chat_carries_the_role_first_and_usage_last(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    *pieces, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    finished = [c.choices[0].finish_reason for c in pieces if c.choices[0].finish_reason]
    assert finished in (["stop"], ["length"])
    text = "".join(c.choices[0].delta.content or "" for c in pieces)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                           temperature=0)  # fmt: skip
    assert text == whole.choices[0].message.content
    assert usage.usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.timeout(120)
def test_chat_logprobs_are_openais_chat_format(client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                           temperature=0)  # fmt: skip
    assert plain.choices[0].logprobs is None


@pytest.mark.timeout(120)
def test_tokenize_and_detokenize_round_trip(api):
    ids = api.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert api.post("/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    chat = api.post("/tokenize", {"messages": CHAT}).json()
    assert chat["count"] > len(ids) and chat["max_model_len"] == MAX_MODEL_LEN


# ------------------------------------------------------------------ errors


@pytest.mark.timeout(120)
def test_sdk_raises_its_own_exception_classes(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=5)
    assert bad.value.body["param"] == "temperature"
    assert "temperature" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


LONG = "word " * (MAX_MODEL_LEN + 10)
MID = "word " * (MAX_MODEL_LEN - 100)
C, CH = "/v1/completions", "/v1/chat/completions"


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}).encode()


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}).encode()


# (case, path, raw body, status, the field the error names or a piece of its message)
# fmt: off
BAD_INPUTS = [
    ("malformed JSON", C, b'{"prompt": "hi"', 400, "not valid JSON"),
    ("empty body", C, b"", 400, "not valid JSON"),
    ("body is a list", C, b"[1, 2]", 400, "JSON object"),
    ("invalid UTF-8", C, b'{"model": "x", "prompt": "caf\xe9"}', 400, "not valid JSON"),
    ("lone surrogate", C, b'{"prompt": "\\ud800"}', 400, "not valid JSON"),
    ("NaN temperature", C, completion()[:-1] + b', "temperature": NaN}', 400, "temperature"),
    ("missing prompt", C, b'{"model": "%s"}' % MODEL.encode(), 400, "prompt"),
    ("prompt is a number", C, completion(prompt=5), 400, "prompt"),
    ("prompt mixes types", C, completion(prompt=["a", 1]), 400, "prompt"),
    ("empty prompt", C, completion(prompt=""), 400, "prompt"),
    ("empty prompt list", C, completion(prompt=[]), 400, "prompt"),
    ("empty token list", C, completion(prompt=[[]]), 400, "prompt"),
    ("token id past the vocabulary", C, completion(prompt=[10**7]), 400, "prompt"),
    ("negative token id", C, completion(prompt=[-1, 5]), 400, "prompt"),
    ("prompt longer than max_model_len", C, completion(prompt=LONG), 400, "prompt"),
    ("max_tokens past max_model_len", C, completion(max_tokens=10**6), 400, "max_tokens"),
    ("prompt + max_tokens past max_model_len", C, completion(prompt=MID, max_tokens=200), 400,
     "max_tokens"),
    ("max_tokens as a string", C, completion(max_tokens="8"), 400, "max_tokens"),
    ("max_tokens as a float", C, completion(max_tokens=8.0), 400, "max_tokens"),
    ("negative max_tokens", C, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens 0 without echo", C, completion(max_tokens=0), 400, "max_tokens"),
    ("temperature out of range", C, completion(temperature=2.5), 400, "temperature"),
    ("top_p zero", C, completion(top_p=0), 400, "top_p"),
    ("top_k below -1", C, completion(top_k=-2), 400, "top_k"),
    ("min_p above 1", C, completion(min_p=1.5), 400, "min_p"),
    ("presence_penalty out of range", C, completion(presence_penalty=3), 400,
     "presence_penalty"),
    ("frequency_penalty out of range", C, completion(frequency_penalty=-3), 400,
     "frequency_penalty"),
    ("repetition_penalty zero", C, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("n zero", C, completion(n=0), 400, "n"),
    ("n too large", C, completion(n=1000), 400, "n"),
    ("best_of unsupported", C, completion(best_of=3), 400, "best_of"),
    ("logprobs too large", C, completion(logprobs=50), 400, "logprobs"),
    ("negative seed", C, completion(seed=-1), 400, "seed"),
    ("seed as a string", C, completion(seed="x"), 400, "seed"),
    ("too many stop strings", C, completion(stop=[f"s{i}" for i in range(65)]), 400, "stop"),
    ("empty stop string", C, completion(stop=[""]), 400, "stop"),
    ("stop is a number", C, completion(stop=5), 400, "stop"),
    ("stop token id past the vocabulary", C, completion(stop_token_ids=[10**7]), 400,
     "stop_token_ids"),
    ("stream as a string", C, completion(stream="yes"), 400, "stream"),
    ("echo as an integer", C, completion(echo=1), 400, "echo"),
    ("stream_options without stream", C, completion(stream_options={"include_usage": True}),
     400, "stream_options"),
    ("unknown stream_options field", C,
     completion(stream=True, stream_options={"include_usage": True, "x": 1}), 400,
     "stream_options.x"),
    ("unknown field", C, completion(foo=1), 400, "foo"),
    ("logit_bias out of range", C, completion(logit_bias={"1": 500}), 400, "logit_bias"),
    ("logit_bias key not a token id", C, completion(logit_bias={"a": 5}), 400, "logit_bias"),
    ("suffix unsupported", C, completion(suffix="!"), 400, "suffix"),
    ("unknown model", C, completion(model="gpt-9"), 404, "model"),
    ("empty messages", CH, chat(messages=[]), 400, "messages"),
    ("missing messages", CH, b'{"model": "%s"}' % MODEL.encode(), 400, "messages"),
    ("messages is a string", CH, chat(messages="hi"), 400, "messages"),
    ("unknown role", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role"),
    ("message without a role", CH, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("content is a number", CH, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content"),
    ("image content", CH,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages[0].content"),
    ("chat prompt longer than max_model_len", CH,
     chat(messages=[{"role": "user", "content": LONG}], max_tokens=None), 400, "messages"),
    ("max_completion_tokens zero", CH, chat(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("top_logprobs without logprobs", CH, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs too large", CH, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("logprobs as an integer", CH, chat(logprobs=2), 400, "logprobs"),
    ("tool without a function", CH, chat(tools=[{"type": "function"}]), 400, "tools"),
    ("unknown response_format", CH, chat(response_format={"type": "xml"}), 400,
     "response_format.type"),
    ("unknown chat model", CH, chat(model="gpt-9"), 404, "model"),
    ("tokenize both inputs", "/tokenize", json.dumps({"prompt": "a", "messages": CHAT}).encode(),
     400, "prompt"),
    ("detokenize bad ids", "/detokenize", b'{"tokens": [-5]}', 400, "tokens"),
]
# fmt: on


def check_refusal(reply: Reply, status: int, names: str) -> str:
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert names == error["param"] or names in error["message"], error
    return error["message"]


@pytest.mark.timeout(300)
def test_bad_inputs_get_4xx_openai_errors_and_leak_nothing(api, server):
    for case, path, body, status, names in BAD_INPUTS:
        reply = api.request("POST", path, body)
        try:
            check_refusal(reply, status, names)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
    assert len(BAD_INPUTS) >= 30
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", C, 405)):
        check_refusal(api.request(method, path), status, "")
    # The server still serves, and holds no request and no block.
    assert api.post(C, completion()).status == 200
    server.wait_all_blocks_free()


# --------------------------------------------------------- disconnects and load


def wait_running(server: Server, timeout: float = 60) -> None:
    server.wait_for_metric("pagedinfer_requests_running", lambda v, m: v >= 1, timeout)


def aborts(api: Api) -> float:
    return vllm_value(api.metrics(), "vllm:request_success_total", model_name=MODEL,
                      finished_reason="abort")  # fmt: skip


def wait_aborts(api: Api, count: float, timeout: float = 30) -> None:
    """The abort counter reaches `count`: the server counts a request once its stream
    has been torn down, a moment after the client left."""
    deadline = time.monotonic() + timeout
    while aborts(api) < count:
        assert time.monotonic() < deadline, f"aborts stayed at {aborts(api)}, not {count}"
        time.sleep(0.05)
    assert aborts(api) == count


@pytest.mark.timeout(180)
def test_a_stream_cancelled_midway_frees_its_blocks(api, server):
    before = aborts(api)
    conn = api.connection()
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True})  # fmt: skip
    conn.request("POST", C, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:  # a few tokens have arrived: the request holds blocks
        line = response.readline()
        events += line.startswith(b"data: ")
    used = server.metrics()
    assert used["pagedinfer_kv_cache_blocks_free"] < used["pagedinfer_kv_cache_blocks_total"]
    conn.sock.shutdown(2)
    conn.close()
    server.wait_all_blocks_free()
    wait_aborts(api, before + 1)  # counted as vLLM counts a cut request


@pytest.mark.timeout(180)
def test_a_client_gone_before_its_whole_response_frees_its_blocks(api, server):
    before = aborts(api)
    conn = api.connection()
    body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True})  # fmt: skip
    conn.request("POST", CH, body=body, headers={"Content-Type": "application/json"})
    wait_running(server)
    conn.sock.shutdown(2)
    conn.close()
    server.wait_all_blocks_free()
    wait_aborts(api, before + 1)


@pytest.mark.timeout(240)
def test_vllm_metrics_under_load(api, server):
    before = api.metrics()
    streams, max_tokens = 6, 40
    replies: list[Reply] = []

    def one(i: int) -> None:
        replies.append(api.post(C, {"model": MODEL, "prompt": f"{PROMPT} {i}", "stream": True,
                                    "max_tokens": max_tokens, "ignore_eos": True}))  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while True:
        text = api.metrics()
        running = vllm_value(text, "vllm:num_requests_running", model_name=MODEL)
        usage = vllm_value(text, "vllm:kv_cache_usage_perc", model_name=MODEL)
        if running >= 1 and usage > 0:
            break
        assert time.monotonic() < deadline, "no request was ever seen running"
        time.sleep(0.05)
    assert 0 < usage <= 1
    assert vllm_value(text, "vllm:num_requests_waiting", model_name=MODEL) >= 0
    for t in threads:
        t.join()
    assert [r.status for r in replies] == [200] * streams
    server.wait_all_blocks_free()
    after = api.metrics()
    total = server.metrics()["pagedinfer_kv_cache_blocks_total"]
    info = vllm_value(after, "vllm:cache_config_info", model_name=MODEL, block_size="16",
                      num_gpu_blocks=str(int(total)))  # fmt: skip
    assert info == 1
    assert vllm_value(after, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0

    def grew(name: str, **labels: str) -> float:
        return vllm_value(after, name, model_name=MODEL, **labels) - vllm_value(
            before, name, model_name=MODEL, **labels
        )

    assert grew("vllm:request_success_total", finished_reason="length") == streams
    assert grew("vllm:generation_tokens_total") == streams * max_tokens
    assert grew("vllm:prompt_tokens_total") >= streams * 5
    assert grew("vllm:time_to_first_token_seconds_count") == streams
    assert grew("vllm:e2e_request_latency_seconds_count") == streams
    assert grew("vllm:request_queue_time_seconds_count") == streams
    assert grew("vllm:inter_token_latency_seconds_count") == streams * (max_tokens - 1)
    assert grew("vllm:prefix_cache_queries_total") > 0
    assert vllm_value(after, "vllm:num_preemptions_total", model_name=MODEL) >= 0
    # The metrics port shows the same vllm: series.
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as page:
        scraped = page.read().decode()
    assert vllm_value(scraped, "vllm:generation_tokens_total", model_name=MODEL) == vllm_value(
        after, "vllm:generation_tokens_total", model_name=MODEL
    )


@pytest.mark.timeout(180)
def test_a_stream_still_running_at_the_drain_deadline_ends_with_an_error(api, server):
    """Runs last: it stops the server."""
    conn = api.connection()
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                       "stream": True})  # fmt: skip
    conn.request("POST", C, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    server.process.send_signal(signal.SIGTERM)
    events = [e.removeprefix("data: ") for e in response.read().decode().strip().split("\n\n")]
    conn.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "the server shut down before the response was complete"
    assert server.process.wait(timeout=60) == 0
