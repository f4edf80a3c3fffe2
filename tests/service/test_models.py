"""Qwen3, Phi-3, SmolLM3 and Gemma 3, each a tiny random-weight model built with
transformers' own config class and loaded through our loader: our logits match
transformers' forward on the same tokens, and greedy tokens through the engine match
transformers' generate, batched with other requests, under preemption and with prefix
caching. Every config feature we do not implement is refused with an error naming it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_cache import PagedCache

from pagedinfer.kernels import cpu, torch_ops
from pagedinfer.service import LLM, SamplingParams
from pagedinfer.service.loader import load_model, model_config_from_hf

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
VOCAB = 49152  # the tiny models' (the default model's tokenizer)


@dataclass(frozen=True)
class Case:
    """One architecture as served: its tiny model, context length and prompt lengths."""

    preset: str
    features: frozenset[str]  # what its forward must use
    max_model_len: int = 512
    prompt_lens: tuple[int, ...] = (5, 17, 40, 3, 29)
    prefix_len: int = 32  # of the prompts that share a prefix
    overrides: tuple[tuple[str, Any], ...] = ()


CASES = {
    "qwen3": Case("qwen3", frozenset({"qk_norm"})),
    # Served within the original 64 positions: LongRoPE's short factors.
    "phi3": Case(
        "phi3",
        frozenset({"partial_rotary", "rope_scaling_longrope"}),
        max_model_len=64,
        prompt_lens=(5, 17, 30, 3, 24),
        prefix_len=16,
    ),
    # Served past them: the long factors, which transformers also uses for any sequence
    # longer than 64 tokens, so every prompt here is.
    "phi3_long": Case(
        "phi3",
        frozenset({"partial_rotary", "rope_scaling_longrope"}),
        max_model_len=256,
        prompt_lens=(70, 96, 65, 81),
        prefix_len=80,
    ),
    "smollm3": Case("smollm3", frozenset({"no_rope_layers"})),
    "gemma3": Case(
        "gemma3",
        frozenset(
            {
                "gemma_rms_norm",
                "gelu_tanh_glu",
                "scaled_embeddings",
                "sandwich_norms",
                "qk_norm",
                "query_pre_attn_scalar",
                "local_layer_rope",
                "rope_scaling_linear",
            }
        ),
    ),
    # Past the local layers' window (16 positions): the global layer keeps every block.
    "gemma3_window": Case(
        "gemma3", frozenset({"sliding_window"}), overrides=(("sliding_window", 16),)
    ),
    "gemma3_softcap": Case(
        "gemma3",
        frozenset({"final_logit_softcapping"}),
        prompt_lens=(9, 33),
        overrides=(("final_logit_softcapping", 3.0),),
    ),
}


def prompts_of(case: Case, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in case.prompt_lens]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def models() -> dict[Case, tuple[Path, Any]]:
    """Per case: the tiny model's directory and transformers' own model of it."""
    return {}


@pytest.fixture(scope="module")
def tiny(
    case: Case, models: dict[Case, tuple[Path, Any]], make_tiny_model: Callable[..., Path]
) -> tuple[Path, Any]:
    if case not in models:
        from transformers import AutoModelForCausalLM

        path = make_tiny_model(case.preset, **dict(case.overrides))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # ignore_eos: run to the length limit
        models[case] = (path, hf)
    return models[case]


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(tiny: tuple[Path, Any], case: Case) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation of each of the case's prompts, one at a time."""
    _, hf = tiny
    prompts = prompts_of(case) + shared_prefix_prompts(case)
    return {tuple(p): hf_greedy(hf, p) for p in prompts}


def shared_prefix_prompts(case: Case) -> list[list[int]]:
    """Three prompts with one prefix of whole blocks and different tails."""
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, VOCAB, (case.prefix_len,), generator=generator).tolist()
    return [prefix + torch.randint(3, VOCAB, (4,), generator=generator).tolist() for _ in range(3)]


