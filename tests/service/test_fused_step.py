"""The CPU executor's fused step: a forward pass of a few tokens as one compiled call
gives the logits and the KV cache of the executor's pass layer by layer, bit for bit."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

pytest.importorskip("numba", reason="the fused step is compiled with numba")

from pagedinfer.kernels import AttentionMetadata, cpu, torch_ops
from pagedinfer.kernels.cpu import executor as executor_module
from pagedinfer.kernels.cpu import fused_step, greedy_argmax, grid_gemm
from pagedinfer.kernels.cpu.executor import (
    CpuExecutor,
    choose_mode,
    decode_plan,
    find_grids,
)
from pagedinfer.service.models import DecoderModel, build_model
from pagedinfer.service.models.llama import LlamaModel, ModelConfig

pytestmark = pytest.mark.skipif(
    not torch_ops.compiled_kernels(), reason="the fused step runs on the compiled kernels"
)


def on_grid(
    out_features: int, in_features: int, rng: np.random.Generator, bits: int
) -> torch.Tensor:
    """A weight as a GGUF model dequantises: Q4_1 (bits=4) or Q8_0 (bits=8)."""
    blocks = (out_features, in_features // 32, 1)
    d = (rng.random(blocks) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    if bits == 4:
        m = (-rng.random(blocks) * 0.15).astype(np.float16).astype(np.float32)
        q = rng.integers(0, 16, (out_features, in_features // 32, 32)).astype(np.float32)
        q[..., 0], q[..., 1] = 0, 15  # as quantising does: the least and largest values
        w = (d * q).astype(np.float32) + m
    else:
        q = rng.integers(-127, 128, (out_features, in_features // 32, 32)).astype(np.float32)
        q[..., 0] = -127  # the block's largest magnitude
        w = (d * q).astype(np.float32)
    return torch.from_numpy(w.reshape(out_features, in_features))


def grid_model(
    seed: int = 0,
    attention_bias: bool = False,
    o_proj_bias: bool = False,
    qk_norm: bool = False,
    **config_fields: Any,
) -> DecoderModel:
    """A small Llama whose GEMM weights lie on 4-bit grids and whose (tied) embeddings on
    an 8-bit one, as a GGUF file's Q4_1 and Q8_0 weights load; with q/k/v biases (as
    Qwen2's), an o_proj bias and q/k head norms (a Qwen3 of these shapes) where asked,
    each drawn at random, and any other `ModelConfig` fields given (an architecture among
    them: its own norms drawn too)."""
    architecture = config_fields.pop("architecture", "qwen3" if qk_norm else "llama")
    config = ModelConfig(
        architecture=architecture,
        vocab_size=512,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        qk_norm=qk_norm,
        max_position_embeddings=1024,  # room for a step past the grid's 512 rows
        **config_fields,
    )
    rng = np.random.default_rng(seed)
    model = build_model(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for linear in layer.linears():
                out_features, in_features = linear.weight.shape
                linear.weight.copy_(on_grid(out_features, in_features, rng, 4))
            for norm in layer.block_norms():
                if norm is not None:
                    norm.weight.copy_(torch.from_numpy(rng.random(256).astype(np.float32) + 0.5))
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:
                    norm.weight.copy_(torch.from_numpy(rng.random(64).astype(np.float32) + 0.5))
        model.embed_tokens.weight.copy_(on_grid(512, 256, rng, 8))
        for linear in (lin for layer in model.layers for lin in layer.linears()):
            if linear.bias is not None:
                linear.bias.copy_(torch.from_numpy(rng.normal(0, 0.05, linear.bias.shape)))
    return model


def grid_executor(model: DecoderModel) -> CpuExecutor:
    """The executor `cpu.prepare` makes of a model on grids: grid GEMMs and the fused step."""
    executor = cpu.prepare(model, BLOCK_SIZE)
    assert executor is not None and executor.active
    assert executor.mode == "grid" and executor.fused is not None
    return executor


@contextlib.contextmanager
def fused_step_allowed(executor: CpuExecutor, fused: bool) -> Iterator[None]:
    """The executor with its fused step (fused) or layer by layer (not fused) in the block."""
    saved = executor.fused
    executor.fused = saved if fused else None
    try:
        yield
    finally:
        executor.fused = saved


def run(
    cache: PagedCache, executor: CpuExecutor, chunks: list[tuple[int, list[int], int]], fused: bool
) -> torch.Tensor:
    """One forward over (sequence, new tokens, start) chunks, with the fused step allowed
    or not; the logits of every new token."""
    with fused_step_allowed(executor, fused):
        return torch.cat(cache.step(executor, chunks))


@pytest.fixture(scope="module")
def executor() -> CpuExecutor:
    return grid_executor(grid_model())


def prefilled(
    executor: CpuExecutor, lengths: list[int], room: int = 16, dtype: torch.dtype = torch.float32
) -> PagedCache:
    """A cache of `dtype` holding a prompt of each length, with room for `room` more
    tokens each."""
    cache = PagedCache(executor.config, len(lengths), max(lengths) + room, seed=3, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = executor.config.vocab_size
    prompts = [
        (s, torch.randint(0, vocab, (n,), generator=gen).tolist(), 0) for s, n in enumerate(lengths)
    ]
    run(cache, executor, prompts, fused=False)
    return cache


def assert_fused_matches_layered(
    executor: CpuExecutor, base: PagedCache, chunks: list[tuple[int, list[int], int]]
) -> None:
    """The chunks from copies of `base`: the fused step and the layer-by-layer path give
    the same logits and the same KV cache, bit for bit."""
    fused_cache, layered_cache = base.copy(), base.copy()
    fused = run(fused_cache, executor, chunks, fused=True)
    assert torch.equal(fused, run(layered_cache, executor, chunks, fused=False))
    assert fused_cache.equals(layered_cache)


def assert_fused_is_the_model_not_the_plain_one(executor: Any, reference: Any, plain: Any) -> None:
    """Over two prefilled sequences: the fused step gives the layered path's logits and K/V
    bit for bit, the model's own torch forward (`reference`) within rounding, and differs
    from `plain`, an executor of the same shapes without the feature under test."""
    base = prefilled(executor, [20, 33])
    chunks = [(0, [5], 20), (1, [1, 2, 3, 4, 5], 33)]
    assert_fused_matches_layered(executor, base, chunks)
    fused = run(base.copy(), executor, chunks, fused=True)
    theirs = torch.cat(base.copy().step(reference, chunks))
    torch.testing.assert_close(fused, theirs, rtol=1e-4, atol=1e-4)
    assert (run(base.copy(), plain, chunks, fused=True) - fused).abs().max() > 1e-2


def test_a_model_on_grids_gets_the_fused_step(executor: CpuExecutor) -> None:
    assert executor.fused.kinds == ("affine4",) * 4 + ("scaled8",)
    assert executor.compiled
    # Its LM head picks greedy rows' tokens where that is faster than the logits.
    assert (executor.fused.argmax is not None) == greedy_argmax.fast()
    assert executor.argmax is executor.fused.argmax
    # Every GEMM, the fused step's and layer by layer, sums in the one fixed order.
    assert executor.fused.orders == tuple(
        grid_gemm.fixed_order(k) for k in (256, 256, 256, 512, 256)
    )
    assert executor.layers[1].down.order == grid_gemm.fixed_order(512)
    # The executor owns the weights: the model's dense GEMM copies are released.
    model = executor.model
    assert all(linear.weight.is_meta for layer in model.layers for linear in layer.linears())


@pytest.mark.skipif(not greedy_argmax.fast(), reason="greedy rows are picked with AVX2 or VNNI")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layer-by-layer"])
def test_greedy_rows_get_the_argmax_of_their_logits_without_them(
    executor: CpuExecutor, fused: bool
) -> None:
    """A decode, a 4-token draft and a prompt's rows, some greedy: each greedy row's token is
    the argmax of the logits a step without greedy rows gives; the other rows get the same
    logits as there."""
    base = prefilled(executor, [30, 50])
    chunks = [(0, [11], 30), (1, [5, 6, 7, 8, 9], 50)]
    greedy = torch.tensor([True, True, False, True, True, False])
    with fused_step_allowed(executor, fused):
        expected, tokens = base.copy().forward(executor, chunks)
        assert tokens is None
        logits, tokens = base.copy().forward(executor, chunks, greedy)
    assert tokens is not None
    assert tokens[greedy].tolist() == expected[greedy].argmax(dim=1).tolist()
    assert (tokens[~greedy] == -1).all()
    assert torch.equal(logits[~greedy], expected[~greedy])


def test_greedy_rows_of_the_wrong_shape_are_refused(executor: CpuExecutor) -> None:
    cache = prefilled(executor, [20])
    with pytest.raises(ValueError, match=r"greedy has shape \(3,\), logits_indices \(2,\)"):
        cache.forward(executor, [(0, [1, 2], 20)], torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "new_tokens",
    [[1], [1, 1, 1], [5, 1], [2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1], [3, 5], [5, 5, 5, 5, 4]],
    ids=[
        "one",
        "three-decodes",
        "draft-and-decode",
        "four-runs",
        "eight-decodes",
        "runs",
        "three-passes",  # 24 rows: two passes of 8 over each weight, then 8 more
    ],
)
def test_the_fused_step_gives_the_layered_logits_and_cache(
    executor: CpuExecutor, new_tokens: list[int], threads: int
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lengths = [20, 47, 33, 16, 90, 5, 64, 31][: len(new_tokens)]
        base = prefilled(executor, lengths)
        gen = torch.Generator().manual_seed(sum(new_tokens))
        chunks = [
            (s, torch.randint(0, 512, (n,), generator=gen).tolist(), lengths[s])
            for s, n in enumerate(new_tokens)
        ]
        assert_fused_matches_layered(executor, base, chunks)
    finally:
        torch.set_num_threads(previous)


def test_a_position_in_more_than_two_kinds_is_refused() -> None:
    """The fused step runs a layer position in at most two kinds; `choose_grids` makes one
    kind of more (`grid_gemm.one_kind`)."""
    rng = np.random.default_rng(4)
    weights = [on_grid(64, 64, rng, 4), on_grid(64, 64, rng, 8), on_grid(64, 64, rng, 4)]
    grids = [grid_gemm.to_grid(w) for w in weights]
    grids[2] = grid_gemm.fine(grids[2])
    layers = [[g, g, g, g] for g in grids]
    orders = [grid_gemm.fixed_order(64)] * 5
    norms = np.ones((3, 2, 64), np.float32)
    rope = np.array([(16, 0)] * 3)
    stack = fused_step.FusedWeights.stack
    assert stack(layers, grids[1], orders, 8, norms, norms[0, 0], 1e-5, rope) is None
    two = stack(layers[:2], grids[1], orders, 8, norms[:2], norms[0, 0], 1e-5, rope[:2])
    assert two is not None and two.second_kinds == (grid_gemm.SCALED8,) * 4


BF16_LAYER_KINDS = [grid_gemm.BF16_DOT, grid_gemm.BF16]


def bf16_executor(kind: str) -> CpuExecutor:
    """The grid model's weights rounded to bf16, served with bf16 products, its layers'
    weights in `kind` (what `bf16_layer_kind` picks on one CPU or another)."""
    model = grid_model(seed=1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(executor_module, "bf16_layer_kind", lambda: kind)
        executor = cpu.prepare(model, BLOCK_SIZE, bf16_products=True)
    assert executor is not None and executor.fused is not None
    assert executor.fused.kinds[:4] == (kind,) * 4
    return executor


@pytest.mark.parametrize("kind", BF16_LAYER_KINDS)
@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [5, 1, 3], [40, 1]], ids=str)
def test_bf16_products_over_a_bf16_cache_give_the_layered_logits_and_cache(
    new_tokens: list[int], kind: str
) -> None:
    """A model served with bf16 products (`--dtype bfloat16`) keeps K and V in a bf16
    cache: the fused step and the layer-by-layer path round and read them alike."""
    executor = bf16_executor(kind)
    lengths = [20, 47, 33][: len(new_tokens)]
    base = prefilled(executor, lengths, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(sum(new_tokens))
    chunks = [
        (s, torch.randint(0, 512, (n,), generator=gen).tolist(), lengths[s])
        for s, n in enumerate(new_tokens)
    ]
    assert_fused_matches_layered(executor, base, chunks)
    logits = run(base.copy(), executor, chunks, fused=True)
    assert logits.isfinite().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_comes_out_the_same_in_a_step_of_any_size(
    executor: CpuExecutor, threads: int
) -> None:
    """A decode's logits from the fused step of its one token equal those it gets beside a
    prompt chunk that makes the step too large for it, layer by layer, its GEMMs over
    scratch rather than in one pass: every grid GEMM sums in the one fixed order."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = prefilled(executor, [20, 5], room=executor.fused.max_tokens + 16)
        decode = (0, [42], 20)
        chunk = (1, [100 + i % 300 for i in range(executor.fused.max_tokens + 8)], 5)
        alone = run(base.copy(), executor, [decode], fused=True)
        crowded = run(base.copy(), executor, [decode, chunk], fused=True)
        assert torch.equal(alone[0], crowded[0])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("rows", [[1, 7, 40, 41], [41], []], ids=["some", "one", "none"])
