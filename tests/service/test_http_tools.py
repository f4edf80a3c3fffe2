"""Structured outputs and tool calls over the HTTP API, driven by the `openai` SDK as
applications drive it (`chat.completions.parse`, tools, streamed tool calls), against a
real `pagedinfer serve` with the embedded model; and the tool-call parsers on their own."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_http_api import Api
from test_server import start_server, stop_server

from pagedinfer.service.openai.protocol import ChatCompletionRequest
from pagedinfer.service.openai.tools import ToolPlan, ToolStream
from pagedinfer.service.proto import inference_pb2 as pb
from pagedinfer.service.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Phi4MiniJsonParser,
    PythonicParser,
    default_parser,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    # No other keys: a schema that allows them lets a small model invent many.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tools"), "--max-model-len", "512")
    yield Api(server)
    stop_server(server)


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return api.client()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdk_parse_gives_a_validated_pydantic_object(client, temperature):
    completion = client.chat.completions.parse(
        model=None,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=temperature,
        seed=5,
        max_tokens=120,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City)
    assert City.model_validate_json(choice.message.content) == city


@pytest.mark.slow
def test_required_tool_call_round_trip(client):
    first = client.chat.completions.create(
        model=None, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=100,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    # The call and its result go back in the history; the model answers in text.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    second = client.chat.completions.create(
        model=None, messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=30
    )
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.slow
def test_named_tool_call_streams_as_openai_does(client):
    stream = client.chat.completions.create(
        model=None, messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=100, stream=True,
    )  # fmt: skip
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            assert len(choice.delta.tool_calls or []) <= 1  # one call delta per chunk
            deltas.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    head, *fragments = deltas
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(fragments) > 1 and all(f.id is None and f.index == 0 for f in fragments)
    arguments = "".join(f.function.arguments for f in fragments)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.slow
def test_completions_take_vllm_structured_outputs_and_guided_fields(client):
    choice = client.completions.create(
        model=None, prompt="The answer is", max_tokens=8, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).choices[0]  # fmt: skip
    assert choice.text in {"yes", "no"}
    phone = client.completions.create(
        model=None, prompt="Call me at", max_tokens=12, temperature=0.7,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    ).choices[0]  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"dependentRequired": {"a": ["b"]}}}}},
     "response_format.json_schema.schema", "cannot enforce"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "unknown name"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]},
     "tools[0].function.parameters", "must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "of type object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": "DEEP"}}},
     "response_format.json_schema.schema", "nests deeper than"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_bad_structured_input_is_a_400_naming_the_field(api, fields, param, message):
    if fields.get("response_format", {}).get("json_schema", {}).get("schema") == "DEEP":
        deep: dict = {"type": "string"}
        for _ in range(64):
            deep = {"type": "object", "properties": {"a": deep}}
        fields = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "deep", "schema": deep}}}  # fmt: skip
    reply = api.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **fields})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


@pytest.mark.slow
def test_grpc_sampling_takes_a_structured_output(api):
    schema = WEATHER["function"]["parameters"]
    sampling = pb.SamplingParams(
        max_tokens=60, temperature=1.0, seed=9,
        structured_output=pb.StructuredOutput(json_schema=json.dumps(schema)),
    )  # fmt: skip
    responses = list(api.server.generate(prompt="Weather query as JSON:", sampling=sampling))
    assert responses[-1].finish_reason == pb.STOP
    jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)
    choice = pb.SamplingParams(
        max_tokens=5, structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["x", "y"]))
    )
    responses = list(api.server.generate(prompt="Pick:", sampling=choice))
    assert "".join(r.text for r in responses) in {"x", "y"}
    bad = pb.SamplingParams(structured_output=pb.StructuredOutput(regex="(unclosed"))
    with pytest.raises(grpc.RpcError) as info:
        list(api.server.generate(prompt="Pick:", sampling=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in info.value.details()
    assert "unclosed group" in info.value.details()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "temperature"), [("TOOLS", 1.0), ("JSON_SCHEMA", 0.0)])
def test_instructor_extracts_validated_objects(client, mode, temperature):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model="SmolLM2-135M-Instruct", response_model=City, max_retries=0, temperature=temperature,
        seed=6, max_tokens=120, messages=[{"role": "user", "content": "Describe Tokyo."}],
    )  # fmt: skip
    assert isinstance(city, City) and city.name


# ---------------------------------------------------------------- parsers alone


def test_hermes_parser_splits_content_and_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert HermesParser().parse("no calls here") == ("no calls here", [])


def test_llama3_and_mistral_parsers():
    _, calls = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": "y"})]
    assert Llama3JsonParser().parse("Hello {there}") == ("Hello {there}", [])
    content, calls = MistralParser().parse('Sure[TOOL_CALLS][{"name": "f", "arguments": {"k": 2}}]')
    assert content == "Sure" and [c.name for c in calls] == ["f"]


def test_phi4_mini_and_pythonic_parsers():
    text = '<|tool_call|>[{"name": "f", "arguments": {"a": [1, 2]}}]<|/tool_call|>'
    for shown in (text, text.replace("<|tool_call|>", "").replace("<|/tool_call|>", "")):
        _, calls = Phi4MiniJsonParser().parse(shown)  # the markers may be skipped specials
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": [1, 2]})]
    _, calls = PythonicParser().parse('```tool_code\n[get_weather(city="Paris"), now()]\n```')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    for not_calls in ("[1, 2]", "[f(x)]", "[f(a=open('x'))]", "Hello [world]"):
        assert PythonicParser().parse(not_calls) == (not_calls, [])


def test_default_parser_follows_the_chat_template():
    assert default_parser(None) == "hermes"
    assert default_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_parser("<|tool_call|>{{ tools }}") == "phi4_mini_json"
    assert default_parser("{% if message.role == 'ipython' %}") == "llama3_json"


def test_tool_stream_holds_back_a_forming_marker_and_streams_the_arguments():
    stream = ToolStream(ToolPlan("auto", [], parser=HermesParser()))
    pieces = ["Sure. <tool", '_call>\n{"name": "f", ', '"arguments": {"a": ', '"}"}}\n</tool',
              "_call>\n<tool_call>\n", '{"arguments": {}, "name": "g"}\n</tool_call>']  # fmt: skip
    sent = [stream.feed(p) for p in pieces]
    assert sent[0] == ("Sure. ", [])  # "<tool" may begin a call: held back
    assert sent[1] == ("", [])  # the name, but not yet the arguments
    head, first = sent[2][1]
    assert head["index"] == 0 and head["id"].startswith("call_")
    assert head["function"] == {"name": "f", "arguments": ""}
    assert first == {"index": 0, "function": {"arguments": '{"a": '}}
    # A brace inside a string does not end the arguments; the wrapper's does not belong.
    assert sent[3] == ("", [{"index": 0, "function": {"arguments": '"}"}'}}])
    assert sent[4] == ("", [])
    # Arguments written before the name: the call is sent once complete.
    (head, arguments) = sent[5][1]
    assert head["index"] == 1 and head["function"]["name"] == "g"
    assert arguments == {"index": 1, "function": {"arguments": "{}"}}
    assert stream.finish() == ("", [])  # nothing sent twice


def streamed(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[list[dict]], list[dict]]:
    """(content, the tool deltas of each piece, the calls the deltas add up to) of a
    scripted stream of text pieces, its end included."""
    stream = ToolStream(plan)
    content, per_piece = "", []
    for piece in pieces:
        text, deltas = stream.feed(piece)
        content += text
        per_piece.append(deltas)
    text, deltas = stream.finish()
    content += text
    per_piece.append(deltas)
    calls: list[dict] = []
    for delta in (d for deltas in per_piece for d in deltas):
        if "id" in delta:  # a call's first delta: index, id, type, name, no arguments yet
            assert delta["index"] == len(calls) and delta["id"].startswith("call_")
            assert delta["type"] == "function" and delta["function"]["arguments"] == ""
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        else:
            assert delta["index"] == len(calls) - 1 and set(delta["function"]) == {"arguments"}
            calls[-1]["arguments"] += delta["function"]["arguments"]
    return content, per_piece, calls


def chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}', ""),
        (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}', ""),
        (MistralParser(), 'Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', "Let me look."),
        (Phi4MiniJsonParser(), '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]<|/tool_call|>', ""),
        (Phi4MiniJsonParser(), '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', ""),
        (PythonicParser(), '[get_weather(city="Paris", unit=\'celsius\'), get_time(zone="CET")]', ""),
        (PythonicParser(), '```tool_code\n[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]\n```', ""),
    ],
)  # fmt: skip
def test_every_format_streams_name_first_then_argument_fragments(parser, text, content):
    expected = [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    got_content, per_piece, calls = streamed(ToolPlan("auto", [], parser=parser), chars(text))
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
    # The same calls as the whole text's parse (its IDs aside).
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in parser.parse(text)[1]
    ]
    # The first call's name goes out long before the stream ends, its arguments in pieces
    # as they are written, and nothing is left for the end.
    first = next(i for i, deltas in enumerate(per_piece) if deltas)
    assert first < text.index("Paris")
    fragments = [d for deltas in per_piece for d in deltas if d["index"] == 0 and "id" not in d]
    assert len(fragments) > 1
    assert per_piece[-1] == []


def test_a_call_written_arguments_first_is_sent_once_complete():
    text = '[TOOL_CALLS][{"arguments": {"k": 1}, "name": "f"}, {"name": "g", "arguments": {}}]'
    _, per_piece, calls = streamed(ToolPlan("auto", [], parser=MistralParser()), chars(text))
    assert calls == [{"name": "f", "arguments": '{"k": 1}'}, {"name": "g", "arguments": "{}"}]
    sent_f = next(i for i, deltas in enumerate(per_piece) if deltas)
    assert sent_f == text.index(', {"name": "g"') - 1  # the piece that closed f's object
    assert len(per_piece[sent_f]) == 2  # head and arguments together


def test_text_that_only_looks_like_calls_stays_content():
    for parser, text in [
        (Llama3JsonParser(), '{"answer": 42}'),
        (PythonicParser(), "[1, 2, 3]"),
        (PythonicParser(), "[print(x)]"),  # a positional argument: not a call
        (Phi4MiniJsonParser(), '["a", "b"]'),
    ]:
        content, _, calls = streamed(ToolPlan("auto", [], parser=parser), chars(text))
        assert (content, calls) == (text, [])


def test_required_calls_stream_their_arguments():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    _, per_piece, calls = streamed(ToolPlan("required", []), chars(text))
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}]
    assert next(i for i, deltas in enumerate(per_piece) if deltas) < text.index("Paris")


def test_a_call_cut_short_keeps_what_was_streamed():
    text = '<|tool_call|>[{"name": "f", "arguments": {"a": "unfinis'
    content, _, calls = streamed(ToolPlan("auto", [], parser=Phi4MiniJsonParser()), [text])
    assert content == "" and calls == [{"name": "f", "arguments": '{"a": "unfinis'}]


def test_request_accepts_tool_history():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        }
    )  # fmt: skip
    assert request.messages[1].tool_calls[0].function.name == "get_weather"


@pytest.fixture(scope="module")
def excluding(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tools-excluded"), "--max-model-len", "512",
                          "--exclude-tools-when-tool-choice-none")  # fmt: skip
    yield Api(server)
    stop_server(server)


def test_tool_choice_none_can_leave_the_tools_out_of_the_prompt(api, excluding):
    def rendered(server: Api, **fields) -> list[int]:
        reply = server.post("/v1/chat/completions/render", {"messages": ASK, **fields})
        assert reply.status == 200, reply.body
        return reply.json()["token_ids"]

    bare = rendered(api)
    assert rendered(excluding) == bare
    # By default the model sees the tools even when it may not call them, as OpenAI does.
    assert len(rendered(api, tools=[WEATHER], tool_choice="none")) > len(bare)
    assert rendered(excluding, tools=[WEATHER], tool_choice="none") == bare
    # Other tool choices show them either way.
    assert rendered(excluding, tools=[WEATHER]) == rendered(api, tools=[WEATHER])
    reply = excluding.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER],
                                                    "tool_choice": "none", "max_tokens": 4})  # fmt: skip
    assert reply.status == 200 and reply.json()["usage"]["prompt_tokens"] == len(bare)
