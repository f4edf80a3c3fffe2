"""Reasoning over the HTTP API, and the smaller sampling fields clients send.

A `pagedinfer serve` process with `--reasoning-parser qwen3` on the embedded model, whose
chat template is replaced by a Qwen3-style thinking template (a `<think>` block before
each assistant answer, and an empty block in the prompt when `enable_thinking` is
false). Few-shot turns in that format make the model write its own thinking block, so the
split is checked on real generated text; `<think>` is several tokens in this vocabulary,
so a stream delivers the tag in pieces.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_http_api import Api
from test_server import start_server, stop_server

from pagedinfer.service.reasoning import REASONING_PARSERS

pytestmark = pytest.mark.slow

THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ message.content }}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
EMPTY_BLOCK = "<think>\n\n</think>\n\n"
SHOTS = [("2+2?", "add two and two", "4."), ("3+3?", "add three and three", "6."),
         ("5+5?", "add five and five", "10.")]  # fmt: skip
CHAT = [
    *(
        m
        for question, thought, answer in SHOTS
        for m in (
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer, "reasoning_content": thought},
        )
    ),
    {"role": "user", "content": "4+4?"},
]
QWEN3 = REASONING_PARSERS["qwen3"]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, default_model_dir: Path) -> Path:
    """The embedded model's files with the thinking chat template."""
    directory = tmp_path_factory.mktemp("thinking-model")
    for file in default_model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (directory / file.name).symlink_to(file)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def api(tmp_path_factory, thinking_model):
    server = start_server(
        tmp_path_factory.mktemp("http-reasoning"), "--model", str(thinking_model),
        "--max-model-len", "512", "--reasoning-parser", "qwen3",
    )  # fmt: skip
    yield Api(server)
    stop_server(server)


def chat(**extra) -> dict:
    return {"messages": CHAT, "max_tokens": 32, "temperature": 0, **extra}


def raw_output(api: Api, body: dict) -> tuple[str, list[int]]:
    """The unsplit text of the same greedy request, through /v1/completions on the
    prompt's token ids."""
    tokens = api.post("/tokenize", {"messages": body["messages"]}).json()["tokens"]
    reply = api.post("/v1/completions", {"prompt": tokens, "max_tokens": body["max_tokens"],
                                         "temperature": 0})  # fmt: skip
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]["text"], tokens


def test_the_thinking_moves_to_reasoning_content(api):
    raw, tokens = raw_output(api, chat())
    reasoning, content = QWEN3.split(raw, "")
    assert raw.startswith("<think>") and reasoning and content  # the model thought, then answered
    reply = api.post("/v1/chat/completions", chat())
    assert reply.status == 200, reply.body
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == reasoning
    assert message["content"] == content
    assert "<think>" not in content and "</think>" not in content
    assert reply.json()["usage"]["prompt_tokens"] == len(tokens)


def test_a_stream_splits_the_same_way_with_the_tag_in_pieces(api):
    tokenizer_ids = api.post("/tokenize", {"prompt": "<think>"}).json()["tokens"]
    assert len(tokenizer_ids) > 1  # the tag arrives over several tokens
    whole = api.post("/v1/chat/completions", chat()).json()["choices"][0]["message"]
    events = api.events("/v1/chat/completions", chat(stream=True))
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert len(reasoning) > 1 and content
    assert "".join(reasoning) == whole["reasoning_content"]
    assert "".join(content) == whole["content"]
    assert not any("<" in piece for piece in reasoning)


def test_enable_thinking_false_reaches_the_template(api):
    on = api.post("/v1/chat/completions", chat(max_tokens=4)).json()
    off = api.post(
        "/v1/chat/completions", chat(max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    ).json()
    block = api.post("/tokenize", {"prompt": EMPTY_BLOCK}).json()["count"]
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + block


def test_continue_final_message_goes_on_inside_an_open_thinking_block(api):
    messages = [*CHAT, {"role": "assistant", "content": "<think>\nadd four"}]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    reply = api.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    message = reply.json()["choices"][0]["message"]
    # The prompt ends inside the block: the continuation is thinking until its end tag.
    assert message["reasoning_content"] and message["reasoning_content"].startswith("and four")
    assert message["content"]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "an object"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
    ],
)
def test_bad_fields_are_refused_naming_them(api, extra, param, words):
    reply = api.post("/v1/chat/completions", chat(**extra))
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_sixty_four_stop_strings_are_served(api):
    reply = api.post("/v1/chat/completions", chat(stop=[f"zz{i}" for i in range(63)] + ["add"]))
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["finish_reason"] == "stop"


