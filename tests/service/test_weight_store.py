"""The executor's built grids kept between starts: a second start reads them instead of
choosing them again and serves the same logits bit for bit; a store that is unreadable,
of other shapes, or that cannot be written never stops the executor."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache
from test_grid_choice import mixed_kinds_model

from pagedinfer.kernels import cpu, torch_ops
from pagedinfer.kernels.cpu import executor as executor_module
from pagedinfer.kernels.cpu import grid_gemm, weight_store

pytestmark = pytest.mark.skipif(
    not torch_ops.compiled_kernels(), reason="grids run on the compiled kernels"
)
PROMPT = [(0, list(range(3, 30)), 0)]

if TYPE_CHECKING:
    from pagedinfer.service.engine import LLMEngine


def logits(executor: cpu.CpuExecutor) -> torch.Tensor:
    return PagedCache(executor.config, 1, 40, seed=3).step(executor, PROMPT)[0]


def test_a_second_start_reads_the_stored_grids_and_serves_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, store = mixed_kinds_model(), tmp_path / "grids.bin"
    first = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert first is not None and store.is_file()
    kinds = (grid_gemm.AFFINE4, grid_gemm.SCALED8, grid_gemm.REBUILT, grid_gemm.AFFINE4)
    assert first.fused.kinds == (*kinds, grid_gemm.SCALED8)
    assert first.fused.second_kinds == (None, None, None, grid_gemm.SCALED8)

    def never(*args: object) -> None:
        raise AssertionError("the grids were chosen again")

    monkeypatch.setattr(executor_module, "choose_grids", never)
    second = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert second is not None and second.mode == first.mode
    assert second.fused.kinds == first.fused.kinds
    assert second.fused.second_kinds == first.fused.second_kinds
    assert np.array_equal(second.fused.layer_slots, first.fused.layer_slots)
    assert [a.dtype for a in second.fused.scales] == [a.dtype for a in first.fused.scales]
    assert torch.equal(logits(second), logits(first))


def test_stored_kinds_are_the_kernels_own_strings_so_their_disk_cache_hits(
    tmp_path: Path,
) -> None:
    """numba keys a kernel's disk cache on a pickle of its closure, where a string met
    twice is a back-reference only if it is one object: a kind read back as an equal
    string from the store's JSON gave the kernels other keys than the first build's, and
    a warm start compiled them all again."""
    from numba.core.serialize import dumps

    model, store = mixed_kinds_model(), tmp_path / "grids.bin"
    cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    shapes = executor_module.gemm_shapes(model)
    layers, lm_head = weight_store.load(store, shapes)
    for grid in (*layers[0], lm_head):
        own = next(k for k in (*grid_gemm.GRIDS, *grid_gemm.DENSE) if k == grid.kind)
        assert grid.kind is own
        assert dumps((grid.kind, own)) == dumps((own, own))


def test_an_unreadable_store_is_chosen_again_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, store = mixed_kinds_model(), tmp_path / "grids.bin"
    store.write_bytes(b"not a zip file")
    with caplog.at_level(logging.WARNING, logger="pagedinfer.kernels.cpu.weight_store"):
        executor = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert executor is not None and executor.mode == "grid"
    assert "unreadable weight store" in caplog.text
    shapes = executor_module.gemm_shapes(model)
    assert weight_store.load(store, shapes) is not None


def test_a_store_of_other_shapes_is_ignored(tmp_path: Path) -> None:
    model, store = mixed_kinds_model(), tmp_path / "grids.bin"
    cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    shapes = executor_module.gemm_shapes(model)
    assert weight_store.load(store, shapes) is not None
    assert weight_store.load(store, shapes[1:]) is None  # one layer fewer
    wider = [[(out * 2, k) for out, k in layer] for layer in shapes]
    assert weight_store.load(store, wider) is None


def test_a_store_that_cannot_be_written_leaves_the_executor_serving(tmp_path: Path) -> None:
    model = mixed_kinds_model()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    reference = copy.deepcopy(model)
    executor = cpu.prepare(model, BLOCK_SIZE, store=blocker / "grids.bin")
    assert executor is not None and executor.active
    assert not (blocker / "grids.bin").exists()
    torch.testing.assert_close(
        logits(executor),
        PagedCache(reference.config, 1, 40, seed=3).step(reference, PROMPT)[0],
        rtol=1e-4,
        atol=1e-4,
    )


def greedy(engine: LLMEngine, prompt: list[int]) -> list[int]:
    from pagedinfer.service.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.token_ids
    return tokens


def test_a_start_over_a_stored_executor_never_reads_the_dense_gemm_weights(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_tiny_model: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first start builds and stores; the second serves with the layers' GEMM weights
    left unread and the same tokens; over a broken store it reads them after all, serves
    the same tokens, and stores again."""
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.engine import LLMEngine

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path))
    model = shutil.copytree(make_tiny_model("llama"), tmp_path / "model")
    config = EngineConfig(model=str(model), max_model_len=64, kv_cache_memory=2**22)
    prompt = list(range(5, 25))

    first = LLMEngine(config)
    assert first.runner.executor is not None and first.runner.executor.active
    stores = list((tmp_path / "cpu-weights").glob("*.bin"))
    assert len(stores) == 1
    want = greedy(first, prompt)

    second = LLMEngine(config)
    layer = second.runner.model.layers[0]
    assert second.runner.executor.active
    assert "GEMM grids read from the store" in caplog.text
    assert greedy(second, prompt) == want
    # Left unread, not merely released: the loader skipped them.
    loads = []
    monkeypatch.setattr("pagedinfer.service.loader._read_into", lambda *a: loads.append(a[1].name))
    LLMEngine(config)
    assert loads and not any("proj" in name or name == "lm_head.weight" for name in loads)
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path))
    assert all(linear.weight.is_meta for linear in layer.linears())

    stores[0].write_bytes(b"broken")
    caplog.clear()
    third = LLMEngine(config)
    layer_owner = third.runner.model
    assert third.runner.executor.active
    assert "not serving from its stored weights" in caplog.text
    assert greedy(third, prompt) == want
    shapes = executor_module.gemm_shapes(layer_owner)
    assert weight_store.load(stores[0], shapes) is not None  # stored again