def test_logits_match_transformers_across_chunks_and_decodes(
    case: Case, tiny: tuple[Path, Any]
) -> None:
    path, hf = tiny
    loaded = load_model(str(path), "cpu", torch.float32, max_model_len=case.max_model_len)
    assert case.features <= loaded.config.features()
    # The CPU executor serves a case whose every feature it implements (Qwen3's q/k norms,
    # SmolLM3's NoPE layers, Phi-3's partial rotary and LongRoPE); the others are left to
    # the model's own forward. Both must give transformers' logits.
    executor = cpu.prepare(copy.deepcopy(loaded.model), 16)
    if not cpu.supports(loaded.config):
        assert executor is None
    elif torch_ops.compiled_kernels():
        assert executor is not None and executor.active and executor.fused is not None
    prompts = prompts_of(case)[:3]
    with torch.inference_mode():
        theirs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for runner in (loaded.model, *([executor] if executor is not None else [])):
        cache = PagedCache(loaded.config, len(prompts), max(map(len, prompts)))
        # Each prompt in two chunks over two steps, the second a single token (a decode)
        # for the first prompt: the paged cache carries the context across steps.
        split = [len(prompts[0]) - 1, *(len(p) // 2 for p in prompts[1:])]
        pairs = list(enumerate(zip(prompts, split, strict=True)))
        first = cache.step(runner, [(i, p[:s], 0) for i, (p, s) in pairs])
        second = cache.step(runner, [(i, p[s:], s) for i, (p, s) in pairs])
        for a, b, t in zip(first, second, theirs, strict=True):
            ours = torch.cat((a, b))
            assert ours.shape == t.shape
            diff = (ours - t).abs().max().item()
            assert diff < 1e-4, f"{type(runner).__name__}: max logit difference {diff}"


def test_batched_greedy_matches_transformers(
    case: Case, tiny: tuple[Path, Any], hf_reference: dict[tuple[int, ...], list[int]]
) -> None:
    path, _ = tiny
    llm = LLM(model=str(path), max_model_len=case.max_model_len, kv_cache_memory=16 * 2**20)
    executor = llm.engine.runner.executor
    if cpu.supports(llm.engine.runner.model.config) and torch_ops.compiled_kernels():
        assert executor is not None and executor.active  # the engine's steps run on it
    outputs = llm.generate(prompts_of(case), GREEDY)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_reference[tuple(out.prompt_token_ids)]
    # Prefix caching: the later prompts reuse the first one's prefix blocks.
    shared = shared_prefix_prompts(case)
    first = llm.generate(shared[:1], GREEDY)
    rest = llm.generate(shared[1:], GREEDY)
    assert all(out.cached_tokens >= 16 for out in rest)
    for out in [*first, *rest]:
        assert out.outputs[0].token_ids == hf_reference[tuple(out.prompt_token_ids)]
    assert llm.engine.stats().kv.used == 0


def test_preemption_keeps_greedy_output_identical(
    case: Case, tiny: tuple[Path, Any], hf_reference: dict[tuple[int, ...], list[int]]
) -> None:
    path, _ = tiny
    longest = max(case.prompt_lens) + NEW_TOKENS
    # Room for the longest request alone, not for every request at once.
    blocks = -(-longest // 16) + 1
    llm = LLM(
        model=str(path),
        max_model_len=case.max_model_len,
        num_gpu_blocks=blocks,
        max_num_batched_tokens=64,
    )
    outputs = llm.generate(prompts_of(case), GREEDY)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    for out in outputs:
        assert out.outputs[0].token_ids == hf_reference[tuple(out.prompt_token_ids)]
    assert stats.kv.used == 0


def test_speculative_decoding_keeps_greedy_output_identical(
    case: Case, tiny: tuple[Path, Any], hf_reference: dict[tuple[int, ...], list[int]]
) -> None:
    """N-gram drafts, every one checked (passes priced far above their rows): a draft's
    rows go through the verify path, and what is kept is what transformers' greedy
    decoding gives."""
    path, _ = tiny
    llm = LLM(
        model=str(path),
        max_model_len=case.max_model_len,
        kv_cache_memory=16 * 2**20,
        num_speculative_tokens=4,
        speculative_pass_rows=1000,
    )
    outputs = llm.generate(prompts_of(case), GREEDY)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_reference[tuple(out.prompt_token_ids)]
    stats = llm.engine.stats()
    assert stats.draft_tokens > 0
    assert stats.kv.used == 0


# --- config translation --------------------------------------------------------------


def tiny_raw(preset: str, **overrides: Any) -> dict[str, Any]:
    """The config.json transformers writes for a tiny preset (no weights built)."""
    import transformers
    from tiny_models import TINY_BASE, TINY_PRESETS

    class_name, kwargs = TINY_PRESETS[preset]
    config = getattr(transformers, class_name)(**{**TINY_BASE, **kwargs})
    return {**config.to_dict(), **overrides}


def test_phi3_longrope_picks_its_factors_by_the_served_length() -> None:
    raw = tiny_raw("phi3")
    short = model_config_from_hf(raw, max_model_len=64).rope_scaling
    long = model_config_from_hf(raw, max_model_len=65).rope_scaling
    assert short["factors"] == [1.0, 1.3, 2.1, 3.4]
    assert long["factors"] == [1.5, 3.0, 6.5, 11.0]
    # Pretrained for 64 positions, stretched to 512: sqrt(1 + ln 8 / ln 64).
    assert short["attention_factor"] == long["attention_factor"] == pytest.approx(1.5**0.5)


def test_phi3_reads_fused_projections_and_partial_rotary(
    make_tiny_model: Callable[..., Path],
) -> None:
    loaded = load_model(str(make_tiny_model("phi3")), "cpu", torch.float32, max_model_len=64)
    assert loaded.config.rotary_dim == 8  # half of head_dim 16
    attention = loaded.model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)


def test_smollm3_no_rope_layers_follow_the_config() -> None:
    assert model_config_from_hf(tiny_raw("smollm3")).nope_layers == (1,)
    # Without the list, every fourth layer goes without rope (no_rope_layer_interval).
    raw = tiny_raw("smollm3", num_hidden_layers=8)
    del raw["no_rope_layers"]
    assert model_config_from_hf(raw).nope_layers == (3, 7)


def test_gemma3_older_config_fields_give_the_same_config() -> None:
    current = model_config_from_hf(tiny_raw("gemma3"))
    legacy = tiny_raw("gemma3", rope_theta=1e6, rope_local_base_freq=10000.0)
    legacy["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    for key in ("rope_parameters", "layer_types"):
        del legacy[key]
    legacy["sliding_window_pattern"] = 2  # layer 0 local, layer 1 global
    assert model_config_from_hf(legacy) == current
    assert current.local_layers == (0,)
    assert current.local_rope_theta == 10000.0 and current.rope_theta == 1e6
    assert current.query_pre_attn_scalar == 24


def test_qwen3_head_dim_defaults_as_transformers_does() -> None:
    raw = tiny_raw("qwen3")
    del raw["head_dim"]
    assert model_config_from_hf(raw).head_dim == 128


@pytest.mark.parametrize(
    ("preset", "overrides", "message"),
    [
        (
            "gemma3",
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            "multimodal Gemma 3",
        ),
        ("qwen3", {"model_type": "qwen3_moe", "num_experts": 8}, "Qwen3 mixture-of-experts"),
        ("phi3", {"model_type": "phi3small"}, "blocksparse attention"),
        ("qwen3", {"num_experts": 8}, "mixture-of-experts.*num_experts=8"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                    "full_attention": {"rope_type": "default"},
                }
            },
            "local layers with rope type 'linear'",
        ),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}},
            "'longrope' is supported for phi3 only",
        ),
        ("phi3", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ("smollm3", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers has 3 entries for 2"),
    ],
)
def test_unimplemented_config_features_are_refused(
    preset: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(tiny_raw(preset, **overrides), max_model_len=512)
