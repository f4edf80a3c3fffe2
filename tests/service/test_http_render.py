"""vLLM's render endpoints, as llm-d's endpoint picker calls them (its token-producer):
the prompt token ids of a completions or chat body, equal to the ids generation uses,
so that the keys a router computes from them name the blocks the pod stores."""

from __future__ import annotations

import pytest
from kv_event_router import block_keys
from starlette.testclient import TestClient

from pagedinfer.service import prompts
from pagedinfer.service.kv_events import wire_hash
from pagedinfer.service.sampling_params import SamplingParams

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(make_tiny_model):
    env = pytest.MonkeyPatch()
    env.setenv("PAGEDINFER_CPU_KERNELS", "torch")  # rendering needs no compiled kernels
    from pagedinfer.service.async_engine import AsyncLLMEngine
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.openai.app import create_app
    from pagedinfer.service.openai.serving import ServingState

    config = EngineConfig(model=str(make_tiny_model("llama")), max_model_len=256, num_gpu_blocks=32)
    engine = AsyncLLMEngine(config)
    state = ServingState(max_queue=8, engine=engine, served_model_names=[MODEL])
    with TestClient(create_app(state)) as client:
        yield client, engine
    env.undo()


def test_completions_render_gives_each_prompts_ids(served):
    client, engine = served
    text = "The capital of France is Paris. The capital of Italy is"
    response = client.post("/v1/completions/render", json={"model": MODEL, "prompt": text})
    assert response.status_code == 200, response.text
    (rendered,) = response.json()
    assert rendered["token_ids"] == engine.encode_prompt(prompt=text)
    both = client.post("/v1/completions/render", json={"model": MODEL, "prompt": [text, "Hi"]})
    assert [r["token_ids"] for r in both.json()] == [
        engine.encode_prompt(prompt=text),
        engine.encode_prompt(prompt="Hi"),
    ]
    ids = client.post("/v1/completions/render", json={"model": MODEL, "prompt": [5, 6, 7]})
    assert ids.json() == [{"token_ids": [5, 6, 7]}]


def test_chat_render_applies_the_chat_template_as_generation_does(served):
    client, engine = served
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    # The body llm-d's token-producer sends: messages, the model, the generation prompt.
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    response = client.post("/v1/chat/completions/render", json=body)
    assert response.status_code == 200, response.text
    ids = response.json()["token_ids"]
    expected = engine.encode_prompt(
        messages=messages, chat_options=prompts.ChatOptions(add_generation_prompt=True)
    )
    assert ids == expected
    bare = client.post("/v1/chat/completions/render", json={**body, "add_generation_prompt": False})
    assert bare.json()["token_ids"] != ids  # the template's generation prompt counts

    # The router's keys for the rendered ids name the blocks the pod stores for them.
    kv = engine.engine.scheduler.kv_cache
    engine.engine.add_request(ids, SamplingParams(max_tokens=1))
    while engine.engine.has_unfinished():
        engine.engine.step()
    cached = {wire_hash(h) for h in kv.pool.cached}
    keys = block_keys(ids, kv.block_size)
    assert keys and set(keys) <= cached


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404, None),
        ("/v1/completions/render", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_bad_render_requests_are_refused_naming_the_field(served, path, body, status, param):
    client, _ = served
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