def test_a_store_cut_short_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, store = mixed_kinds_model(), tmp_path / "grids.bin"
    cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    shapes = executor_module.gemm_shapes(model)
    whole = store.read_bytes()
    for cut in (len(whole) - 1, len(whole) // 2, 40, 0):
        store.write_bytes(whole[:cut])
        assert weight_store.load(store, shapes) is None, cut
    assert "unreadable weight store" in caplog.text


def test_a_store_broken_before_activation_leaves_the_torch_forward_serving(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_tiny_model: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a child compiled the kernels and stored the weights, the server reads them at
    activation, once its dense weights are released; a store broken by then gets the
    dense weights read again, and the torch forward serves the tokens an executor would."""
    from pagedinfer.kernels.cpu import compile_record
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.engine import LLMEngine

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_record, "record_directory", lambda: tmp_path / "records")
    model = shutil.copytree(make_tiny_model("llama"), tmp_path / "model")
    config = EngineConfig(
        model=str(model), max_model_len=64, kv_cache_memory=2**22, compile_in_background=True
    )
    prompt = list(range(5, 25))

    engine = LLMEngine(config)
    executor = engine.runner.executor
    assert executor is not None and executor.wait_ready(timeout=900), executor.error
    if "compiling the kernels in a child process" not in caplog.text:
        pytest.skip("no fork or no writable numba cache here: nothing is built at activation")
    assert executor.fused is None  # left for activation
    (store,) = (tmp_path / "cpu-weights").glob("*.bin")
    store.write_bytes(b"broken")
    tokens = greedy(engine, prompt)
    assert "failed to start serving; the torch forward serves" in caplog.text
    assert engine.runner.executor is None
    layer = engine.runner.model.layers[0]
    assert not any(linear.weight.is_meta for linear in layer.linears())

    reference = LLMEngine(dataclasses.replace(config, compile_in_background=False))
    assert reference.runner.executor is not None and reference.runner.executor.active
    assert tokens == greedy(reference, prompt)


def test_bf16_product_weights_come_back_as_their_words(tmp_path: Path) -> None:
    """A model served with bf16 products stores its layers' BF16_DOT words and its LM
    head's bf16 values, and reads them back bit for bit as the kernels' own kinds."""
    generator = torch.Generator().manual_seed(5)
    shapes = [[(192, 64), (64, 64), (256, 64), (64, 128)], [(128, 64)]]
    layer = [
        grid_gemm.rebuilt(torch.randn(shape, generator=generator), grid_gemm.BF16_DOT)
        for shape in shapes[0]
    ]
    head = grid_gemm.rebuilt(
        torch.randn(shapes[1][0], generator=generator).bfloat16().float(), grid_gemm.BF16
    )
    store = tmp_path / "grids.bin"
    assert weight_store.save(store, ([layer], head))
    layers, lm_head = weight_store.load(store, shapes)
    for ours, stored in zip((*layer, head), (*layers[0], lm_head), strict=True):
        assert stored.kind is (grid_gemm.BF16 if ours is head else grid_gemm.BF16_DOT)
        assert stored.codes.dtype == ours.codes.dtype
        assert torch.equal(stored.dense(), ours.dense())


def test_the_directory_keeps_only_the_stores_used_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_store, "MAX_BYTES", 350)
    stores = [tmp_path / f"{i}.bin" for i in range(5)]
    for age, store in enumerate(stores):  # stores[0] used last
        store.write_bytes(b"x" * 100)
        os.utime(store, ns=(10**18 - age * 10**9,) * 2)
    other = tmp_path / "other.txt"  # not a store: never touched
    other.write_text("kept")
    oldest = stores[-1]
    assert weight_store.prune(tmp_path, keep=oldest) == [stores[2], stores[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.bin", "1.bin", "4.bin", "other.txt"]
    # A large store pushes out every other.
    (tmp_path / "big.bin").write_bytes(b"x" * 950)
    assert weight_store.prune(tmp_path, keep=tmp_path / "big.bin") == [
        stores[0], stores[1], stores[4]
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.bin", "other.txt"]


def test_reading_a_store_marks_it_used_and_writing_prunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = mixed_kinds_model()
    assert cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=tmp_path / "a.bin") is not None
    for used, name in enumerate(("a.bin", "b.bin", "c.bin"), start=1):
        if name != "a.bin":
            shutil.copy(tmp_path / "a.bin", tmp_path / name)
        os.utime(tmp_path / name, ns=(used, used))  # a.bin used longest ago
    grids = weight_store.load(tmp_path / "a.bin", executor_module.gemm_shapes(model))
    assert grids is not None  # and a.bin is now the one used last
    monkeypatch.setattr(weight_store, "MAX_BYTES", 2 * (tmp_path / "a.bin").stat().st_size)
    assert weight_store.save(tmp_path / "d.bin", grids)
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["a.bin", "d.bin"]
