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