def test_rows_without_logits_skip_the_last_layers_mlp_and_change_nothing(
    request: pytest.FixtureRequest, rows: list[int], family: str
) -> None:
    """Two prompt chunks and a decode with logits (and greedy tokens) for a few rows only:
    the fused step runs the last layer's attention output and MLP (and Gemma 3's norms of
    their outputs) for those rows alone, and gives them the logits and tokens the
    layer-by-layer step gives, with the same K/V."""
    if family == "llama":
        executor = request.getfixturevalue("executor")
    else:
        executor, _ = request.getfixturevalue("gemma3_executor")
    base = prefilled(executor, [20, 5, 9], room=40)
    chunks = [(0, [42], 20), (1, [3 + i % 40 for i in range(30)], 5), (2, [8] * 11, 9)]
    greedy = torch.tensor([i % 2 == 0 for i in range(len(rows))], dtype=torch.bool)
    fused_cache, layered_cache = base.copy(), base.copy()
    fused_logits, fused_tokens = fused_cache.forward(executor, chunks, greedy, rows)
    with fused_step_allowed(executor, False):
        layered_logits, layered_tokens = layered_cache.forward(executor, chunks, greedy, rows)
    full = ~greedy if fused_tokens is not None else torch.ones(len(rows), dtype=torch.bool)
    assert torch.equal(fused_logits[full], layered_logits[full])
    if fused_tokens is not None:
        assert torch.equal(fused_tokens, layered_tokens)
    else:
        assert layered_tokens is None
    assert fused_cache.equals(layered_cache)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_profiled_step_changes_nothing_and_counts_the_phases_it_ran(
    executor: CpuExecutor, threads: int
) -> None:
    """With `step_profile` set, the step compiled with cycle counters gives the same tokens
    (or logits) and K/V, and every worker's cycles land in the phases the step ran: a
    decode and a draft's run, every row greedy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = prefilled(executor, [30, 50])
        chunks = [(0, [11], 30), (1, [5, 6, 7, 8, 9], 50)]
        greedy = torch.ones(6, dtype=torch.bool)
        plain_cache, profiled_cache = base.copy(), base.copy()
        plain_logits, plain_tokens = plain_cache.forward(executor, chunks, greedy)
        profile = np.zeros((threads, len(fused_step.PHASES), 2), dtype=np.int64)
        executor.step_profile = profile
        try:
            logits, tokens = profiled_cache.forward(executor, chunks, greedy)
        finally:
            executor.step_profile = None
    finally:
        torch.set_num_threads(previous)
    if greedy_argmax.fast():
        assert tokens is not None and torch.equal(tokens, plain_tokens)
        ran = set(fused_step.PHASES) - {"rows"}  # every row reaches the LM head
    else:
        assert tokens is None and torch.equal(logits, plain_logits)
        ran = set(fused_step.PHASES) - {"rows", "approximate", "pick"}
    assert profiled_cache.equals(plain_cache)
    working = profile[:, :, 0] > 0
    assert {
        fused_step.PHASES[i] for i in range(len(fused_step.PHASES)) if working[:, i].all()
    } == ran
    assert not profile[:, [fused_step.PHASES.index(p) for p in set(fused_step.PHASES) - ran]].any()
    assert (profile[:, :, 1] >= 0).all()


def test_a_profile_of_the_wrong_shape_is_refused(executor: CpuExecutor) -> None:
    cache = prefilled(executor, [20])
    executor.step_profile = np.zeros((8, 3, 2), dtype=np.int64)
    try:
        wanted = rf"profile must be int64 \[\d+ or more, {len(fused_step.PHASES)}, 2\]"
        with pytest.raises(ValueError, match=wanted):
            cache.forward(executor, [(0, [1], 20)])
    finally:
        executor.step_profile = None


@pytest.mark.parametrize("length", [6, 90])
def test_a_prompt_is_prefilled_in_one_fused_call(
    executor: CpuExecutor, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """Prompt tokens take the compiled attention kernels (runs of the verify kernel), so a
    prompt step takes the fused step whatever the prompt's length (up to its
    `max_tokens`)."""
    assert length <= executor.fused.max_tokens
    calls = []
    real = fused_step.fused_forward
    monkeypatch.setattr(fused_step, "fused_forward", lambda *a: calls.append(1) or real(*a))
    room = length + 16
    fused_cache, layered_cache = (PagedCache(executor.config, 1, room) for _ in range(2))
    prompt = [(0, [7 + i % 50 for i in range(length)], 0)]
    assert torch.equal(
        run(fused_cache, executor, prompt, fused=True),
        run(layered_cache, executor, prompt, fused=False),
    )
    assert calls == [1]
    assert fused_cache.equals(layered_cache)


def test_larger_steps_run_layer_by_layer(
    executor: CpuExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of more new tokens than the fused step's `max_tokens` (lowered here, so
    that the step stays small) runs layer by layer; one of exactly that many does not."""
    calls = []
    real = fused_step.fused_forward
    monkeypatch.setattr(fused_step, "fused_forward", lambda *a: calls.append(1) or real(*a))
    per_seq = 4  # every sequence on the compiled attention kernels: only the size stops it
    num_seqs = 5
    limit = per_seq * (num_seqs - 1)
    monkeypatch.setattr(executor, "fused", dataclasses.replace(executor.fused, max_tokens=limit))
    base = prefilled(executor, [20] * num_seqs)
    chunks = [(s, [1, 2, 3, 4], 20) for s in range(num_seqs)]
    run(base.copy(), executor, chunks, fused=True)
    assert calls == []
    run(base.copy(), executor, chunks[:-1], fused=True)
    assert calls == [1]


