"""`pagedinfer serve --model DIR` of each newer architecture, end to end over gRPC: a
real server process on 127.0.0.1 with a tiny random-weight Qwen3, Phi-3, SmolLM3 and
Gemma 3 model and a small KV cache, and one greedy generation that must be
transformers' own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_server import Server, greedy, start_server, stop_server

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPT = [17, 4096, 311, 9, 28001, 502, 77, 1200]


@pytest.fixture(scope="module", params=["qwen3", "phi3", "smollm3", "gemma3"])
def served(
    request: pytest.FixtureRequest,
    make_tiny_model: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Server]]:
    """The architecture's tiny model and a server of it (LongRoPE's short factors for
    Phi-3: served within its original 64 positions)."""
    path = make_tiny_model(request.param)
    max_len = "64" if request.param == "phi3" else "512"
    server = start_server(
        tmp_path_factory.mktemp(f"serve-{request.param}"),
        "--model",
        str(path),
        "--max-model-len",
        max_len,
    )
    yield path, server
    stop_server(server)


def test_serve_generates_transformers_greedy_tokens(served: tuple[Path, Server]) -> None:
    from transformers import AutoModelForCausalLM

    path, server = served
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == path.name
    sampling = greedy(MAX_TOKENS, ignore_eos=True)
    responses = list(server.generate(prompt_token_ids=PROMPT, sampling=sampling))
    tokens = [t for r in responses for t in r.token_ids]
    assert responses[-1].finish_reason == pb.LENGTH and len(tokens) == MAX_TOKENS
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: run to the length limit
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    assert tokens == out[0, len(PROMPT) :].tolist()
    server.wait_all_blocks_free()
