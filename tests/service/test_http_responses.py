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


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris? Use the tool."


def test_a_function_call_round_trip(api):
    client = api.client()
    first = client.responses.create(
        input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0,
        reasoning={"effort": "none"},
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    # The call and its output go back as input items; the model answers in text.
    second = client.responses.create(
        input=[{"role": "user", "content": ASK}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temp_c": 21}'}],
        tools=[WEATHER], max_output_tokens=20, temperature=0, reasoning={"effort": "none"},
    )  # fmt: skip
    assert second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_streamed_function_call(api):
    events = list(
        api.client().responses.create(
            input=ASK,
            tools=[WEATHER],
            max_output_tokens=60,
            temperature=0,
            stream=True,
            tool_choice={"type": "function", "name": "get_weather"},
            reasoning={"effort": "none"},
        )
    )
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done.arguments
    assert set(json.loads(done.arguments)) == {"city"}
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].call_id == added[0].call_id