def test_a_slot_outside_the_cache_is_refused_by_name(executor: CpuExecutor) -> None:
    cache = prefilled(executor, [20])
    slots = cache.kv_caches[0][0].shape[0] * BLOCK_SIZE
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([slots + 3]),
        block_tables=cache.block_tables[:1],
        seq_lens=torch.tensor([21], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    )
    attn.validated = True  # past the first layer's checks: the kernel's own check
    with pytest.raises(ValueError, match=rf"slot {slots + 3} of token 0 is outside"):
        executor.forward(
            torch.tensor([5]), torch.tensor([20]), cache.kv_caches, attn, torch.tensor([0])
        )


def test_weights_off_every_grid_get_the_fused_step_from_their_fp32_tiles() -> None:
    """A checkpoint whose weights lie on no grid runs the same compiled GEMMs from its fp32
    weights in tile layout ("rebuilt"): the fused step gives the layered logits and K/V
    bit for bit, and its LM head, rounded to 8-bit codes for the argmax, gives greedy rows
    the argmax of the logits."""
    on_grids = grid_model(seed=1)
    assert find_grids(on_grids) is not None
    assert choose_mode(on_grids) == ("grid", True)
    plain = LlamaModel(on_grids.config).eval()
    with torch.no_grad():
        for parameter in plain.parameters():
            parameter.normal_(0, 0.05)
    assert find_grids(plain) is None
    executor = cpu.prepare(plain, BLOCK_SIZE)
    assert executor is not None and executor.active
    assert executor.mode == "rebuilt"
    assert executor.fused.kinds == (grid_gemm.REBUILT,) * 5
    assert (executor.argmax is not None) == greedy_argmax.fast()
    base = prefilled(executor, [20, 33])
    chunks = [(0, [5], 20), (1, [1, 2, 3, 4, 5], 33)]
    assert_fused_matches_layered(executor, base, chunks)
    greedy = torch.tensor([True, True, False, True, True, True])
    expected, _ = base.copy().forward(executor, chunks)
    _, tokens = base.copy().forward(executor, chunks, greedy)
    if greedy_argmax.fast():
        assert tokens is not None
        assert tokens[greedy].tolist() == expected[greedy].argmax(dim=1).tolist()


