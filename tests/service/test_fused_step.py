"""The fused step: a forward pass of a few tokens as one compiled call gives the logits
and the KV cache of the pass layer by layer, bit for bit."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

pytest.importorskip("numba", reason="the fused step is compiled with numba")

from pagedinfer.kernels import cpu_argmax, cpu_step, torch_ops
from pagedinfer.service.models.llama import (
    AttentionMetadata,
    LlamaModel,
    ModelConfig,
    cpu_mkl_packing_available,
)

pytestmark = pytest.mark.skipif(
    not (
        cpu_mkl_packing_available(torch.device("cpu"), torch.float32)
        and torch_ops.compiled_kernels()
    ),
    reason="the fused step reproduces MKL's packed GEMMs with the compiled kernels",
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


def grid_model(seed: int = 0, pack: bool = True, attention_bias: bool = False) -> LlamaModel:
    """A small Llama whose GEMM weights lie on 4-bit grids and whose (tied) embeddings on
    an 8-bit one, packed for MKL as the loader packs it (pack)."""
    config = ModelConfig(
        architecture="llama",
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
        max_position_embeddings=1024,  # room for a step past the grid's 512 rows
    )
    rng = np.random.default_rng(seed)
    model = LlamaModel(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for linear in layer.linears():
                in_features, out_features = linear.weight.shape
                linear.weight.copy_(on_grid(out_features, in_features, rng, 4).t())
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.from_numpy(rng.random(256).astype(np.float32) + 0.5))
        model.embed_tokens.weight.copy_(on_grid(512, 256, rng, 8))
    if pack:
        model.pack_weights_mkl()
    return model


def run(
    cache: PagedCache, model: LlamaModel, chunks: list[tuple[int, list[int], int]], fused: bool
) -> torch.Tensor:
    """One forward over (sequence, new tokens, start) chunks, with the fused step allowed
    or not; the logits of every new token."""
    saved = model.fused
    model.fused = saved if fused else None
    try:
        return torch.cat(cache.step(model, chunks))
    finally:
        model.fused = saved


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return grid_model()


def prefilled(model: LlamaModel, lengths: list[int], room: int = 16) -> PagedCache:
    """A cache holding a prompt of each length, with room for `room` more tokens each."""
    cache = PagedCache(model.config, len(lengths), max(lengths) + room, seed=3)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [
        (s, torch.randint(0, vocab, (n,), generator=gen).tolist(), 0) for s, n in enumerate(lengths)
    ]
    run(cache, model, prompts, fused=False)
    return cache


def test_a_model_on_grids_gets_the_fused_step(model: LlamaModel) -> None:
    assert model.fused is not None
    assert model.fused.kinds == ("affine4",) * 4 + ("scaled8",)
    # Its 8-bit LM head picks greedy rows' tokens where that is faster than the logits.
    assert (model.fused.argmax is not None) == cpu_argmax.fast()
    assert model.lm_head_argmax is model.fused.argmax


@pytest.mark.skipif(not cpu_argmax.fast(), reason="greedy rows are picked with AVX-512 VNNI")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layer-by-layer"])
def test_greedy_rows_get_the_argmax_of_their_logits_without_them(
    model: LlamaModel, fused: bool
) -> None:
    """A decode, a 4-token draft and a prompt's rows, some greedy: each greedy row's token is
    the argmax of the logits a step without greedy rows gives; the other rows get the same
    logits as there."""
    base = prefilled(model, [30, 50])
    chunks = [(0, [11], 30), (1, [5, 6, 7, 8, 9], 50)]
    greedy = torch.tensor([True, True, False, True, True, False])
    saved = model.fused
    model.fused = saved if fused else None
    try:
        expected, tokens = base.copy().forward(model, chunks)
        assert tokens is None
        logits, tokens = base.copy().forward(model, chunks, greedy)
    finally:
        model.fused = saved
    assert tokens is not None
    assert tokens[greedy].tolist() == expected[greedy].argmax(dim=1).tolist()
    assert (tokens[~greedy] == -1).all()
    assert torch.equal(logits[~greedy], expected[~greedy])


def test_greedy_rows_of_the_wrong_shape_are_refused(model: LlamaModel) -> None:
    cache = prefilled(model, [20])
    with pytest.raises(ValueError, match=r"greedy has shape \(3,\), logits_indices \(2,\)"):
        cache.forward(model, [(0, [1, 2], 20)], torch.ones(3, dtype=torch.bool))


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
    model: LlamaModel, new_tokens: list[int], threads: int
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lengths = [20, 47, 33, 16, 90, 5, 64, 31][: len(new_tokens)]
        base = prefilled(model, lengths)
        gen = torch.Generator().manual_seed(sum(new_tokens))
        chunks = [
            (s, torch.randint(0, 512, (n,), generator=gen).tolist(), lengths[s])
            for s, n in enumerate(new_tokens)
        ]
        fused_cache, layered_cache = base.copy(), base.copy()
        fused = run(fused_cache, model, chunks, fused=True)
        layered = run(layered_cache, model, chunks, fused=False)
        assert torch.equal(fused, layered)
        assert fused_cache.equals(layered_cache)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_comes_out_the_same_in_a_step_of_any_size(model: LlamaModel, threads: int) -> None:
    """A decode's logits from the fused step of its one token equal those it gets beside a
    prompt chunk that makes the step too large for it, where every GEMM is the library's:
    the grid sums in the order the library takes for large calls (on CPUs where the
    library sums small calls otherwise, the library alone would not give the same)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = prefilled(model, [20, 5], room=model.fused.max_tokens + 16)
        decode = (0, [42], 20)
        chunk = (1, [100 + i % 300 for i in range(model.fused.max_tokens + 8)], 5)
        alone = run(base.copy(), model, [decode], fused=True)
        crowded = run(base.copy(), model, [decode, chunk], fused=True)
        assert torch.equal(alone[0], crowded[0])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("rows", [[1, 7, 40, 41], [41], []], ids=["some", "one", "none"])
