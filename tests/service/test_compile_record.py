"""The record of which kernel sets numba's cache holds: a start whose kernels an earlier
start left in the cache builds the CPU executor before serving, even in the server; any
change that would make numba's cache miss also forgets the record."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedinfer.kernels.cpu import compile_record
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.engine import LLMEngine


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "records"
    monkeypatch.setattr(compile_record, "record_directory", lambda: directory)
    return directory


def test_a_record_names_one_kernel_set(records: Path) -> None:
    assert not compile_record.compiled_before("model a")
    compile_record.record_compiled("model a")
    assert compile_record.compiled_before("model a")
    assert not compile_record.compiled_before("model b")
    assert len(list(records.iterdir())) == 1


def test_editing_a_kernel_source_forgets_the_record(
    records: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "kernels" / "cpu"
    sources.mkdir(parents=True)
    kernel = sources / "kernel.py"
    kernel.write_text("x = 1\n")
    (sources.parent / "torch_ops.py").write_text("y = 1\n")
    monkeypatch.setattr(compile_record, "_KERNEL_SOURCES", sources)
    compile_record.record_compiled("model")
    assert compile_record.compiled_before("model")
    kernel.write_text("x = 2\n")
    stat = kernel.stat()
    os.utime(kernel, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not compile_record.compiled_before("model")


def test_an_unwritable_cache_gets_no_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(compile_record, "record_directory", lambda: blocker / "records")
    compile_record.record_compiled("model")  # logs, does not raise
    assert not compile_record.compiled_before("model")


def test_a_recorded_kernel_set_is_built_before_serving(
    records: Path, make_tiny_model: Callable[..., Path]
) -> None:
    config = EngineConfig(
        model=str(make_tiny_model("llama")),
        num_gpu_blocks=32,
        max_model_len=128,
        compile_in_background=True,
    )
    first = LLMEngine(config)
    if first.runner.executor is None:
        pytest.skip("no CPU executor on this machine")
    assert not first.runner.executor.active  # compiling in the background
    assert first.runner.executor.wait_ready(timeout=600)
    deadline = time.monotonic() + 30  # recorded by a thread waiting on the same warm-up
    while not compile_record.compiled_before(first.runner._kernel_set):
        assert time.monotonic() < deadline, "no record once the kernels were ready"
        time.sleep(0.05)

    first.runner.executor.activate()  # builds from the store its compiling child wrote
    second = LLMEngine(config)
    assert second.runner.executor is not None and second.runner.executor.active
    assert second.runner.executor.mode == first.runner.executor.mode


def test_the_kernel_set_follows_the_weights_not_where_the_cache_lies(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    import shutil

    import torch

    from pagedinfer.service.model_runner import kernel_set_identity
    from pagedinfer.service.models.hf_config import model_config_from_hf

    source = make_tiny_model("llama")
    config = model_config_from_hf(json.loads((source / "config.json").read_text()), None)
    moved = shutil.copytree(source, tmp_path / "elsewhere" / source.name)  # times kept

    def identity(path: Path, dtype: torch.dtype = torch.float32) -> str:
        return kernel_set_identity(config, path, 16, dtype)

    assert identity(moved) == identity(source)
    assert identity(source, torch.bfloat16) != identity(source)
    weights = next(moved.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert identity(moved) != identity(source)


def test_a_failed_compiling_child_leaves_the_torch_forward_serving(
    records: Path, make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that dies (here: exit 3; under a pod's memory limit, SIGKILL) is not
    followed by compiling in the server, which would hold that memory for good: the
    executor keeps the error, and the model's torch forward serves every request."""
    from pagedinfer.kernels.cpu.executor import CpuExecutor
    from pagedinfer.service.sampling_params import SamplingParams

    def child(self: CpuExecutor, block_size: int) -> None:
        os._exit(3)

    def compile_here(self: CpuExecutor, block_size: int, cached: bool) -> None:
        raise AssertionError("the server compiled the kernels itself")

    monkeypatch.setattr(CpuExecutor, "_warm_up_and_exit", child)
    monkeypatch.setattr(CpuExecutor, "_build_and_load", compile_here)
    engine = LLMEngine(
        EngineConfig(
            model=str(make_tiny_model("llama")),
            num_gpu_blocks=32,
            max_model_len=128,
            compile_in_background=True,
        )
    )
    executor = engine.runner.executor
    if executor is None:
        pytest.skip("no CPU executor on this machine")
    deadline = time.monotonic() + 120
    while executor.error is None:
        assert time.monotonic() < deadline, "the failed child was not reported"
        time.sleep(0.05)
    assert isinstance(executor.error, RuntimeError)
    assert str(executor.error) == "the compiling child failed: exit 3"
    assert not executor.ready and not executor.active
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for delta in engine.step() for t in delta.token_ids]
    assert len(tokens) == 4
    assert not executor.active