def test_q_k_v_biases_are_added_in_the_fused_step() -> None:
    """Grid weights with q/k/v biases (Qwen2's): the fused step adds each layer's bias to
    its q/k/v product and gives the layered logits and K/V bit for bit; both are the
    model's own torch forward within rounding, and a model without the biases differs."""
    with_biases = grid_model(seed=1, attention_bias=True)
    layers = with_biases.layers
    assert find_grids(with_biases) is not None
    reference = copy.deepcopy(with_biases)
    executor = grid_executor(with_biases)
    stacked = torch.stack([layer.self_attn.qkv_proj.bias.detach() for layer in layers])
    assert np.array_equal(executor.fused.qkv_bias, stacked.numpy())
    without = grid_executor(grid_model(seed=1))
    assert without.fused.qkv_bias.shape == (3, 0)
    assert_fused_is_the_model_not_the_plain_one(executor, reference, without)


def test_which_dims_rotate_by_which_table_is_data_of_the_fused_step() -> None:
    """A layer that rotates no dims (SmolLM3's NoPE), partial rotary (Phi-3's), a local
    layer with a rope of its own (Gemma 3's) and a query scale of the config's: the fused
    step reads each layer's rotated dims and cos/sin table as data and gives the layered
    logits and K/V bit for bit; both are the model's own torch forward within rounding,
    and the same shapes rotated as a Llama differ."""
    fields = {
        "nope_layers": (1,),
        "partial_rotary_factor": 0.5,
        "local_layers": (2,),
        "local_rope_theta": 100.0,
        "query_pre_attn_scalar": 48.0,
    }
    model = grid_model(seed=1, **fields)
    reference = copy.deepcopy(model)
    executor = grid_executor(model)
    assert executor.fused.rope.tolist() == [[32, 0], [0, 0], [32, 1]]
    llama = grid_executor(grid_model(seed=1))
    assert llama.fused.rope.tolist() == [[64, 0]] * 3
    assert_fused_is_the_model_not_the_plain_one(executor, reference, llama)


