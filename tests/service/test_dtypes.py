"""`--dtype auto`: the checkpoint's dtype where the hardware multiplies it natively, fp32
elsewhere on a CPU; a pure decision over the config and the CPU's flags."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pagedinfer.service import dtypes, engine
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.dtypes import checkpoint_dtype, choose_dtype
from pagedinfer.service.loader import stored_dtype

AVX2 = frozenset()  # this development machine: no bf16 instructions
ZEN4 = frozenset({"avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx512_bf16", "amx_bf16"})
GRANITE_RAPIDS = frozenset({"avx512_bf16", "amx_bf16", "amx_fp16"})


@pytest.mark.parametrize(
    ("checkpoint", "flags", "expected"),
    [
        ("bfloat16", AVX2, "float32"),
        ("bfloat16", ZEN4, "bfloat16"),
        ("bfloat16", SAPPHIRE_RAPIDS, "bfloat16"),
        ("bfloat16", frozenset({"amx_bf16"}), "bfloat16"),
        ("float16", AVX2, "float32"),
        ("float16", GRANITE_RAPIDS, "float32"),  # no fp16 kernels on the CPU backend
        ("float32", ZEN4, "float32"),
        ("float32", AVX2, "float32"),
        (None, SAPPHIRE_RAPIDS, "float32"),  # a config that names no dtype
        (None, frozenset({"amx_fp16"}), "float32"),
    ],
)
def test_auto_on_a_cpu_follows_the_checkpoint_where_bf16_is_native(
    checkpoint: str | None, flags: frozenset[str], expected: str
) -> None:
    choice = choose_dtype("auto", checkpoint, "cpu", flags)
    assert choice.dtype == expected
    assert choice.reason.startswith(f"dtype auto: {expected}")


def test_the_reason_names_what_decided() -> None:
    assert (
        "(amx_bf16, avx512_bf16)" in choose_dtype("auto", "bfloat16", "cpu", GRANITE_RAPIDS).reason
    )
    assert "no native bf16" in choose_dtype("auto", "bfloat16", "cpu", AVX2).reason
    assert "no fp16 kernels" in choose_dtype("auto", "float16", "cpu", GRANITE_RAPIDS).reason
    assert "names no dtype" in choose_dtype("auto", None, "cpu", ZEN4).reason


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
def test_auto_on_a_gpu_keeps_bf16(checkpoint: str | None) -> None:
    assert choose_dtype("auto", checkpoint, "cuda", frozenset()).dtype == "bfloat16"


@pytest.mark.parametrize("requested", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("flags", [AVX2, SAPPHIRE_RAPIDS])
def test_an_explicit_dtype_is_kept(requested: str, flags: frozenset[str]) -> None:
    for device in ("cpu", "cuda"):
        choice = choose_dtype(requested, "bfloat16", device, flags)
        assert choice.dtype == requested
        assert f"--dtype {requested}" in choice.reason


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),  # older transformers' key
        ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),  # the newer key wins
        ({"torch_dtype": "auto"}, None),
        ({"torch_dtype": "float8_e4m3fn"}, None),
        ({}, None),
    ],
)
def test_the_checkpoint_dtype_comes_from_its_config(config: dict, expected: str | None) -> None:
    assert checkpoint_dtype(config) == expected


def test_cpu_flags_are_the_ones_the_rule_reads() -> None:
    assert dtypes.cpu_flags() <= {"avx512_bf16", "amx_bf16", "amx_fp16"}


def test_a_saved_model_and_a_gguf_file_say_what_they_store(
    make_tiny_model, default_model_dir: Path
) -> None:
    assert stored_dtype(str(make_tiny_model("llama"))) == "float32"
    assert stored_dtype(None) == "float32"  # the embedded GGUF file, dequantised
    with pytest.raises(ValueError, match="model path not found"):
        stored_dtype("/no/such/model")


@pytest.mark.parametrize(("flags", "expected"), [(AVX2, torch.float32), (ZEN4, torch.bfloat16)])
def test_the_engine_logs_its_choice_for_a_bf16_checkpoint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    flags: frozenset[str],
    expected: torch.dtype,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "dtype": "bfloat16"}))
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: flags)
    config = EngineConfig(model=str(tmp_path))
    with caplog.at_level(logging.INFO, logger=engine.__name__):
        assert engine.resolve_dtype(config, torch.device("cpu")) == expected
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert reasons == [choose_dtype("auto", "bfloat16", "cpu", flags).reason]
