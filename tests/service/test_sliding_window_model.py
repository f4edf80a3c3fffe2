"""Sliding-window models served past their window: Mistral's logits match transformers'
(one prefill, and chunks plus decodes with the blocks behind the window freed), models
with windowed and full layers too (Qwen2 from max_window_layers on, Qwen3 and SmolLM3 by
layer type, Gemma 3's local layers) and Phi-3's window, and the engine
generates what transformers' greedy choice is, identically with and without freeing the
blocks behind the window, under preemption, with prefix-cache hits and with drafts,
while holding only the blocks the window needs."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

from pagedinfer.kernels import cpu
from pagedinfer.service.llm import LLM
from pagedinfer.service.loader import load_model
from pagedinfer.service.sampling_params import SamplingParams

WINDOW = 24
CPU = torch.device("cpu")


def hf_logits(path: Path, tokens: list[int], **overrides: object) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def mistral(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("mistral", sliding_window=WINDOW)


def test_mistral_past_its_window_matches_transformers(mistral: Path) -> None:
    loaded = load_model(str(mistral), CPU, torch.float32)
    assert loaded.config.kv_window == WINDOW
    # The CPU executor serves the window too (`test_chunks_and_decodes_over_freed_blocks`).
    assert cpu.unsupported_features(loaded.config) == []
    token_lists = [random_tokens(150, 1), random_tokens(30, 2), random_tokens(5, 3)]
    cache = PagedCache(loaded.config, 3, 150)
    ours = cache.step(loaded.model, [(i, t, 0) for i, t in enumerate(token_lists)])
    for tokens, logits in zip(token_lists, ours, strict=True):
        theirs = hf_logits(mistral, tokens)
        assert (logits - theirs).abs().max().item() < 1e-4
    # The window matters: full attention gives other logits past it.
    full = hf_logits(mistral, token_lists[0], sliding_window=None)
    assert (full[:WINDOW] - ours[0][:WINDOW]).abs().max().item() < 1e-4
    assert (full[WINDOW:] - ours[0][WINDOW:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("runner", ["model", "cpu-executor"])
def test_chunks_and_decodes_over_freed_blocks_match_transformers(
    mistral: Path, runner: str
) -> None:
    """Chunked prefill then decodes, each step after the blocks behind the next token's
    window are freed: their table entries -1, their KV NaN in every layer; on the model's
    torch forward and on the CPU executor's compiled kernels."""
    loaded = load_model(str(mistral), CPU, torch.float32)
    forward = loaded.model
    if runner == "cpu-executor":
        forward = cpu.prepare(loaded.model, BLOCK_SIZE)
        if forward is None:
            pytest.skip("no CPU executor on this machine")
    tokens = random_tokens(120, 4)
    theirs = hf_logits(mistral, tokens)
    cache = PagedCache(loaded.config, 1, len(tokens))
    steps = [(0, 50), (50, 90)] + [(p, p + 1) for p in range(90, 120)]
    freed = 0
    for start, end in steps:
        for block in range(max(start - WINDOW + 1, 0) // BLOCK_SIZE):
            physical = int(cache.block_tables[0, block])
            if physical >= 0:
                for k_cache, v_cache in cache.kv_caches:
                    k_cache[physical] = v_cache[physical] = float("nan")
                cache.block_tables[0, block] = -1
                freed += 1
        (logits,) = cache.step(forward, [(0, tokens[start:end], start)])
        assert (logits - theirs[start:end]).abs().max().item() < 1e-4, (start, end)
    assert freed == (120 - 1 - WINDOW + 1) // BLOCK_SIZE  # 6 of the 8 blocks


def test_windowed_and_full_layers_in_one_model_match_transformers(
    make_tiny_model: Callable[..., Path],
) -> None:
    """Qwen2 windows only its layers from max_window_layers on: layer 0 keeps all its
    KV, so nothing may be freed."""
    path = make_tiny_model(
        "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    loaded = load_model(str(path), CPU, torch.float32)
    config = loaded.config
    assert [config.layer_window(i) for i in range(2)] == [None, WINDOW]
    assert config.kv_window is None
    tokens = random_tokens(100, 5)
    (ours,) = PagedCache(config, 1, 100).step(loaded.model, [(0, tokens, 0)])
    assert (ours - hf_logits(path, tokens)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("preset", "overrides", "windows"),
    [
        ("phi3", {"sliding_window": 20}, [20, 20]),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 20,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            [None, 20],
        ),
        ("smollm3", {"use_sliding_window": True, "sliding_window": 20}, [None, 20]),  # NoPE
        ("gemma3", {"sliding_window": 20}, [20, None]),  # local, then global
    ],
)
def test_each_windowed_architecture_matches_transformers_past_its_window(
    make_tiny_model: Callable[..., Path],
    preset: str,
    overrides: dict[str, object],
    windows: list[int | None],
) -> None:
    path = make_tiny_model(preset, **overrides)
    loaded = load_model(str(path), CPU, torch.float32)
    config = loaded.config
    assert [config.layer_window(i) for i in range(config.num_layers)] == windows
    assert config.kv_window == (20 if None not in windows else None)
    tokens = random_tokens(90, 6)
    theirs = hf_logits(path, tokens)
    cache = PagedCache(config, 1, len(tokens))
    for start, end in ((0, 50), (50, 89), (89, 90)):
        (logits,) = cache.step(loaded.model, [(0, tokens[start:end], start)])
        assert (logits - theirs[start:end]).abs().max().item() < 1e-4, (start, end)


# -- the engine ------------------------------------------------------------------------

PROMPT_LEN, MAX_TOKENS = 40, 100  # 140 tokens: far past the window


def engine_args(**overrides: object) -> dict[str, object]:
    return {"max_model_len": 512, "max_num_batched_tokens": 64, **overrides}


def generate_stepwise(
    llm: LLM, prompts: list[list[int]], preempt_at: tuple[int, ...] = ()
) -> tuple[list[list[int]], int]:
    """Greedy outputs of prompts run together, and the most KV blocks held in a step.
    preempt_at: steps before which the newest running request is preempted."""
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    most = step = 0
    while engine.has_unfinished():
        if step in preempt_at and engine.scheduler.running:
            engine.scheduler._preempt_last()
        step += 1
        most = max(most, engine.stats().kv.used)
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
        most = max(most, engine.stats().kv.used)
    assert engine.stats().kv.used == 0
    return [outputs[rid] for rid in ids], most


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_tokens(PROMPT_LEN, 10 + i) for i in range(3)]