def test_q_and_k_heads_are_normed_in_the_fused_step() -> None:
    """Grid weights with q/k head norms (Qwen3's): the fused step norms each layer's query
    and key heads before their rotation, from the norms' weights as data of the one
    compiled step, and gives the layered logits and K/V bit for bit; both are the model's
    own torch forward within rounding, and a model without the norms differs."""
    normed = grid_model(seed=1, qk_norm=True)
    assert find_grids(normed) is not None
    reference = copy.deepcopy(normed)
    executor = grid_executor(normed)
    stacked = torch.stack(
        [
            torch.stack((la.self_attn.q_norm.weight, la.self_attn.k_norm.weight))
            for la in normed.layers
        ]
    )
    assert np.array_equal(executor.fused.qk_norm, stacked.detach().numpy())
    without = grid_executor(grid_model(seed=1))
    assert without.fused.qk_norm.shape == (3, 0, 0)
    assert_fused_is_the_model_not_the_plain_one(executor, reference, without)


# A Gemma 3 of `grid_model`'s shapes: local layers with a window shorter than the prompts
# and a rope of their own beside a global layer.
GEMMA3_FIELDS: dict[str, Any] = {
    "architecture": "gemma3",
    "qk_norm": True,
    "query_pre_attn_scalar": 48.0,
    "local_layers": (0, 2),
    "local_rope_theta": 100.0,
    "sliding_window": 8,
}


