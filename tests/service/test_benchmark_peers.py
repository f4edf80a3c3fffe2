"""The benchmark's realistic workload and its peers, without the peers installed.

The chat workload must hold enough varied prompts and render under the model's chat
template; the peers (vLLM, llama.cpp) live outside the project's environment, so
throughput.py must skip them with the reason when they are absent, and drive them with
the workload's own token ids when present (here llama.cpp's server is stood in for by a
small HTTP server that answers as its /completion endpoint does). The noisy checkpoint
must move every weight off its grid by about the asked scale, reproducibly.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings as scripts do

from peers import run_llamacpp, run_vllm  # noqa: E402
from peers.noisy_checkpoint import make_noisy_checkpoint, noisy_weights  # noqa: E402
from peers.shaped_checkpoint import QWEN2_0_5B_SHAPE, make_shaped_checkpoint  # noqa: E402
from workloads.chat import chat_workload, load_chat_prompts  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_chat_workload_has_at_least_40_varied_prompts():
    prompts = load_chat_prompts()
    assert len(prompts) >= 40
    tasks = {p["task"] for p in prompts}
    assert {"question", "summary", "code", "extraction", "rewriting", "math"} <= tasks
    assert {"translation", "list"} <= tasks
    texts = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(texts)) == len(texts), "a prompt is repeated"


def test_chat_workload_renders_under_the_chat_template(tokenizer):
    ids, lens = chat_workload(tokenizer, max_len=512)
    assert len(ids) == len(load_chat_prompts()) == len(lens)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    reply = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for prompt in ids:
        assert prompt[0] == start
        assert prompt[-len(reply) :] == reply  # ready for the assistant's answer
    first = tokenizer.decode(ids[0])
    assert load_chat_prompts()[0]["messages"][0]["content"] in first
    assert chat_workload(tokenizer, n=3)[1] == lens[:3]


def test_chat_workload_refuses_more_prompts_than_it_has_and_overlong_ones(tokenizer):
    n = len(load_chat_prompts())
    with pytest.raises(ValueError, match=f"has {n} prompts; asked for {n + 1}"):
        chat_workload(tokenizer, n=n + 1)
    with pytest.raises(ValueError, match="over max_model_len 64"):
        chat_workload(tokenizer, max_len=64)


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "'output_tokens' must be"),
        ({"messages": [], "output_tokens": 8}, "'messages' must be a non-empty list"),
        (
            {"messages": [{"role": "robot", "content": "hi"}], "output_tokens": 8},
            "a role in",
        ),
        (
            {"messages": [{"role": "assistant", "content": "hi"}], "output_tokens": 8},
            "the last message must be the user's",
        ),
    ],
)
def test_bad_chat_prompts_are_refused_by_name(tmp_path, prompt, problem):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"prompts": [prompt]}))
    with pytest.raises(ValueError, match=problem):
        load_chat_prompts(path)


def test_peers_absent_are_skipped_with_the_reason(tmp_path):
    import argparse

    import throughput

    wl = throughput.Workload([[300, 301, 302]], [4])
    args = argparse.Namespace(
        vllm_venv=tmp_path / "no-venv",
        llamacpp_dir=tmp_path / "no-build",
        model="embedded",
        dtype="float32",
        threads=1,
        kv_cache_memory=2**27,
        max_model_len=128,
        max_num_batched_tokens=64,
    )
    gguf = tmp_path / "model.gguf"
    for name, setup in (("vllm", "setup_vllm.sh"), ("llamacpp", "setup_llamacpp.sh")):
        result = throughput.run_peer(name, wl, wl, args, tmp_path, gguf, 1, 1.0)
        assert result["system"] == name
        assert setup in result["skipped"]
    assert run_vllm.unavailable(tmp_path) is not None
    assert run_llamacpp.unavailable(tmp_path) is not None


def test_vllm_gets_the_cpu_settings_of_its_docs(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    job = run_vllm.VllmJob(
        model=Path("m"),
        dtype="float32",
        threads=1,
        kv_cache_bytes=2**27,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    env = run_vllm.environment(job)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override the exact budget
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == run_vllm.bound_cores(1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"].isdigit()  # one core
    assert "PYTHONPATH" not in env
    with pytest.raises(ValueError, match="CPUs are usable"):
        run_vllm.bound_cores(10_000)


FAKE_SERVER = """\
#!{python}
# Answers as llama-server does: /health, and /completion on token-id prompts.
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": args}}) + "\\n")

