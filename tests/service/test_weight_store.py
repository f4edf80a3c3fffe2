"""The executor's built grids kept between starts: a second start reads them instead of
choosing them again and serves the same logits bit for bit; a store that is unreadable,
of other shapes, or that cannot be written never stops the executor."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache
from test_fused_step import grid_model, on_grid

from pagedinfer.kernels import cpu, torch_ops
from pagedinfer.kernels.cpu import executor as executor_module
from pagedinfer.kernels.cpu import grid_gemm, weight_store

pytestmark = pytest.mark.skipif(
    not torch_ops.compiled_kernels(), reason="grids run on the compiled kernels"
)
PROMPT = [(0, list(range(3, 30)), 0)]


def mixed_model() -> torch.nn.Module:
    """Every kind of position: 4-bit, 8-bit and 8-bit fine grids, and fp32 tiles."""
    model = grid_model(seed=2)
    rng = np.random.default_rng(7)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            _, o, gate_up, down = layer.linears()
            o.weight.copy_(on_grid(*o.weight.shape, rng, 8))
            gate_up.weight.normal_(0, 0.05)
            if i == 1:
                down.weight.copy_(on_grid(*down.weight.shape, rng, 8))
    return model


def logits(executor: cpu.CpuExecutor) -> torch.Tensor:
    return PagedCache(executor.config, 1, 40, seed=3).step(executor, PROMPT)[0]


def test_a_second_start_reads_the_stored_grids_and_serves_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, store = mixed_model(), tmp_path / "grids.npz"
    first = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert first is not None and store.is_file()
    kinds = (grid_gemm.AFFINE4, grid_gemm.SCALED8, grid_gemm.REBUILT, grid_gemm.FINE8)
    assert first.fused.kinds == (*kinds, grid_gemm.SCALED8)

    def never(*args: object) -> None:
        raise AssertionError("the grids were chosen again")

    monkeypatch.setattr(executor_module, "choose_grids", never)
    second = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert second is not None and second.mode == first.mode
    assert second.fused.kinds == first.fused.kinds
    assert torch.equal(logits(second), logits(first))


def test_an_unreadable_store_is_chosen_again_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, store = mixed_model(), tmp_path / "grids.npz"
    store.write_bytes(b"not a zip file")
    with caplog.at_level(logging.WARNING, logger="pagedinfer.kernels.cpu.weight_store"):
        executor = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    assert executor is not None and executor.mode == "grid"
    assert "unreadable weight store" in caplog.text
    shapes = [[tuple(w.shape) for w in ws] for ws in executor_module._gemm_weights(model)]
    assert weight_store.load(store, shapes) is not None


def test_a_store_of_other_shapes_is_ignored(tmp_path: Path) -> None:
    model, store = mixed_model(), tmp_path / "grids.npz"
    cpu.prepare(copy.deepcopy(model), BLOCK_SIZE, store=store)
    shapes = [[tuple(w.shape) for w in ws] for ws in executor_module._gemm_weights(model)]
    assert weight_store.load(store, shapes) is not None
    assert weight_store.load(store, shapes[1:]) is None  # one layer fewer
    wider = [[(out * 2, k) for out, k in layer] for layer in shapes]
    assert weight_store.load(store, wider) is None


def test_a_store_that_cannot_be_written_leaves_the_executor_serving(tmp_path: Path) -> None:
    model = mixed_model()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    reference = copy.deepcopy(model)
    executor = cpu.prepare(model, BLOCK_SIZE, store=blocker / "grids.npz")
    assert executor is not None and executor.active
    assert not (blocker / "grids.npz").exists()
    torch.testing.assert_close(
        logits(executor),
        PagedCache(reference.config, 1, 40, seed=3).step(reference, PROMPT)[0],
        rtol=1e-4,
        atol=1e-4,
    )