def test_logit_bias_and_min_tokens_over_http(api):
    eos = api.post("/tokenize", {"prompt": "<|im_end|>"}).json()["tokens"]
    assert len(eos) == 1
    forced = api.post("/tokenize", {"prompt": " banana"}).json()["tokens"][0]
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}}
    reply = api.post("/v1/completions", body).json()
    assert reply["choices"][0]["text"] == " banana" * 4
    eos_first = {str(eos[0]): 100}
    short = api.post("/v1/chat/completions", chat(logit_bias=eos_first)).json()
    held = api.post("/v1/chat/completions", chat(logit_bias=eos_first, min_tokens=3)).json()
    assert short["usage"]["completion_tokens"] == 1
    assert held["usage"]["completion_tokens"] == 4
    assert held["choices"][0]["finish_reason"] == "stop"


def test_a_json_schema_constrains_the_answer_after_the_thinking(api):
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}},
              "required": ["sum"], "additionalProperties": False}  # fmt: skip
    body = chat(max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})  # fmt: skip
    reply = api.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning_content"]  # the model still thinks first
    answer = json.loads(message["content"])
    assert set(answer) == {"sum"} and isinstance(answer["sum"], int)


def test_prompt_logprobs_score_every_prompt_token(api):
    ids = api.post("/tokenize", {"prompt": "The capital of France is Paris"}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = api.post("/v1/completions", body).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    echoed = api.post("/v1/completions", {**body, "prompt_logprobs": None, "echo": True,
                                          "logprobs": 2}).json()["choices"][0]["logprobs"]  # fmt: skip
    echoed_logprobs = echoed["token_logprobs"][1 : len(ids)]
    for token, entry, logprob in zip(ids[1:], scored[1:], echoed_logprobs, strict=True):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert own["rank"] >= 1 and own["decoded_token"]
        assert {1, 2} <= {e["rank"] for e in entry.values()}  # the two likeliest
    reply = api.post("/v1/chat/completions", chat(max_tokens=1, prompt_logprobs=0)).json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]


def same_scores(a: list, b: list) -> None:
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert set(x) == set(y)
        for token, entry in x.items():
            assert entry["logprob"] == pytest.approx(y[token]["logprob"], abs=1e-4)
            assert entry["rank"] == y[token]["rank"]


def test_a_chat_stream_sends_the_prompt_logprobs_in_its_first_chunk(api):
    whole = api.post("/v1/chat/completions", chat(max_tokens=4, prompt_logprobs=1)).json()
    body = chat(max_tokens=4, prompt_logprobs=1, n=2, stream=True, seed=3, temperature=1.0,
                stream_options={"include_usage": True})  # fmt: skip
    chunks = [json.loads(e) for e in api.events("/v1/chat/completions", body)[:-1]]
    first, rest = chunks[0], chunks[1:]
    assert first["choices"][0]["index"] == 0 and first["choices"][0]["delta"]["role"]
    assert len(first["prompt_logprobs"]) == chunks[-1]["usage"]["prompt_tokens"]
    same_scores(first["prompt_logprobs"], whole["prompt_logprobs"])
    assert all(c["prompt_logprobs"] is None for c in rest)
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # both roles first


def test_a_completion_stream_sends_each_choice_its_prompt_logprobs_first(api):
    prompts = ["The capital of France is", "Two plus two is"]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    whole = api.post("/v1/completions", body).json()["choices"]
    chunks = [json.loads(e) for e in api.events("/v1/completions", {**body, "n": 2, "stream": True,
                                                                      "seed": 1})[:-1]]  # fmt: skip
    seen: set[int] = set()
    for chunk in chunks:
        (choice,) = chunk["choices"]
        if choice["index"] in seen:
            assert choice["prompt_logprobs"] is None
        else:  # a choice's first chunk: its prompt's scores
            seen.add(choice["index"])
            same_scores(choice["prompt_logprobs"], whole[choice["index"] // 2]["prompt_logprobs"])
    assert seen == {0, 1, 2, 3}


def test_grpc_takes_chat_template_kwargs(api):
    from pagedinfer.service.proto import inference_pb2 as pb

    stub = api.server.stub
    ask = [pb.ChatMessage(role="user", content="4+4?")]
    off = pb.TokenizeRequest(messages=ask)
    off.chat_template_kwargs.update({"enable_thinking": False})
    on_ids = stub.Tokenize(pb.TokenizeRequest(messages=ask), timeout=30).token_ids
    off_ids = stub.Tokenize(off, timeout=30).token_ids
    block = api.post("/tokenize", {"prompt": EMPTY_BLOCK}).json()["count"]
    assert len(off_ids) == len(on_ids) + block and off_ids[: len(on_ids)] == on_ids
    request = pb.GenerateRequest(
        messages=ask, sampling=pb.SamplingParams(max_tokens=6, temperature=0)
    )
    request.chat_template_kwargs.update({"enable_thinking": False})
    replies = list(stub.Generate(request, timeout=120))
    assert replies[-1].usage.prompt_tokens == len(off_ids)
    # The same greedy text as the rendered prompt's ids sent as they are.
    text = api.post("/v1/completions", {"prompt": list(off_ids), "max_tokens": 6,
                                        "temperature": 0}).json()["choices"][0]["text"]  # fmt: skip
    assert "".join(r.text for r in replies) == text