def test_rows_without_logits_skip_the_last_layers_mlp_and_change_nothing(
    model: LlamaModel, rows: list[int]
) -> None:
    """Two prompt chunks and a decode with logits (and greedy tokens) for a few rows only:
    the fused step runs the last layer's attention output and MLP for those rows alone,
    and gives them the logits and tokens the layer-by-layer step gives, with the same
    K/V."""
    base = prefilled(model, [20, 5, 9], room=40)
    chunks = [(0, [42], 20), (1, [3 + i % 40 for i in range(30)], 5), (2, [8] * 11, 9)]
    greedy = torch.tensor([i % 2 == 0 for i in range(len(rows))], dtype=torch.bool)
    fused_cache, layered_cache = base.copy(), base.copy()
    saved = model.fused
    try:
        fused = fused_cache.forward(model, chunks, greedy, rows)
        model.fused = None
        layered = layered_cache.forward(model, chunks, greedy, rows)
    finally:
        model.fused = saved
    full = ~greedy if fused.tokens is not None else torch.ones(len(rows), dtype=torch.bool)
    assert torch.equal(fused.logits[full], layered.logits[full])
    if fused.tokens is not None:
        assert torch.equal(fused.tokens, layered.tokens)
    assert fused_cache.equals(layered_cache)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_profiled_step_changes_nothing_and_counts_the_phases_it_ran(
    model: LlamaModel, threads: int
) -> None:
    """With `step_profile` set, the step compiled with cycle counters gives the same tokens
    (or logits) and K/V, and every worker's cycles land in the phases the step ran: a
    decode and a draft's run, every row greedy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = prefilled(model, [30, 50])
        chunks = [(0, [11], 30), (1, [5, 6, 7, 8, 9], 50)]
        greedy = torch.ones(6, dtype=torch.bool)
        plain_cache, profiled_cache = base.copy(), base.copy()
        plain = plain_cache.forward(model, chunks, greedy)
        profile = np.zeros((threads, len(cpu_step.PHASES), 2), dtype=np.int64)
        model.step_profile = profile
        try:
            profiled = profiled_cache.forward(model, chunks, greedy)
        finally:
            model.step_profile = None
    finally:
        torch.set_num_threads(previous)
    if cpu_argmax.fast():
        assert torch.equal(profiled.tokens, plain.tokens)
        ran = set(cpu_step.PHASES) - {"rows"}  # every row reaches the LM head
    else:
        assert profiled.tokens is None and torch.equal(profiled.logits, plain.logits)
        ran = set(cpu_step.PHASES) - {"rows", "approximate", "pick"}
    assert profiled_cache.equals(plain_cache)
    working = profile[:, :, 0] > 0
    assert {cpu_step.PHASES[i] for i in range(len(cpu_step.PHASES)) if working[:, i].all()} == ran
    assert not profile[:, [cpu_step.PHASES.index(p) for p in set(cpu_step.PHASES) - ran]].any()
    assert (profile[:, :, 1] >= 0).all()


def test_a_profile_of_the_wrong_shape_is_refused(model: LlamaModel) -> None:
    cache = prefilled(model, [20])
    model.step_profile = np.zeros((8, 3, 2), dtype=np.int64)
    try:
        wanted = rf"profile must be int64 \[\d+ or more, {len(cpu_step.PHASES)}, 2\]"
        with pytest.raises(ValueError, match=wanted):
            cache.forward(model, [(0, [1], 20)])
    finally:
        model.step_profile = None


@pytest.mark.parametrize("length", [6, 90])
def test_a_prompt_is_prefilled_in_one_fused_call(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """Prompt tokens take the compiled attention kernels (runs of the verify kernel), so a
    prompt step takes the fused step whatever the prompt's length (up to the rows the
    loader gave the grid, which depend on the machine and threads: raised here)."""
    grid_rows = max(model.fused.max_tokens, length)
    monkeypatch.setattr(model, "fused", dataclasses.replace(model.fused, max_tokens=grid_rows))
    calls = []
    real = cpu_step.fused_forward
    monkeypatch.setattr(cpu_step, "fused_forward", lambda *a: calls.append(1) or real(*a))
    room = length + 16
    fused_cache, layered_cache = (PagedCache(model.config, 1, room) for _ in range(2))
    prompt = [(0, [7 + i % 50 for i in range(length)], 0)]
    assert torch.equal(
        run(fused_cache, model, prompt, fused=True), run(layered_cache, model, prompt, fused=False)
    )
    assert calls == [1]
    assert fused_cache.equals(layered_cache)


def test_larger_steps_run_layer_by_layer(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the fused step ran")

    monkeypatch.setattr(cpu_step, "fused_forward", refuse)
    per_seq = 4  # every sequence on the compiled attention kernels: only the size stops it
    num_seqs = model.fused.max_tokens // per_seq + 1
    cache = prefilled(model, [20] * num_seqs)
    run(cache, model, [(s, [1, 2, 3, 4], 20) for s in range(num_seqs)], fused=True)


def test_a_slot_outside_the_cache_is_refused_by_name(model: LlamaModel) -> None:
    cache = prefilled(model, [20])
    slots = cache.kv_caches[0][0].shape[0] * BLOCK_SIZE
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([slots + 3]),
        block_tables=cache.block_tables[:1],
        seq_lens=torch.tensor([21], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    )
    attn.validated = True  # past the first layer's checks: the kernel's own check
    with pytest.raises(ValueError, match=rf"slot {slots + 3} of token 0 is outside"):
        model(torch.tensor([5]), torch.tensor([20]), cache.kv_caches, attn, torch.tensor([0]))


def test_weights_off_a_grid_or_with_biases_get_no_fused_step() -> None:
    on_grids = grid_model(seed=1)
    assert on_grids.fused is not None
    plain = LlamaModel(on_grids.config).eval()
    with torch.no_grad():
        for parameter in plain.parameters():
            parameter.normal_(0, 0.05)
    plain.pack_weights_mkl()
    assert plain.fused is None
    # The same grid weights, with q/k/v biases: the fused step adds none.
    assert grid_model(seed=1, pack=False)._grids() is not None
    assert grid_model(seed=1, pack=False, attention_bias=True)._grids() is None


def test_the_default_model_takes_the_fused_step_with_the_same_logits(
    default_model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2 from its GGUF file: every GEMM weight on its Q4_1 or Q8_0 grid, one decode
    and a sequence verifying a 4-token draft in one fused step; the load says so."""
    from pagedinfer.service.loader import load_model

    with caplog.at_level(logging.INFO, logger="pagedinfer.service.loader"):
        model = load_model(str(default_model_dir)).model
    assert model.fused is not None
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused step")]
    how = "picked without their logits" if cpu_argmax.fast() else "from their logits"
    assert said == [
        f"fused step: steps of up to {model.fused.max_tokens} tokens in one compiled call; "
        f"greedy tokens {how} ({'AVX-512 VNNI' if cpu_argmax.fast() else 'no AVX-512 VNNI'})"
    ]
    assert model.fused.kinds == ("affine4",) * 4 + ("scaled8",)
    base = prefilled(model, [37, 120])
    chunks = [(0, [1000], 37), (1, [5, 6, 7, 8, 9], 120)]
    fused_cache, layered_cache = base.copy(), base.copy()
    assert torch.equal(
        run(fused_cache, model, chunks, fused=True), run(layered_cache, model, chunks, fused=False)
    )
    assert fused_cache.equals(layered_cache)


def test_the_caches_views_are_kept_while_the_caches_stay_and_made_anew_when_one_changes() -> None:
    caches = [(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)) for _ in range(3)]
    arrays = cpu_step.cache_arrays(caches)
    assert cpu_step.cache_arrays(caches, arrays) is arrays
    assert cpu_step.cache_arrays(list(caches), arrays) is arrays  # the same tensors
    caches[0][0][1, 2] = 5.0  # views, not copies
    assert arrays.keys[0][1, 2].tolist() == [[5.0] * 8]
    replaced = [*caches[:2], (caches[2][0], torch.ones(2, 4, 1, 8))]
    fresh = cpu_step.cache_arrays(replaced, arrays)
    assert fresh is not arrays and fresh.values[2].sum() == 2 * 4 * 8
    assert np.shares_memory(fresh.keys[2], caches[2][0].numpy())
    shorter = cpu_step.cache_arrays(caches[:2], arrays)
    assert shorter is not arrays and len(shorter.keys) == len(shorter.values) == 2
