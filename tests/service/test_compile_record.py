"""The record of which kernel sets numba's cache holds: a start whose kernels an earlier
start left in the cache builds the CPU executor before serving, even in the server; any
change that would make numba's cache miss also forgets the record."""

from __future__ import annotations

import json
import os
import shutil
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


def greedy_tokens(engine: LLMEngine) -> list[int]:
    """Six greedy tokens after five fixed ids."""
    from pagedinfer.service.sampling_params import SamplingParams

    engine.add_request(
        [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    tokens = []
    while engine.has_unfinished():
        tokens += [t for delta in engine.step() for t in delta.token_ids]
    return tokens


def tiny_config(make_tiny_model: Callable[..., Path], **overrides: object) -> EngineConfig:
    """The tiny Llama, compiled in the background as the server compiles it."""
    settings: dict[str, object] = {"num_gpu_blocks": 32, "max_model_len": 128}
    settings["compile_in_background"] = True
    return EngineConfig(model=str(make_tiny_model("llama")), **{**settings, **overrides})


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
    config = tiny_config(make_tiny_model)
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

    from pagedinfer.service.model_runner import (
        kernel_set_identity,
        weights_identity,
        weights_store,
    )
    from pagedinfer.service.models.hf_config import model_config_from_hf

    source = make_tiny_model("llama")
    config = model_config_from_hf(json.loads((source / "config.json").read_text()), None)
    moved = shutil.copytree(source, tmp_path / "elsewhere" / source.name)  # times kept

    def identity(path: Path, dtype: torch.dtype = torch.float32) -> str:
        return kernel_set_identity(config, path, 16, dtype)

    assert identity(moved) == identity(source)
    assert identity(source, torch.bfloat16) != identity(source)
    # int8 products pick other kernels over the same stored grids: one store, two sets
    int8_set = kernel_set_identity(config, source, 16, torch.float32, "int8")
    assert int8_set != identity(source)
    assert weights_store(weights_identity(config, source, 16, torch.float32)) == weights_store(
        weights_identity(config, moved, 16, torch.float32)
    )
    assert weights_identity(config, source, 16, torch.float32) in int8_set
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
    engine = LLMEngine(tiny_config(make_tiny_model))
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


def test_the_compiling_child_is_the_first_the_oom_killer_takes(
    records: Path, make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a pod's memory limit, the kernel kills the process with the highest OOM
    score: the child raises its own to the maximum, so the server survives (and serves
    on the torch forward) if compiling overruns the limit."""
    from pagedinfer.kernels.cpu.executor import CpuExecutor

    def warm_up_in_child(self: CpuExecutor, block_size: int, **kwargs: object) -> None:
        score = Path("/proc/self/oom_score_adj").read_text().strip()
        os._exit(0 if score == "1000" else 5)

    monkeypatch.setattr(CpuExecutor, "_build", lambda self: None)
    monkeypatch.setattr(CpuExecutor, "_release_built_weights", lambda self: None)
    monkeypatch.setattr(CpuExecutor, "_run_warm_up_batches", warm_up_in_child)
    monkeypatch.setattr(CpuExecutor, "_build_and_load", lambda self, block_size, cached: None)
    engine = LLMEngine(tiny_config(make_tiny_model))
    executor = engine.runner.executor
    if executor is None:
        pytest.skip("no CPU executor on this machine")
    assert executor.wait_ready(120) or executor.error is not None, "the child never finished"
    assert executor.error is None, executor.error
    assert Path("/proc/self/oom_score_adj").read_text().strip() != "1000"  # the server's own


def test_a_limit_that_cannot_hold_a_compiling_child_beside_the_model_compiles_first(
    records: Path, make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the memory limit holds the model's dense weights or a compiling child but
    not both, the server compiles before it serves: its executor serves from the first
    step, and it let go of the dense weights while the child compiled."""
    from pagedinfer.kernels.cpu.executor import CpuExecutor
    from pagedinfer.service import model_runner

    reference = greedy_tokens(LLMEngine(tiny_config(make_tiny_model, compile_in_background=False)))
    shutil.rmtree(records)  # forget that the reference compiled the kernels
    released_while_compiling = []
    compile_in_child = CpuExecutor.compile_in_child

    def watched(self: CpuExecutor, block_size: int, release_dense: bool = False) -> bool:
        wait = os.waitpid

        def waitpid(pid: int, options: int) -> tuple[int, int]:
            linears = [lin.weight for layer in self.model.layers for lin in layer.linears()]
            released_while_compiling.append(all(w.is_meta for w in linears))
            return wait(pid, options)

        monkeypatch.setattr(os, "waitpid", waitpid)
        try:
            return compile_in_child(self, block_size, release_dense)
        finally:
            monkeypatch.setattr(os, "waitpid", wait)

    monkeypatch.setattr(model_runner, "child_compile_fits", lambda *args: False)
    monkeypatch.setattr(CpuExecutor, "compile_in_child", watched)
    engine = LLMEngine(tiny_config(make_tiny_model))
    executor = engine.runner.executor
    if executor is None:
        pytest.skip("no CPU executor on this machine")
    assert executor.active and executor.error is None
    assert released_while_compiling and all(released_while_compiling)
    assert compile_record.compiled_before(engine.runner._kernel_set)
    assert greedy_tokens(engine) == reference


def test_a_failed_child_when_compiling_first_reads_the_dense_weights_again(
    records: Path, make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedinfer.kernels.cpu.executor import CpuExecutor
    from pagedinfer.service import model_runner

    reference = greedy_tokens(LLMEngine(tiny_config(make_tiny_model, compile_in_background=False)))
    shutil.rmtree(records)  # forget that the reference compiled the kernels
    forked = records.parent / "forked"

    def child(self: CpuExecutor, block_size: int) -> None:
        forked.touch()
        os._exit(3)

    monkeypatch.setattr(model_runner, "child_compile_fits", lambda *args: False)
    monkeypatch.setattr(CpuExecutor, "_warm_up_and_exit", child)
    engine = LLMEngine(tiny_config(make_tiny_model))
    if not forked.exists():
        pytest.skip("no CPU executor on this machine")
    assert engine.runner.executor is None
    assert not any(p.is_meta for p in engine.runner.model.parameters())
    assert greedy_tokens(engine) == reference