@pytest.fixture(scope="module")
def gemma3_executor() -> tuple[CpuExecutor, DecoderModel]:
    """The executor of a Gemma 3 on grids, and a copy of the model for its torch forward."""
    model = grid_model(seed=1, **GEMMA3_FIELDS)
    reference = copy.deepcopy(model)
    return grid_executor(model), reference


def test_gemma3s_norms_window_and_activation_are_data_and_a_switch_of_the_fused_step(
    gemma3_executor: tuple[CpuExecutor, DecoderModel],
) -> None:
    """Gemma 3 on grids: norms scaled by 1 + weight, each block's output normed before the
    residual add, GELU (tanh) in the gate/up GEMM, local layers with a window shorter than
    the prompts and a rope of their own beside a global layer: the fused step reads the
    folded norms, output norms and windows as data and gives the layered logits and K/V
    bit for bit; both are the model's own torch forward within rounding, and the same
    weights attending fully differ."""
    executor, reference = gemma3_executor
    assert {"gemma_rms_norm", "gelu_tanh_glu", "sandwich_norms", "sliding_window"} <= (
        reference.config.features()
    )
    model, layer = reference, reference.layers[1]
    fused = executor.fused
    assert fused.windows.tolist() == [8, 0, 8]
    assert [la.window for la in executor.layers] == [8, None, 8]
    assert np.array_equal(
        fused.norms[1, 1], 1.0 + layer.pre_feedforward_layernorm.weight.detach().numpy()
    )
    assert np.array_equal(
        fused.post_norms[1, 0], 1.0 + layer.post_attention_layernorm.weight.detach().numpy()
    )
    assert np.array_equal(fused.qk_norm[1, 0], 1.0 + layer.self_attn.q_norm.weight.detach().numpy())
    assert np.array_equal(fused.final_norm, 1.0 + model.norm.weight.detach().numpy())
    full = grid_executor(grid_model(seed=1, **{**GEMMA3_FIELDS, "sliding_window": None}))
    assert full.fused.windows.tolist() == [0, 0, 0]
    assert_fused_is_the_model_not_the_plain_one(executor, reference, full)
    # A decode, and a run of 8 whose last tokens' windows start past a block its first
    # token's window still shows.
    base = prefilled(executor, [40, 51])
    assert_fused_matches_layered(executor, base, [(0, [7], 40), (1, list(range(9, 17)), 51)])


