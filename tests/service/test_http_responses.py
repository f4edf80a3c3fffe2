"""POST /v1/responses, called with the `openai` SDK's `responses.create` and raw HTTP, on
the thinking-template server of `test_http_reasoning` (so a Response carries a
reasoning item next to its message)."""

from __future__ import annotations

import json

import pytest
from test_http_api import Api
from test_http_reasoning import CHAT, THINKING_TEMPLATE
from test_server import start_server, stop_server

pytestmark = pytest.mark.slow

INPUT = [
    {"type": "message", "role": m["role"],
     "content": m["content"] if m["role"] == "user"
     else [{"type": "output_text", "text": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}]}
    for m in CHAT
]  # fmt: skip


@pytest.fixture(scope="module")
def api(tmp_path_factory, default_model_dir):
    directory = tmp_path_factory.mktemp("thinking-model-responses")
    for file in default_model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (directory / file.name).symlink_to(file)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = start_server(
        tmp_path_factory.mktemp("http-responses"), "--model", str(directory),
        "--max-model-len", "512", "--reasoning-parser", "qwen3",
    )  # fmt: skip
    yield Api(server)
    stop_server(server)


def chat_answer(api: Api, max_tokens: int) -> dict:
    """The chat API's answer to the same conversation, for comparison."""
    messages = [{"role": m["role"], "content": m["content"][0]["text"]
                 if isinstance(m["content"], list) else m["content"]} for m in INPUT]  # fmt: skip
    reply = api.post("/v1/chat/completions",
                     {"messages": messages, "max_tokens": max_tokens, "temperature": 0})  # fmt: skip
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]["message"]


def test_sdk_response_carries_reasoning_and_message_items(api):
    expected = chat_answer(api, 32)
    assert expected["reasoning_content"] and expected["content"]
    model = api.request("GET", "/v1/models").json()["data"][0]["id"]
    response = api.client().responses.create(
        model=model,
        input=INPUT,
        max_output_tokens=32,
        temperature=0,
        store=False,
    )
    assert response.status == "completed"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == expected["reasoning_content"]
    assert response.output_text == expected["content"]
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0


def test_instructions_and_a_string_input(api):
    response = api.client().responses.create(
        input="Name a colour.", instructions="Answer in one word.", max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert response.instructions == "Answer in one word."
    assert response.output_text
    with_system = api.post("/tokenize", {"messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour."}]}).json()  # fmt: skip
    assert response.usage.input_tokens == with_system["count"]


def test_max_output_tokens_makes_an_incomplete_response(api):
    reply = api.post("/v1/responses", {"input": INPUT, "max_output_tokens": 3, "temperature": 0})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3
    assert body["store"] is False


def test_a_stream_sends_the_responses_events(api):
    expected = chat_answer(api, 32)
    events = list(
        api.client().responses.create(input=INPUT, max_output_tokens=32, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == expected["reasoning_content"]
    assert text == expected["content"]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message"]
    final = events[-1].response
    assert final.output_text == expected["content"]
    assert final.usage.output_tokens > 0


def test_raw_stream_names_each_event(api):
    reply = api.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": True})
    assert reply.status == 200
    blocks = reply.body.decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert json.loads(blocks[-1].split("\n")[1][6:])["type"] == "response.incomplete"


def test_text_format_json_schema_constrains_the_answer(api):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    body = {"input": "What is 2+2? Reply in JSON.", "max_output_tokens": 40, "temperature": 1,
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "sum", "schema": schema}}}  # fmt: skip
    reply = api.post("/v1/responses", body)
    assert reply.status == 200, reply.body
    response = reply.json()
    answer = json.loads(response["output"][-1]["content"][0]["text"])
    assert set(answer) == {"answer"} and isinstance(answer["answer"], int)
    assert response["text"]["format"]["name"] == "sum"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "Hi", "store": True}, "store", "keeps no responses"),
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "replay"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type", "not served"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens", "max_model_len"),
        ({"input": "Hi", "include": ["file_search_call.results"]}, "include", "cannot be included"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema"}}}, "text.format", "a name and a schema"),
        ({"input": "Hi", "stream_options": {}}, "stream_options", "unknown field"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(api, body, param, words):
    reply = api.post("/v1/responses", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