class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open({log!r}, "a") as f:
            f.write(json.dumps({{"request": body}}) + "\\n")
        n = body["n_predict"]
        self.reply({{"tokens_predicted": n, "tokens_evaluated": len(body["prompt"]),
                    "tokens": [body["prompt"][-1]] * n, "content": ""}})

    def log_message(self, *a):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_llamacpp_is_driven_with_the_workloads_token_ids(tmp_path):
    log = tmp_path / "server.log"
    binary = run_llamacpp.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text(textwrap.dedent(FAKE_SERVER.format(python=sys.executable, log=str(log))))
    binary.chmod(0o755)
    job = run_llamacpp.LlamaCppJob(
        gguf=tmp_path / "model.gguf", threads=1, max_model_len=128, batch_tokens=64
    )
    prompts, lens = [[300, 301], [400, 401, 402], [500]], [5, 3, 7]
    result = run_llamacpp.run_llamacpp(job, (prompts, lens), ([[600]], [2]), root=tmp_path)
    assert result["slots"] == 3
    assert result["prompt_tokens_evaluated"] == 6
    assert [len(t) for t in result["output_token_ids"]] == lens
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    argv = entries[0]["argv"]
    assert argv[argv.index("--parallel") + 1] == "3"  # a slot for each request
    assert argv[argv.index("--ctx-size") + 1] == str(3 * 128)
    requests = [e["request"] for e in entries[1:]]
    assert requests[0]["prompt"] == [600]  # the warm-up first
    served = sorted((r["prompt"], r["n_predict"]) for r in requests[1:])
    assert served == sorted(zip(prompts, lens, strict=True))
    assert all(r["ignore_eos"] and r["top_k"] == 1 for r in requests)


def test_llamacpp_short_answers_are_an_error(tmp_path):
    binary = run_llamacpp.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    source = FAKE_SERVER.format(python=sys.executable, log=str(tmp_path / "log"))
    binary.write_text(source.replace('n = body["n_predict"]', 'n = body["n_predict"] - 1'))
    binary.chmod(0o755)
    job = run_llamacpp.LlamaCppJob(tmp_path / "m.gguf", 1, 64, 32)
    with pytest.raises(RuntimeError, match="returned 3 output tokens, not 4"):
        run_llamacpp.run_llamacpp(job, ([[300]], [4]), ([[301]], [2]), root=tmp_path)


def test_noisy_weights_leave_the_grid_by_the_asked_scale():
    grid = torch.arange(16, dtype=torch.float32).repeat(64).reshape(32, 32) * 0.01 + 0.1
    weights = {"w": grid, "ids": torch.arange(8)}
    noisy = noisy_weights(weights, 1e-3, seed=0)
    ratio = noisy["w"] / grid - 1
    assert 0.7e-3 < ratio.std().item() < 1.3e-3
    assert noisy["w"].unique().numel() > 16 * 50  # no longer 16 levels
    assert torch.equal(noisy["ids"], weights["ids"])  # integers untouched
    assert torch.equal(noisy_weights(weights, 1e-3, seed=0)["w"], noisy["w"])
    assert not torch.equal(noisy_weights(weights, 1e-3, seed=1)["w"], noisy["w"])


def test_a_bf16_noisy_checkpoint_stores_bf16_weights_and_says_so(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float32"}')
    save_file({"w": torch.full((8, 8), 0.3), "ids": torch.arange(4)}, source / "m.safetensors")
    target = make_noisy_checkpoint(source, tmp_path / "out", 1e-3, 0, torch.bfloat16)
    weights = load_file(target / "m.safetensors")
    assert weights["w"].dtype == torch.bfloat16 and weights["ids"].dtype == torch.int64
    assert weights["w"].unique().numel() > 1
    assert json.loads((target / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_noisy_checkpoint_is_an_ordinary_hf_directory(tmp_path):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "tokenizer.json").write_text("{}")
    save_file({"w": torch.ones(4, 4)}, source / "model.safetensors")
    target = make_noisy_checkpoint(source, tmp_path / "out", scale=1e-3, seed=0)
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in source.iterdir())
    w = load_file(target / "model.safetensors")["w"]
    assert w.shape == (4, 4) and not torch.equal(w, torch.ones(4, 4))
    assert (w - 1).abs().max().item() < 1e-2
    with pytest.raises(ValueError, match=r"no \.safetensors weight files"):
        make_noisy_checkpoint(tmp_path / "out" / "missing", tmp_path / "x")


def test_a_shaped_checkpoint_loads_as_qwen2_with_its_shape_and_biases(tmp_path):
    """The benchmark's checkpoint of another family, at a small shape: our loader reads it
    as Qwen2 with that shape, q/k/v biases that are not zero and the embedded tokenizer."""
    from pagedinfer.service.loader import load_model

    shape = {**QWEN2_0_5B_SHAPE, "hidden_size": 128, "intermediate_size": 256}
    shape.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    target = make_shaped_checkpoint(tmp_path / "qwen", seed=0, shape=shape)
    loaded = load_model(str(target), torch.device("cpu"), torch.float32)
    config = loaded.config
    assert config.architecture == "qwen2" and config.attention_bias
    assert (config.hidden_size, config.num_layers, config.num_kv_heads) == (128, 2, 2)
    assert config.tie_word_embeddings and config.vocab_size == len(loaded.tokenizer)
    bias = loaded.model.layers[0].self_attn.qkv_proj.bias
    assert bias.shape == (4 * 32 + 2 * 2 * 32,) and bias.abs().min() > 0


def test_a_staged_directory_replaces_its_target_only_when_written_whole(tmp_path):
    from peers.paths import staged_directory

    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("kept")
    with pytest.raises(RuntimeError, match="interrupted"), staged_directory(target) as staging:
        (staging / "new").write_text("half")
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["old"]
    with staged_directory(target) as staging:
        (staging / "new").write_text("whole")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["new"]
