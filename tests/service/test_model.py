"""Our Llama-family forward pass matches Hugging Face's on the same weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

from pagedinfer.kernels import torch_ops
from pagedinfer.service import loader
from pagedinfer.service.loader import LoadedModel, load_model
from pagedinfer.service.models.llama import (
    AttentionMetadata,
    cpu_layer,
    cpu_mkl_packing_available,
    cpu_weight_packing_available,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paged attention splits the KV cache into fixed-size blocks, so that memory is "
    "allocated on demand and almost nothing is wasted. " * 3,
    "Hi",
]


def hf_logits(
    path: Path, token_lists: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([tokens])).logits[0].float() for tokens in token_lists]


def our_logits(loaded: LoadedModel, token_lists: list[list[int]]) -> list[torch.Tensor]:
    """All prompts packed into one flat batch, one prefill each."""
    dtype = next(loaded.model.parameters()).dtype
    cache = PagedCache(loaded.config, len(token_lists), max(map(len, token_lists)), dtype=dtype)
    return cache.step(loaded.model, [(i, t, 0) for i, t in enumerate(token_lists)])


def assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], atol: float) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < atol


@pytest.fixture(params=["compiled", "torch"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU paths: the compiled kernels (numba is a dependency) and torch ops alone."""
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", request.param)
    return request.param


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def default_tokens(default_model: LoadedModel) -> list[list[int]]:
    return [default_model.tokenizer.encode(p) for p in PROMPTS]


