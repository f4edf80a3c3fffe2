"""GGUF files of the newer architectures that the GGUF format names (qwen3, phi3,
gemma3): a tiny random-weight model written as a GGUF file (llama.cpp's tensor names and
metadata, the default model's tokenizer) converts through transformers and serves the
original model's logits; a file whose conversion would drop something our forward needs
is refused, naming it."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from paged_cache import PagedCache

from pagedinfer.service.loader import default_gguf_path, load_model

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@cache
def default_tokenizer_fields() -> dict[str, Any]:
    """The embedded model's GGUF tokenizer (a byte-level BPE), to write into other files."""
    from gguf import GGUFReader

    reader = GGUFReader(default_gguf_path())

    def strings(key: str) -> list[str]:
        field = reader.get_field(key)
        return [bytes(field.parts[i]).decode() for i in field.data]

    def integer(key: str) -> int:
        field = reader.get_field(key)
        return int(field.parts[field.data[0]][0])

    types = reader.get_field("tokenizer.ggml.token_type")
    return {
        "tokens": strings("tokenizer.ggml.tokens"),
        "merges": strings("tokenizer.ggml.merges"),
        "types": [int(types.parts[i][0]) for i in types.data],
        "pre": strings("tokenizer.ggml.pre")[0],
        "bos": integer("tokenizer.ggml.bos_token_id"),
        "eos": integer("tokenizer.ggml.eos_token_id"),
    }


def write_gguf(
    path: Path,
    arch: str,
    config: Any,
    state: dict[str, torch.Tensor],
    *,
    head_dim: int,
    norm_offset: float = 0.0,
    extra: dict[str, float] | None = None,
    tokenizer: bool = True,
) -> Path:
    """A GGUF file as llama.cpp writes one: its metadata keys, its tensor names (gguf's own
    map from Hugging Face names), fp32 tensors; norms stored plus norm_offset (Gemma's
    1 + weight); the default model's tokenizer unless tokenizer=False."""
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    for key, value in (extra or {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    if tokenizer:
        fields = default_tokenizer_fields()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(fields["pre"])
        writer.add_token_list(fields["tokens"])
        writer.add_token_types(fields["types"])
        writer.add_token_merges(fields["merges"])
        writer.add_bos_token_id(fields["bos"])
        writer.add_eos_token_id(fields["eos"])
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        array = tensor.float().numpy() + (norm_offset if "norm" in hf_name else 0.0)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Each architecture as transformers' GGUF conversion reads it back: no partial rotary or
# LongRoPE for Phi-3, Qwen3's head_dim of 128, Gemma 3's query_pre_attn_scalar of 256
# and its default layer pattern (both layers local here).
GGUF_CASES = {
    "qwen3": ("Qwen3Config", {"head_dim": 128, "tie_word_embeddings": False}, 0.0),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "pad_token_id": None}, 0.0),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "pad_token_id": 0}, 1.0),
}


@pytest.mark.parametrize("arch", sorted(GGUF_CASES))
def test_gguf_file_serves_the_models_logits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from tiny_models import TINY_BASE

    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    class_name, kwargs, norm_offset = GGUF_CASES[arch]
    config = getattr(transformers, class_name)(**{**TINY_BASE, **kwargs})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # make every norm count
                param.add_(torch.randn_like(param), alpha=0.3)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    path = write_gguf(
        tmp_path / f"tiny-{arch}.gguf",
        arch,
        config,
        model.state_dict(),
        head_dim=head_dim,
        norm_offset=norm_offset,
    )
    loaded = load_model(str(path), CPU, torch.float32, max_model_len=128)
    assert loaded.config.architecture == arch
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (ours,) = PagedCache(loaded.config, 1, len(tokens)).step(loaded.model, [(0, tokens, 0)])
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("arch", "head_dim", "extra", "message"),
    [
        ("phi3", 16, {"rope.dimension_count": 8.0}, r"partial rotary .*dimension_count=8"),
        ("phi3", 16, {"attention.sliding_window": 2047.0}, r"the sliding window \(2047\)"),
        ("qwen3", 32, {}, "head_dim=32"),
        ("gemma3", 256, {"rope.scaling.factor": 8.0}, r"rope scaling .*factor=8"),
    ],
)
def test_gguf_files_whose_conversion_loses_a_feature_are_refused(
    arch: str,
    head_dim: int,
    extra: dict[str, float],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    config = SimpleNamespace(
        num_hidden_layers=1,
        max_position_embeddings=4096,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
    )
    path = write_gguf(
        tmp_path / f"{arch}.gguf", arch, config, {}, head_dim=head_dim, extra=extra, tokenizer=False
    )
    with pytest.raises(ValueError, match=f"would drop {message}"):
        load_model(str(path), CPU, torch.float32)
