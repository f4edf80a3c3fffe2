"""The loader: the embedded default model, HF directories, GGUF files, and clear refusals."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer.service import loader
from pagedinfer.service.loader import (
    default_gguf_path,
    ensure_converted_gguf,
    ensure_default_model,
    load_model,
    model_config_from_hf,
)

CPU = torch.device("cpu")


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **overrides,
    }


# --- the embedded default model ---------------------------------------------------


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> loader.LoadedModel:
    return load_model(None, CPU, torch.float32)


def test_default_model_config(default_model: loader.LoadedModel) -> None:
    config = default_model.config
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (64, 576, 49152)
    assert config.tie_word_embeddings
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert config.eos_token_ids == [default_model.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert config.name == loader.DEFAULT_MODEL_NAME
    params = dict(default_model.model.named_parameters())
    # Fused projections, stored [out_features, in_features] as checkpoints store them.
    assert params["layers.0.self_attn.qkv_proj.weight"].shape == (9 * 64 + 2 * 3 * 64, 576)
    assert params["layers.0.mlp.gate_up_proj.weight"].shape == (2 * 1536, 576)
    assert all(p.dtype == torch.float32 for p in params.values())
    # The loader gives the dense model: every weight in memory, none packed or released
    # (that is the CPU executor's, which the model runner prepares).
    assert all(p.device == CPU for p in params.values())


def test_default_model_tokenizer_has_chat_template(default_model: loader.LoadedModel) -> None:
    tokenizer = default_model.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "What is the capital of France?" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode("Hello, world!")
    assert tokenizer.decode(ids) == "Hello, world!"


def test_ensure_default_model_is_cached(default_model_dir: Path) -> None:
    start = time.perf_counter()
    assert ensure_default_model() == default_model_dir
    assert time.perf_counter() - start < 1.0
    files = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    # A plain fp32 checkpoint: nothing left of the GGUF quantisation.
    assert "quantization_config" not in json.loads((default_model_dir / "config.json").read_text())


def test_gguf_file_path_loads(default_model_dir: Path) -> None:
    loaded = load_model(str(default_gguf_path()), CPU, torch.float32)
    # The same GGUF file shares the default model's converted cache entry.
    assert loaded.path == default_model_dir
    assert loaded.config.name == default_gguf_path().stem
    assert loaded.config.num_layers == 30


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_dir() == tmp_path / "xdg" / "pagedinfer"
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "own"))
    assert loader.cache_dir() == tmp_path / "own"


# --- conversion is atomic and happens once ----------------------------------------


def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.Q4_0.gguf"
    path.write_bytes(b"GGUF not really")
    return path


def test_concurrent_conversions_convert_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def slow_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        time.sleep(0.2)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_convert_gguf", slow_convert)
    gguf = fake_gguf(tmp_path)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_converted_gguf(gguf)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "config.json").is_file()
    # Only the finished directory and its lock file remain: no staging leftovers.
    assert sorted(p.name for p in results[0].parent.iterdir()) == sorted(
        [results[0].name, results[0].name + ".lock"]
    )


def test_failed_conversion_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))

    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader, "_convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted_gguf(fake_gguf(tmp_path))
    assert [p.suffix for p in (tmp_path / "cache" / "models").iterdir()] == [".lock"]


def test_a_conversion_deletes_those_no_start_will_use_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A reinstalled or updated file (new time), a deleted file, or an older conversion
    version leaves its conversion stale; the next conversion deletes it, but not one
    whose lock another process holds, nor a directory that is not a conversion."""
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))

    def convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    files = {name: tmp_path / f"{name}.gguf" for name in ("kept", "updated", "gone", "held")}
    for path in files.values():
        path.write_bytes(b"GGUF")
    first = {name: ensure_converted_gguf(path) for name, path in files.items()}
    models = tmp_path / "cache" / "models"
    (models / "checkpoint").mkdir()  # e.g. a benchmark's checkpoint: no source record
    os.utime(files["updated"], ns=(1, 1))
    files["gone"].unlink()
    files["held"].unlink()
    with open(models / (first["held"].name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        updated = ensure_converted_gguf(files["updated"])
    assert updated != first["updated"]
    assert sorted(p.name for p in models.iterdir() if p.suffix != ".lock") == sorted(
        [first["kept"].name, updated.name, first["held"].name, "checkpoint"]
    )
    assert not (models / (first["gone"].name + ".lock")).exists()
    # An older conversion version's output is stale too.
    monkeypatch.setattr(loader, "_CONVERSION_VERSION", loader._CONVERSION_VERSION + 1)
    again = ensure_converted_gguf(files["kept"])
    assert again != first["kept"]
    # The lock is free now, so the conversion of the deleted file went too.
    assert sorted(p.name for p in models.iterdir()) == sorted(
        [again.name, again.name + ".lock", "checkpoint"]
    )


# --- local Hugging Face directories -----------------------------------------------


@pytest.mark.parametrize("preset", ["llama", "mistral", "qwen2"])
def test_hf_directories_load(make_tiny_model: Callable[..., Path], preset: str) -> None:
    loaded = load_model(str(make_tiny_model(preset)), CPU, torch.float32)
    assert loaded.config.architecture == preset
    assert loaded.config.attention_bias == (preset == "qwen2")
    assert loaded.tokenizer.chat_template


def test_bfloat16_load(make_tiny_model: Callable[..., Path]) -> None:
    loaded = load_model(str(make_tiny_model("llama")), CPU, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_sliding_window_shorter_than_context_is_served_windowed(
    make_tiny_model: Callable[..., Path],
) -> None:
    path = make_tiny_model("mistral", sliding_window=256)
    config = load_model(str(path), CPU, torch.float32).config
    assert (config.sliding_window, config.local_layers, config.kv_window) == (256, (0, 1), 256)
    assert "sliding_window" in config.features()
    # Served no longer than the window, sliding-window attention is full attention.
    short = load_model(str(path), CPU, torch.float32, max_model_len=256).config
    assert (short.sliding_window, short.local_layers, short.kv_window) == (None, (), None)
    assert "sliding_window" not in short.features()


def test_missing_weights_are_refused(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = make_tiny_model("llama")
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights .*layers\.1\.mlp\.gate_up_proj"):
        load_model(str(tmp_path), CPU, torch.float32)


def copy_model(source: Path, target: Path) -> Path:
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_load_exactly_as_stored(
    make_tiny_model: Callable[..., Path], tmp_path: Path, stored: torch.dtype, dtype: torch.dtype
) -> None:
    """Each parameter holds the file's tensor (q/k/v and gate/up fused), converted to the
    dtype asked for, whatever the dtype the file stores."""
    from safetensors.torch import load_file, save_file

    path = copy_model(make_tiny_model("qwen2"), tmp_path)
    weights = {k: v.to(stored) for k, v in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors")
    params = dict(load_model(str(path), CPU, dtype).model.named_parameters())
    for i in range(2):
        prefix = f"model.layers.{i}."
        qkv = torch.cat([weights[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(params[f"layers.{i}.self_attn.qkv_proj.weight"], qkv.to(dtype))
        qkv_bias = torch.cat([weights[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"])
        assert torch.equal(params[f"layers.{i}.self_attn.qkv_proj.bias"], qkv_bias.to(dtype))
        down = weights[prefix + "mlp.down_proj.weight"]
        assert torch.equal(params[f"layers.{i}.mlp.down_proj.weight"], down.to(dtype))
    embed = weights["model.embed_tokens.weight"].to(dtype)
    assert torch.equal(params["embed_tokens.weight"], embed)


def test_truncated_weights_are_refused(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = copy_model(make_tiny_model("llama"), tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* \(truncated file\?\)"):
        load_model(str(path), CPU, torch.float32)


def test_a_file_that_is_not_safetensors_is_refused(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = copy_model(make_tiny_model("llama"), tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(ValueError, match=r"model\.safetensors: unreadable safetensors header"):
        load_model(str(path), CPU, torch.float32)


# --- refusals, named -----------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model path not found"):
        load_model(str(tmp_path / "nope"), CPU, torch.float32)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        load_model(str(tmp_path / "model.bin"), CPU, torch.float32)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config\.json .*weights\.safetensors"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors .*pytorch_model\.bin"):
        load_model(str(tmp_path), CPU, torch.float32)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"'gpt2'.*GPT2LMHeadModel"),
        ({"model_type": "mixtral"}, "unsupported architecture: model_type='mixtral'"),
        (
            {"num_local_experts": 8, "num_experts_per_tok": 2},
            "mixture-of-experts.*num_local_experts",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "'longrope'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"max_position_embeddings": 1024}, "max_model_len=2048 exceeds .*=1024"),
    ],
)
def test_unsupported_configs_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(llama_config(**overrides), max_model_len=2048)


def test_qwen2_window_unused_below_max_window_layers() -> None:
    raw = llama_config(
        model_type="qwen2", use_sliding_window=True, sliding_window=512, max_window_layers=2
    )
    assert model_config_from_hf(raw, max_model_len=2048).attention_bias
    assert model_config_from_hf(raw, max_model_len=2048).sliding_window is None
    # From max_window_layers on, layers are windowed; the others keep all their KV.
    config = model_config_from_hf({**raw, "max_window_layers": 1}, max_model_len=2048)
    assert (config.sliding_window, config.local_layers, config.kv_window) == (512, (1,), None)
    assert [config.layer_window(i) for i in range(2)] == [None, 512]


def test_legacy_and_current_rope_fields_agree() -> None:
    legacy = llama_config(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    current = llama_config(
        rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}
    )
    for raw in (legacy, current):
        config = model_config_from_hf(raw)
        assert config.rope_theta == 500000.0
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