def test_default_model_logits_match_transformers(
    default_model: LoadedModel, default_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    ours = our_logits(default_model, default_tokens)
    theirs = hf_logits(default_model_dir, default_tokens)
    assert_close(ours, theirs, atol=1e-3)
    # Same greedy next token wherever the choice is not a near-tie.
    for a, b in zip(ours, theirs, strict=True):
        top2 = b.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_bfloat16_logits_match_transformers_bfloat16(
    default_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    """bf16 end to end (weights, KV cache, attention where the CPU has native bf16)."""
    if not torch_ops.native_bf16():
        pytest.skip("bf16 matmul is emulated on this CPU: too slow for a 135M model here")
    loaded = load_model(str(default_model_dir), torch.device("cpu"), torch.bfloat16)
    ours = our_logits(loaded, default_tokens)
    theirs = hf_logits(default_model_dir, default_tokens, torch.bfloat16)
    reference = hf_logits(default_model_dir, default_tokens)
    for a, b, exact in zip(ours, theirs, reference, strict=True):
        assert a.shape == b.shape and bool(a.isfinite().all())
        # Both round differently from the fp32 logits; ours may not drift much further.
        ours_err, theirs_err = (a - exact).abs(), (b - exact).abs()
        assert ours_err.mean() < 2 * theirs_err.mean() + 0.02, (ours_err.mean(), theirs_err.mean())
        assert ours_err.max() < 3 * theirs_err.max(), (ours_err.max(), theirs_err.max())
        top2 = exact.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0
        assert torch.equal(a.argmax(-1)[clear], exact.argmax(-1)[clear])


def test_packed_bfloat16_weights_compute_what_dense_ones_do(
    default_model_dir: Path, default_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    if not cpu_weight_packing_available(cpu, torch.bfloat16):
        pytest.skip("this CPU has no native bf16 matmul: weights stay dense")
    packed = load_model(str(default_model_dir), cpu, torch.bfloat16)
    qkv = packed.model.layers[0].self_attn.qkv_proj
    assert qkv.packed is not None and qkv.weight.is_meta
    assert packed.model.lm_head_packed is not None
    monkeypatch.setattr(loader, "cpu_weight_packing_available", lambda *_: False)
    dense = load_model(str(default_model_dir), cpu, torch.bfloat16)
    assert dense.model.layers[0].self_attn.qkv_proj.packed is None
    exact = load_model(str(default_model_dir), cpu, torch.float32)
    for a, b, e in zip(
        our_logits(packed, default_tokens),
        our_logits(dense, default_tokens),
        our_logits(exact, default_tokens),
        strict=True,
    ):
        # Same bf16 products, fp32 sums in another order: after 30 layers the two differ
        # about as much as either differs from fp32, and neither may be the worse by far.
        packed_err, dense_err = (a - e).abs(), (b - e).abs()
        assert packed_err.mean() < 1.5 * dense_err.mean() + 0.02
        assert packed_err.max() < 2 * dense_err.max() + 0.1
        top2 = e.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0
        assert torch.equal(a.argmax(-1)[clear], e.argmax(-1)[clear])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}],
    ids=["untied", "biases-tied"],
)
def test_mkl_packed_fp32_weights_compute_what_dense_ones_do(
    make_tiny_model: Callable[..., Path], overrides: dict
) -> None:
    """One packed weight serves every batch size, in place of the dense one."""
    cpu = torch.device("cpu")
    if not cpu_mkl_packing_available(cpu, torch.float32):
        pytest.skip("torch was built without MKL: fp32 weights stay dense")
    path = str(make_tiny_model("llama", **overrides))
    packed, dense = load_model(path, cpu), load_model(path, cpu, pack=False)
    linears = [packed.model.layers[0].self_attn.qkv_proj, dense.model.layers[0].mlp.down_proj]
    assert linears[0].mkl is not None and linears[0].weight.is_meta
    assert linears[1].mkl is None and not linears[1].weight.is_meta
    assert packed.model.lm_head_mkl is not None and dense.model.lm_head_mkl is None
    gen = torch.Generator().manual_seed(3)
    # Batches of 1, 2, 5, 40 and 300 tokens: below, at and above the packing's batch size.
    for lengths in ([1], [2], [3, 2], [40], [150, 100, 50]):
        tokens = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]
        for a, b in zip(our_logits(packed, tokens), our_logits(dense, tokens), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decode_equal_one_shot(
    default_model: LoadedModel, default_tokens: list[list[int]], cpu_kernels: str
) -> None:
    tokens = default_tokens[2]
    one_shot = our_logits(default_model, [tokens])[0]
    cache = PagedCache(default_model.config, 2, len(tokens), seed=1)
    split = 37  # not a block boundary
    first = cache.step(default_model.model, [(0, tokens[:split], 0)])[0]
    # The second chunk shares its batch with another sequence's prefill.
    second, _ = cache.step(
        default_model.model, [(0, tokens[split:-1], split), (1, default_tokens[0], 0)]
    )
    last = cache.step(default_model.model, [(0, tokens[-1:], len(tokens) - 1)])[0]
    chunked = torch.cat([first, second, last])
    assert (chunked - one_shot).abs().max().item() < 1e-4


def test_fp32_forward_runs_the_compiled_layer_ops_unless_opted_out(
    default_model: LoadedModel,
    default_tokens: list[list[int]],
    cpu_kernels: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The step layer by layer: a step this small would otherwise run as one fused call
    # (tests/service/test_fused_step.py), which calls the kernels from compiled code.
    monkeypatch.setattr(default_model.model, "fused", None)
    calls: Counter[str] = Counter()
    module = cpu_layer()
    for name in ("rms_norm", "silu_mul", "rope_write_kv"):
        real = getattr(module, name)

        def counted(*args: object, real: Callable = real, name: str = name) -> object:
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(module, name, counted)
    our_logits(default_model, default_tokens[:2])
    layers = default_model.config.num_layers
    # Two norms per layer and the final one.
    compiled = {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rope_write_kv": layers}
    assert dict(calls) == (compiled if cpu_kernels == "compiled" else {})


def test_logits_only_for_requested_rows(default_model: LoadedModel) -> None:
    config = default_model.config
    cache = PagedCache(config, 1, 8)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    attn = AttentionMetadata(
        slot_mapping=(cache.block_tables[0, 0].long() * BLOCK_SIZE + torch.arange(5)),
        block_tables=cache.block_tables[:1],
        seq_lens=torch.tensor([5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
    )
    logits, tokens = default_model.model(
        tokens, torch.arange(5), cache.kv_caches, attn, torch.tensor([4])
    )
    assert tokens is None  # none asked for
    assert logits.shape == (1, config.vocab_size)
    assert logits.dtype == torch.float32


def test_batch_is_checked_once_by_the_first_layer(default_model: LoadedModel) -> None:
    """The kernels check a forward's batch on the first layer only; bad metadata is still
    refused with the argument named, and a good batch leaves the metadata marked checked."""
    cache = PagedCache(default_model.config, 1, 8)
    tokens = torch.tensor([1, 2, 3])

    def metadata(seq_lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=cache.block_tables[0, 0].long() * BLOCK_SIZE + torch.arange(3),
            block_tables=cache.block_tables[:1],
            seq_lens=seq_lens,
            query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        )

    bad = metadata(torch.tensor([3, 3], dtype=torch.int32))  # two lengths for one sequence
    with pytest.raises(ValueError, match="block_tables"):
        default_model.model(tokens, torch.arange(3), cache.kv_caches, bad, torch.tensor([2]))
    assert not bad.validated
    good = metadata(torch.tensor([3], dtype=torch.int32))
    default_model.model(tokens, torch.arange(3), cache.kv_caches, good, torch.tensor([2]))
    assert good.validated


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("llama3_rope", {}),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                }
            },
        ),
        ("mistral", {}),
        ("qwen2", {}),
    ],
    ids=[
        "llama",
        "llama-biases-tied",
        "llama3-rope",
        "linear-rope",
        "yarn-rope",
        "mistral",
        "qwen2",
    ],
)
def test_tiny_models_match_transformers(
    make_tiny_model: Callable[..., Path], preset: str, overrides: dict, cpu_kernels: str
) -> None:
    path = make_tiny_model(preset, **overrides)
    loaded = load_model(str(path), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    # Long enough to pass the llama3 preset's original context (64) and the yarn one (128).
    token_lists = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (200, 7, 1)]
    assert_close(our_logits(loaded, token_lists), hf_logits(path, token_lists), atol=1e-4)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("qwen2", {}),
    ],
    ids=["llama-untied", "llama-biases-tied", "qwen2"],
)
def test_tiny_models_in_bfloat16(
    make_tiny_model: Callable[..., Path], preset: str, overrides: dict
) -> None:
    """bf16 with every weight layout: untied and tied LM heads, q/k/v, o_proj and MLP
    biases (all packed for oneDNN where the CPU has native bf16)."""
    path = make_tiny_model(preset, **overrides)
    loaded = load_model(str(path), torch.device("cpu"), torch.bfloat16)
    packed = cpu_weight_packing_available(torch.device("cpu"), torch.bfloat16)
    assert (loaded.model.lm_head_packed is not None) == packed
    gen = torch.Generator().manual_seed(2)
    token_lists = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (90, 7, 1)]
    ours = our_logits(loaded, token_lists)
    theirs = hf_logits(path, token_lists, torch.bfloat16)
    exact = hf_logits(path, token_lists)
    for a, b, e in zip(ours, theirs, exact, strict=True):
        ours_err, theirs_err = (a - e).abs(), (b - e).abs()
        assert ours_err.mean() < 2 * theirs_err.mean() + 0.02, (ours_err.mean(), theirs_err.mean())
        assert ours_err.max() < 3 * theirs_err.max() + 0.05, (ours_err.max(), theirs_err.max())