def test_an_o_proj_bias_gets_no_fused_step() -> None:
    """An o_proj bias (Llama's attention_bias covers it): the fused step adds none, so the
    library's packed GEMMs serve (where torch has MKL) with the compiled ops between them."""
    with_biases = grid_model(seed=1, attention_bias=True, o_proj_bias=True)
    assert find_grids(with_biases) is None
    executor = cpu.prepare(with_biases, BLOCK_SIZE)
    if executor is None:
        pytest.skip("torch was built without MKL: the torch forward serves")
    assert executor.mode == "mkl" and executor.compiled
    assert executor.fused is None and executor.argmax is None


def test_the_default_model_takes_the_fused_step_with_the_same_logits(
    default_model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2 from its GGUF file: every GEMM weight on its Q4_1 or Q8_0 grid, one decode
    and a sequence verifying a 4-token draft in one fused step; the executor says so."""
    from pagedinfer.service.loader import load_model

    model = load_model(str(default_model_dir)).model
    with caplog.at_level(logging.INFO, logger="pagedinfer.kernels.cpu.executor"):
        executor = grid_executor(model)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU executor")]
    assert said == [
        "CPU executor: grid GEMMs, compiled ops between them; steps of up to "
        f"{executor.fused.max_tokens} tokens in one compiled call"
    ]
    assert executor.fused.kinds == ("affine4",) * 4 + ("scaled8",)
    assert (executor.argmax is not None) == greedy_argmax.fast()
    base = prefilled(executor, [37, 120])
    chunks = [(0, [1000], 37), (1, [5, 6, 7, 8, 9], 120)]
    assert_fused_matches_layered(executor, base, chunks)


def test_the_caches_views_are_kept_while_the_caches_stay_and_made_anew_when_one_changes() -> None:
    caches = [(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)) for _ in range(3)]
    arrays = fused_step.cache_arrays(caches)
    assert fused_step.cache_arrays(caches, arrays) is arrays
    assert fused_step.cache_arrays(list(caches), arrays) is arrays  # the same tensors
    caches[0][0][1, 2] = 5.0  # views, not copies
    assert arrays.keys[0][1, 2].tolist() == [[5.0] * 8]
    replaced = [*caches[:2], (caches[2][0], torch.ones(2, 4, 1, 8))]
    fresh = fused_step.cache_arrays(replaced, arrays)
    assert fresh is not arrays and fresh.values[2].sum() == 2 * 4 * 8
    assert np.shares_memory(fresh.keys[2], caches[2][0].numpy())
    shorter = fused_step.cache_arrays(caches[:2], arrays)
    assert shorter is not arrays and len(shorter.keys) == len(shorter.values) == 2


def test_a_step_keeps_its_setup_for_the_next_step_of_its_shape_and_no_other() -> None:
    """The setup (scratch arrays, arguments) is reused while the weights, the tokens, the
    logits rows, which of them are greedy and the threads stay; any change makes a new one."""
    empty = np.zeros(0, np.uint8)
    weights = fused_step.FusedWeights(
        norms=np.ones((3, 2, 256), np.float32),
        final_norm=np.ones(256, np.float32),
        eps=1e-5,
        kinds=("affine4",) * 4 + ("scaled8",),
        orders=tuple(grid_gemm.fixed_order(k) for k in (256, 256, 256, 512, 256)),
        max_tokens=grid_gemm.GRID_MAX_ROWS,
        codes=(empty,) * 5,
        scales=(empty,) * 5,
        second_kinds=(None,) * 4,
        second_codes=(empty,) * 4,
        second_scales=(empty,) * 4,
        layer_slots=np.zeros((4, 3), np.int64),
        qkv_bias=np.zeros((3, 0), np.float32),
        qk_norm=np.zeros((3, 0, 0), np.float32),
        rope=np.array([(64, 0)] * 3),
        post_norms=np.zeros((3, 0, 0), np.float32),
        windows=np.zeros(3, np.int64),
    )
    scratch = fused_step.StepScratch()
    shape = fused_step.StepShape(256, 4, 2, 64, 512, 512, BLOCK_SIZE)
    one, two = np.array([0]), np.array([0, 1])
    yes, no, both = np.array([True]), np.array([False]), np.array([True, True])

    def setup(
        tokens: int,
        rows: np.ndarray,
        picking: np.ndarray,
        workers: int = 2,
        weights: fused_step.FusedWeights = weights,
    ) -> object:
        return scratch.setup(weights, shape, tokens, rows, picking, workers, 3, False)

    first = setup(1, one, yes)
    assert setup(1, one.copy(), yes.copy()) is first
    changed = [setup(2, two, both), setup(1, one, no), setup(2, np.array([1]), yes)]
    changed.append(setup(1, one, yes, workers=1))
    changed.append(setup(1, one, yes, weights=dataclasses.replace(weights)))
    assert all(s is not first for s in changed)
    assert setup(1, one, yes) is not first  # only the last setup is kept


def test_steps_of_one_shape_share_a_setup_and_each_keeps_its_own_logits(
    executor: CpuExecutor,
) -> None:
    """Two decodes in a row (one setup), then a step of another shape, then the first
    decode again: each step's logits are what that step gives on its own."""
    base = prefilled(executor, [30, 50])
    cache = base.copy()
    first = run(cache, executor, [(0, [11], 30)], fused=True)
    second = run(cache, executor, [(0, [12], 31)], fused=True)
    run(cache, executor, [(0, [13], 32), (1, [14], 50)], fused=True)
    assert torch.equal(first, run(base.copy(), executor, [(0, [11], 30)], fused=True))
    replay = base.copy()
    run(replay, executor, [(0, [11], 30)], fused=False)
    assert torch.equal(second, run(replay, executor, [(0, [12], 31)], fused=False))


@pytest.mark.parametrize("lengths", [[7], [16, 17], [5, 40, 40, 3, 90]], ids=["one", "two", "ties"])
def test_a_step_of_decodes_alone_is_planned_as_the_general_planner_plans_it(
    lengths: list[int],
) -> None:
    num_seqs = len(lengths)
    tables = torch.randperm(8 * num_seqs, generator=torch.Generator().manual_seed(1))
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
        block_tables=tables.view(num_seqs, 8).to(torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        compiled=True,  # as the executor's steps are
    )
    query = torch.empty(num_seqs, 4, 64)
    k_cache = v_cache = torch.empty(8 * num_seqs, BLOCK_SIZE, 2, 64)
    ours = decode_plan(attn, BLOCK_SIZE)
    theirs = attn.plan_for(query, k_cache, v_cache)
    assert ours is not None and ours.groups == theirs.groups == []
    assert ours.block_size == theirs.block_size
    for name in ("query_rows", "block_tables", "seq_lens"):
        mine, general = getattr(ours.decodes, name), getattr(theirs.decodes, name)
        assert mine.dtype == general.dtype and mine.flags.c_contiguous
        np.testing.assert_array_equal(mine, general)
    assert theirs.runs is None or theirs.runs.query_rows.shape[0] == 0


@pytest.mark.parametrize("starts", [[0, 2], [0, 1, 3], [0, 0, 2]], ids=["draft", "mixed", "empty"])
def test_a_step_with_more_than_decodes_gets_the_general_plan(starts: list[int]) -> None:
    num_seqs = len(starts) - 1
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.zeros(num_seqs, 2, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), 9, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )
    assert decode_plan(attn, BLOCK_SIZE) is None