@pytest.fixture(scope="module")
def freed_run(mistral: Path, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    llm = LLM(str(mistral), **engine_args())
    assert llm.engine.scheduler.kv_cache.sliding_window == WINDOW
    return generate_stepwise(llm, prompts)


def test_engine_generates_transformers_greedy_tokens_past_the_window(
    mistral: Path, prompts: list[list[int]], freed_run: tuple[list[list[int]], int]
) -> None:
    outputs, _ = freed_run
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output) == MAX_TOKENS
        # Greedy: every token is transformers' argmax after the tokens before it.
        theirs = hf_logits(mistral, prompt + output[:-1])
        assert theirs[PROMPT_LEN - 1 :].argmax(dim=-1).tolist() == output


def test_freeing_holds_only_the_window_and_changes_no_output(
    mistral: Path, prompts: list[list[int]], freed_run: tuple[list[list[int]], int]
) -> None:
    outputs, most_freed = freed_run
    llm = LLM(str(mistral), **engine_args())
    llm.engine.scheduler.kv_cache.sliding_window = None  # the same engine, freeing nothing
    kept, most_kept = generate_stepwise(llm, prompts)
    assert kept == outputs
    total = PROMPT_LEN + MAX_TOKENS - 1  # the last token's KV is never computed
    assert most_kept == 3 * -(-total // BLOCK_SIZE)
    # With freeing, a request holds the blocks its window spans and the next token's.
    assert most_freed <= 3 * (-(-WINDOW // BLOCK_SIZE) + 1)


@pytest.mark.parametrize(
    ("overrides", "preempt_at"),
    [
        ({"num_gpu_blocks": 12}, (2, 30, 31, 70)),  # forced, mid-prefill and past the window
        ({"num_speculative_tokens": 3}, ()),  # drafts: freeing counts only the kept tokens
    ],
    ids=["forced-preemption", "drafts"],
)
def test_preemption_and_drafts_keep_outputs_identical(
    mistral: Path,
    prompts: list[list[int]],
    freed_run: tuple[list[list[int]], int],
    overrides: dict[str, object],
    preempt_at: tuple[int, ...],
) -> None:
    llm = LLM(str(mistral), **engine_args(**overrides))
    outputs, _ = generate_stepwise(llm, prompts, preempt_at)
    assert outputs == freed_run[0]
    assert llm.engine.stats().num_preemptions == len(preempt_at)


def test_freeing_fits_requests_that_would_preempt_each_other(
    mistral: Path, prompts: list[list[int]], freed_run: tuple[list[list[int]], int]
) -> None:
    """Three requests of 9 blocks each in a 12-block cache: without freeing they preempt
    each other as they grow; freeing behind the window runs them side by side."""
    for free in (True, False):
        llm = LLM(str(mistral), **engine_args(num_gpu_blocks=12))
        if not free:
            llm.engine.scheduler.kv_cache.sliding_window = None
        outputs, _ = generate_stepwise(llm, prompts)
        assert outputs == freed_run[0]
        assert (llm.engine.stats().num_preemptions > 0) == (not free)


def test_prefix_cache_hits_on_blocks_freed_behind_the_window(
    mistral: Path, prompts: list[list[int]], freed_run: tuple[list[list[int]], int]
) -> None:
    """The first request's leading blocks are freed behind its window but stay cached; a
    later request with the same prompt reuses them and generates the same tokens."""
    llm = LLM(str(mistral), **engine_args())
    first, _ = generate_stepwise(llm, [prompts[0]])
    again, _ = generate_stepwise(llm, [prompts[0]])
    assert first == again == [freed_run[0][0]]
    assert llm.engine.stats().prefix_cache_hits >= 2 * BLOCK_SIZE


def test_benchmark_measures_blocks_held_with_and_without_freeing(mistral: Path) -> None:
    """benchmarks/sliding_window.py's measurement, on a short request."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sliding_window.py"
    spec = importlib.util.spec_from_file_location("sliding_window_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    summary = bench.measure(mistral, WINDOW, 16, 150, BLOCK_SIZE)
    assert summary["identical_outputs"]
    assert summary["blocks_at_end"] == {"freed": 3, "kept": -(-(16 + 150 - 1) // BLOCK_SIZE)}
    assert summary["peak_blocks"]["freed"] == 3  # the window's 24 positions span 2-3 blocks
