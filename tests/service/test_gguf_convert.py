"""Our GGUF conversion against the references: gguf-py's reader for the header, and
transformers' own GGUF loading for the config and every weight, on the embedded model's
Q4_1 file. The architectures' own conversions (q/k permutation, Gemma's norms, Phi-3's
fused tensors) are checked through their logits in test_models_gguf.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedinfer.service import gguf_convert
from pagedinfer.service.loader import default_gguf_path


def test_the_header_reads_as_gguf_py_reads_it() -> None:
    from gguf import GGUFReader

    path = default_gguf_path()
    ours = gguf_convert.read_header(path)
    theirs = GGUFReader(path)
    assert set(ours.metadata) == set(theirs.fields) - {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }
    tokens = theirs.get_field("tokenizer.ggml.tokens")
    assert ours.metadata["tokenizer.ggml.tokens"] == [
        bytes(tokens.parts[i]).decode() for i in tokens.data
    ]
    merges = theirs.get_field("tokenizer.ggml.merges")
    assert (
        ours.metadata["tokenizer.ggml.merges"][-1] == bytes(merges.parts[merges.data[-1]]).decode()
    )
    eps = theirs.get_field("llama.attention.layer_norm_rms_epsilon")
    assert ours.metadata["llama.attention.layer_norm_rms_epsilon"] == eps.parts[eps.data[0]][0]
    assert ours.architecture == "llama"
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        entry = ours.tensors[tensor.name]
        assert entry.type == tensor.tensor_type.name
        assert entry.shape == tuple(int(n) for n in tensor.shape)
        assert (entry.offset, entry.nbytes) == (int(tensor.data_offset), int(tensor.n_bytes))


def test_the_embedded_model_converts_to_transformers_weights_and_config(
    default_model_dir: Path,
) -> None:
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = default_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    ours = load_file(default_model_dir / "model.safetensors")
    state = theirs.state_dict()
    state.pop("lm_head.weight")  # tied to the embeddings: not stored
    assert sorted(ours) == sorted(state)
    for name, tensor in state.items():
        assert np.array_equal(ours[name], tensor.numpy()), name

    config = AutoConfig.from_pretrained(default_model_dir).to_dict()
    reference = theirs.config.to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path", "quantization_config"):
        config.pop(key, None)
        reference.pop(key, None)
    assert config == reference


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a GGUF file"),
        (b"GGML" + bytes(20), "no GGUF magic number"),
        (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "GGUF version 7"),
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (2).to_bytes(8, "little"),
            "cut short",
        ),
    ],
)
def test_a_broken_header_is_refused_naming_the_file(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"broken.gguf.*{message}"):
        gguf_convert.read_header(path)


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    source = default_gguf_path().read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(source[: len(source) - 1000])
    with pytest.raises(ValueError, match=r"cut.gguf: tensor .* runs past the file's end"):
        gguf_convert.read_header(path)


def converter_rope_factors(dim: int, base: float, rope: dict[str, float]) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for a Llama 3 config, in its fp32 arithmetic."""
    import math

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


LLAMA3_ROPES = {
    # Llama-3.2-1B's (head_dim 64) and Llama-3.1-8B's (head_dim 128).
    "3.2": (64, 500000.0, {"factor": 32.0, "high_freq_factor": 4.0}),
    "3.1": (128, 500000.0, {"factor": 8.0, "high_freq_factor": 4.0}),
}


@pytest.mark.parametrize("version", sorted(LLAMA3_ROPES))
def test_llama3_rope_scaling_is_recovered_from_the_converters_factors(version: str) -> None:
    """llama.cpp's converter keeps Llama 3's rope scaling only as rope_freqs: the
    conversion gives the config back, whose frequencies transformers divides by them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, base, rope = LLAMA3_ROPES[version]
    rope = {**rope, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    factors = converter_rope_factors(dim, base, rope)
    assert 1.0 < factors[dim // 4] < rope["factor"]  # the smooth step is there
    scaling = gguf_convert.llama3_rope_scaling(factors.astype(np.float64), base)
    assert scaling == {"rope_type": "llama3", **rope}
    config = LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        rope_parameters={"rope_theta": base, **scaling},
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (base ** (np.arange(0, dim, 2) / dim))
    np.testing.assert_allclose(inv_freq.numpy(), plain / factors, rtol=1e-5)


def header_with_rope_factors(factors: list[float] | None) -> gguf_convert.Header:
    metadata = {
        "general.architecture": "llama",
        "llama.rope.freq_base": 500000.0,
        "llama.embedding_length": 256,
        "llama.attention.head_count": 4,
    }
    rope = None if factors is None else tuple(factors)
    return gguf_convert.Header(metadata, {}, rope)


def test_rope_factors_that_are_not_llama3s_are_refused_and_none_mean_no_scaling() -> None:
    dim, base, rope = LLAMA3_ROPES["3.2"]
    good = converter_rope_factors(
        dim, base, {**rope, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    )
    header = header_with_rope_factors(good.tolist())
    assert gguf_convert.config_fields(header)["rope_scaling"]["factor"] == 32.0
    assert gguf_convert.losses(header) == []
    bent = good.copy()
    bent[dim // 4 - 1] *= 1.01  # one factor of the step off the curve
    for factors in (bent.tolist(), np.linspace(1.0, 4.0, dim // 2).tolist()):
        header = header_with_rope_factors(factors)
        assert "rope_scaling" not in gguf_convert.config_fields(header)
        assert any("rope_freqs.weight" in lost for lost in gguf_convert.losses(header))
    header = header_with_rope_factors(None)
    assert "rope_scaling" not in gguf_convert.config_fields(header)
    assert gguf_convert.losses(header) == []


def test_the_header_reads_the_rope_factors(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "rope.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = np.array([1.0, 1.5, 8.0, 8.0], dtype=np.float32)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_convert.read_header(path).rope_factors == (1.0, 1.5, 8.0, 8.0)
