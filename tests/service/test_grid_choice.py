"""The CPU executor's grids, one GEMM position at a time: a position whose weights all lie
on grids runs from them (each layer in its own kind where they come in two), any other
from its fp32 tiles (rebuilt), and the
fused step and the layered path agree bit for bit on such a mix; grids a GGUF file's
blocks give are taken where they equal the model's weights, and checked, never trusted."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache
from test_fused_step import assert_fused_matches_layered, grid_model, on_grid, prefilled

from pagedinfer.kernels import cpu, torch_ops
from pagedinfer.kernels.cpu import greedy_argmax, grid_gemm
from pagedinfer.kernels.cpu.executor import choose_grids, weight_grid
from pagedinfer.service.gguf_quants import BlockGrid

pytestmark = pytest.mark.skipif(
    not torch_ops.compiled_kernels(), reason="grids run on the compiled kernels"
)


def five_bit_grid(out_features: int, in_features: int, rng: np.random.Generator) -> BlockGrid:
    """A GGUF Q5_1 weight's grid: codes 0..31 with an offset, on no grid `to_grid` finds."""
    blocks = (out_features, in_features // 32)
    return BlockGrid(
        codes=rng.integers(0, 32, (out_features, in_features)).astype(np.int8),
        d=(rng.random(blocks) * 0.01 + 1e-3).astype(np.float16),
        m=(-rng.random(blocks) * 0.15).astype(np.float16),
        low=0,
        high=31,
    )


def mixed_kinds_model() -> torch.nn.Module:
    """q/k/v on 4-bit grids, o on 8-bit ones, gate/up on none, down 4-bit in layer 0
    and 8-bit in layer 1."""
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


def test_each_position_takes_its_grids_or_its_fp32_tiles() -> None:
    """q/k/v on 4-bit grids, o on 8-bit ones, gate/up on none, down mixing 4 and 8 bits
    across layers: (affine4, scaled8, rebuilt, affine4 in layers 0 and 2 beside scaled8
    in layer 1) and the 8-bit LM head; the fused step gives the layered logits and cache
    bit for bit, close to the torch forward's."""
    model = mixed_kinds_model()
    reference = copy.deepcopy(model)
    down_grids = [grid_gemm.to_grid(layer.linears()[3].weight) for layer in model.layers]
    executor = cpu.prepare(model, BLOCK_SIZE)
    assert executor is not None and executor.mode == "grid"
    fused = executor.fused
    kinds = (grid_gemm.AFFINE4, grid_gemm.SCALED8, grid_gemm.REBUILT, grid_gemm.AFFINE4)
    assert fused.kinds == (*kinds, grid_gemm.SCALED8)
    assert fused.second_kinds == (None, None, None, grid_gemm.SCALED8)
    assert fused.layer_slots[3].tolist() == [0, -1, 1]
    for i, grid in enumerate(down_grids):  # each layer's own grid, in fp16 scales
        view = fused.layer_grid(3, i)
        assert view.variant == grid.variant
        assert np.array_equal(view.codes, grid.codes)
    # Each layer in its own kind reads fewer bytes than all in one kind that holds them.
    one_kind = grid_gemm.one_kind(down_grids)
    own = fused.codes[3].nbytes + fused.scales[3].nbytes
    own += fused.second_codes[3].nbytes + fused.second_scales[3].nbytes
    assert own < 0.8 * sum(g.nbytes for g in one_kind)
    chunks = [(0, [5], 20), (1, [1, 2, 3, 4, 5], 33)]
    assert_fused_matches_layered(executor, prefilled(executor, [20, 33]), chunks)
    cache = PagedCache(reference.config, 1, 40, seed=3)
    prompt = [(0, list(range(3, 30)), 0)]
    torch.testing.assert_close(
        cache.step(executor, prompt)[0],
        PagedCache(reference.config, 1, 40, seed=3).step(reference, prompt)[0],
        rtol=1e-4,
        atol=1e-4,
    )


def test_a_weight_takes_the_grid_of_the_files_blocks_where_they_give_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Q5_1-like gate/up weights and LM head (5-bit codes with offsets: no grid in their
    values) come from the file's blocks; the greedy argmax rounds the LM head, which has
    offsets, to 8-bit codes of its own."""
    model = grid_model(seed=3)
    rng = np.random.default_rng(8)
    blocks = {}
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            weight = layer.linears()[2].weight
            blocks[f"layers.{i}.mlp.gate_up_proj.weight"] = grid = five_bit_grid(*weight.shape, rng)
            weight.copy_(torch.from_numpy(grid.dense()))
        weight = model.embed_tokens.weight
        blocks["embed_tokens.weight"] = grid = five_bit_grid(*weight.shape, rng)
        weight.copy_(torch.from_numpy(grid.dense()))
    model.gguf_grids = blocks
    grid, source = weight_grid(weight, "embed_tokens.weight", blocks)
    assert grid.kind == grid_gemm.SCALED8 and "blocks" in source
    assert torch.equal(grid.dense(), weight)
    assert grid_gemm.to_grid(weight) is None
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="pagedinfer.kernels.cpu.executor"):
        executor = cpu.prepare(model, BLOCK_SIZE)
    assert executor is not None and executor.mode == "grid"
    assert executor.fused.kinds == (grid_gemm.AFFINE4,) * 2 + (grid_gemm.SCALED8,) + (
        grid_gemm.AFFINE4,
        grid_gemm.SCALED8,
    )
    assert (executor.argmax is not None) == greedy_argmax.fast()
    if executor.argmax is not None:
        blocks = executor.argmax.bounds.shape[1] // 2
        assert executor.argmax.bounds[:, blocks:].any()  # rounded: not the file's codes
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "gate_up scaled8 (from the file's blocks)" in said
    assert "qkv affine4 (found in the fp32 values)" in said
    prompt = [(0, list(range(3, 30)), 0)]
    torch.testing.assert_close(
        PagedCache(reference.config, 1, 40).step(executor, prompt)[0],
        PagedCache(reference.config, 1, 40).step(reference, prompt)[0],
        rtol=1e-4,
        atol=1e-4,
    )


def test_blocks_that_do_not_give_the_weight_are_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The safety net: a file grid that differs from the model's weight by one value is
    refused with a warning, and the grid found in the fp32 values serves."""
    model = grid_model(seed=4)
    weight = model.layers[0].linears()[1].weight
    grid = five_bit_grid(*weight.shape, np.random.default_rng(9))
    with torch.no_grad():
        weight.copy_(torch.from_numpy(grid.dense()))
        weight[3, 5] += 0.25
    name = "layers.0.self_attn.o_proj.weight"
    with caplog.at_level(logging.WARNING, logger="pagedinfer.kernels.cpu.executor"):
        found, source = weight_grid(weight, name, {name: grid})
    assert found is None and source == ""
    assert f"{name}: the file's blocks do not give the model's weight" in caplog.text
    model.gguf_grids = {name: grid}
    layers, _ = choose_grids(model)
    assert [g.kind for g in layers[0]] == [
        grid_gemm.AFFINE4,
        grid_gemm.REBUILT,
        grid_gemm.AFFINE4,
        grid_gemm.AFFINE4,
    ]


def test_a_bf16_checkpoint_served_in_fp32_runs_from_its_16_bits() -> None:
    """Weights that are all bf16 values (a checkpoint published in bf16, loaded in fp32)
    are held in their 16 bits at every position, half the fp32 tiles' bytes; the fused
    step gives the layered logits and cache bit for bit, close to the torch forward's.
    One layer's weight off bf16 keeps that whole position in fp32 tiles."""
    model = grid_model(seed=5)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.layers:
            for linear in layer.linears():
                linear.weight.normal_(0, 0.05, generator=generator)
                linear.weight.copy_(linear.weight.bfloat16().float())
        model.embed_tokens.weight.normal_(0, 0.05, generator=generator)
        model.embed_tokens.weight.copy_(model.embed_tokens.weight.bfloat16().float())
    mixed = copy.deepcopy(model)
    with torch.no_grad():
        down = mixed.layers[1].linears()[3].weight
        down[0, 0] = torch.nextafter(down[0, 0], torch.tensor(1.0))
    layers, _ = choose_grids(mixed)
    assert [g.kind for g in layers[0]] == [grid_gemm.BF16] * 3 + [grid_gemm.REBUILT]
    reference = copy.deepcopy(model)
    executor = cpu.prepare(model, BLOCK_SIZE)
    assert executor is not None and executor.mode == "rebuilt"
    assert executor.fused.kinds == (grid_gemm.BF16,) * 5
    assert all(codes.dtype == np.uint16 for codes in executor.fused.codes)
    chunks = [(0, [5], 20), (1, [1, 2, 3, 4, 5], 33)]
    assert_fused_matches_layered(executor, prefilled(executor, [20, 33]), chunks)
    prompt = [(0, list(range(3, 30)), 0)]
    torch.testing.assert_close(
        PagedCache(reference.config, 1, 40, seed=3).step(executor, prompt)[0],
        PagedCache(reference.config, 1, 40, seed=3).step(reference, prompt)[0],
        rtol=1e-4,
        atol=1e-4,
    )
