"""Our Llama-family forward pass matches Hugging Face's on the same weights, and the CPU
executor (`pagedinfer.kernels.cpu`) computes what that forward computes."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

from pagedinfer.kernels import AttentionMetadata, cpu, torch_ops
from pagedinfer.kernels.cpu import gemms, greedy_argmax
from pagedinfer.kernels.cpu.executor import CpuExecutor
from pagedinfer.service.loader import LoadedModel, load_model
from pagedinfer.service.models.llama import LlamaModel

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


def model_of(runner: LlamaModel | CpuExecutor) -> LlamaModel:
    return runner if isinstance(runner, LlamaModel) else runner.model


def our_logits(
    runner: LlamaModel | CpuExecutor,
    token_lists: list[list[int]],
    cache_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """All prompts packed into one flat batch, one prefill each, through the model's own
    forward or a CPU executor, over a KV cache of the model's dtype or `cache_dtype`."""
    model = model_of(runner)
    dtype = cache_dtype or model.embed_tokens.weight.dtype
    cache = PagedCache(model.config, len(token_lists), max(map(len, token_lists)), dtype=dtype)
    return cache.step(runner, [(i, t, 0) for i, t in enumerate(token_lists)])


def assert_as_near_as_theirs(
    ours: list[torch.Tensor], theirs: list[torch.Tensor], exact: list[torch.Tensor]
) -> None:
    """Our logits stay as near the exact (fp32) ones as transformers' bf16 logits do."""
    for a, b, e in zip(ours, theirs, exact, strict=True):
        ours_err, theirs_err = (a - e).abs(), (b - e).abs()
        assert ours_err.mean() < 2 * theirs_err.mean() + 0.02, (ours_err.mean(), theirs_err.mean())
        assert ours_err.max() < 3 * theirs_err.max() + 0.05, (ours_err.max(), theirs_err.max())


def assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], atol: float) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < atol


@pytest.fixture(params=["compiled", "torch"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU executor paths: the compiled kernels (numba is a dependency) and torch ops
    alone between its GEMMs (PAGEDINFER_CPU_KERNELS=torch, the opt-out)."""
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", request.param)
    return request.param


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def default_tokens(default_model: LoadedModel) -> list[list[int]]:
    return [default_model.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def executors() -> dict[str, CpuExecutor]:
    """The module's executors of the default model, by `cpu_kernels`."""
    return {}


@pytest.fixture
def default_executor(
    default_model: LoadedModel, executors: dict[str, CpuExecutor], cpu_kernels: str
) -> CpuExecutor:
    """The executor the model runner prepares for the default model (on a copy of it: the
    executor releases the dense GEMM weights), with the compiled kernels or without."""
    if cpu_kernels not in executors:
        executor = cpu.prepare(copy.deepcopy(default_model.model), BLOCK_SIZE)
        if executor is None:
            pytest.skip("no CPU executor for fp32 on this machine (no MKL, no numba)")
        executors[cpu_kernels] = executor
    executor = executors[cpu_kernels]
    assert executor.active
    assert executor.compiled == (cpu_kernels == "compiled")
    # SmolLM2 comes as a GGUF file: with the compiled kernels its weights serve from their
    # quantisation grids; without them MKL's packed GEMMs serve.
    assert executor.mode == ("grid" if executor.compiled else "mkl")
    return executor


def test_default_model_logits_match_transformers(
    default_model: LoadedModel, default_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    ours = our_logits(default_model.model, default_tokens)
    theirs = hf_logits(default_model_dir, default_tokens)
    assert_close(ours, theirs, atol=1e-3)
    # Same greedy next token wherever the choice is not a near-tie.
    for a, b in zip(ours, theirs, strict=True):
        top2 = b.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_the_executor_gives_the_default_models_logits(
    default_model: LoadedModel, default_tokens: list[list[int]], default_executor: CpuExecutor
) -> None:
    """Its GEMMs (the grids' or MKL's) sum in other orders than torch's matmul: within the
    tolerance the torch forward keeps to Hugging Face's, with the same clear argmax."""
    ours = our_logits(default_executor, default_tokens)
    reference = our_logits(default_model.model, default_tokens)
    assert_close(ours, reference, atol=1e-3)
    for a, b in zip(ours, reference, strict=True):
        top2 = b.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_bfloat16_logits_match_transformers_bfloat16(
    default_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    """bf16 end to end (weights, KV cache, attention) as it serves on a CPU with native
    bf16: the CPU executor's oneDNN GEMMs."""
    if not torch_ops.native_bf16():
        pytest.skip("bf16 matmul is emulated on this CPU: too slow for a 135M model here")
    loaded = load_model(str(default_model_dir), torch.device("cpu"), torch.bfloat16)
    executor = cpu.prepare(loaded.model, BLOCK_SIZE)
    if gemms.onednn_bf16_available(torch.bfloat16):
        assert executor is not None and executor.mode == "onednn"
    ours = our_logits(loaded.model if executor is None else executor, default_tokens)
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


def test_the_onednn_executor_computes_what_the_bfloat16_forward_does(
    default_model: LoadedModel, default_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    """bf16 weights in oneDNN's packed layout, where the CPU has native bf16: the same bf16
    products as the torch forward's, fp32 sums in another order."""
    if not gemms.onednn_bf16_available(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 matmul: the torch forward serves bf16")
    dense = load_model(str(default_model_dir), torch.device("cpu"), torch.bfloat16).model
    executor = cpu.prepare(copy.deepcopy(dense), BLOCK_SIZE)
    assert executor is not None and executor.active
    assert executor.mode == "onednn" and not executor.compiled
    assert isinstance(executor.layers[0].qkv, gemms.OneDnnGemm)
    assert isinstance(executor.lm_head, gemms.OneDnnGemm)
    assert executor.model.layers[0].self_attn.qkv_proj.weight.is_meta
    for a, b, e in zip(
        our_logits(executor, default_tokens),
        our_logits(dense, default_tokens),
        our_logits(default_model.model, default_tokens),
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
def test_the_fp32_executor_computes_what_the_torch_forward_does(
    make_tiny_model: Callable[..., Path], overrides: dict, cpu_kernels: str
) -> None:
    """fp32 weights off any grid. With the compiled kernels and no biases: the grid GEMMs
    from the weights in tile layout ("rebuilt") and the fused step; else MKL's packed
    GEMMs, one packed weight serving every batch size, with the compiled ops between them
    or torch's."""
    if not gemms.mkl_fp32_available(torch.float32):
        pytest.skip("torch was built without MKL: no packed fp32 GEMMs to compare")
    model = load_model(str(make_tiny_model("llama", **overrides)), torch.device("cpu")).model
    executor = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE)
    assert executor is not None and executor.active
    assert executor.compiled == (cpu_kernels == "compiled")
    if executor.compiled and not overrides:
        # The greedy argmax rounds the LM head, on no grid, to 8-bit codes.
        assert (executor.argmax is not None) == greedy_argmax.fast()
        assert executor.mode == "rebuilt" and executor.fused is not None
        kind = gemms.GridGemm
    else:
        assert executor.mode == "mkl" and executor.fused is None
        assert executor.argmax is None
        kind = gemms.MklGemm
    assert isinstance(executor.layers[0].qkv, kind)
    assert isinstance(executor.lm_head, kind)
    assert executor.model.layers[0].mlp.down_proj.weight.is_meta
    assert not model.layers[0].mlp.down_proj.weight.is_meta
    gen = torch.Generator().manual_seed(3)
    # Batches of 1, 2, 5, 40 and 300 tokens: below, at and above the packing's batch size.
    for lengths in ([1], [2], [3, 2], [40], [150, 100, 50]):
        tokens = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]
        for a, b in zip(our_logits(executor, tokens), our_logits(model, tokens), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def assert_chunked_equals_one_shot(
    runner: LlamaModel | CpuExecutor, default_tokens: list[list[int]]
) -> None:
    tokens = default_tokens[2]
    one_shot = our_logits(runner, [tokens])[0]
    cache = PagedCache(model_of(runner).config, 2, len(tokens), seed=1)
    split = 37  # not a block boundary
    first = cache.step(runner, [(0, tokens[:split], 0)])[0]
    # The second chunk shares its batch with another sequence's prefill.
    second, _ = cache.step(runner, [(0, tokens[split:-1], split), (1, default_tokens[0], 0)])
    last = cache.step(runner, [(0, tokens[-1:], len(tokens) - 1)])[0]
    chunked = torch.cat([first, second, last])
    assert (chunked - one_shot).abs().max().item() < 1e-4


def test_chunked_prefill_and_decode_equal_one_shot(
    default_model: LoadedModel, default_tokens: list[list[int]]
) -> None:
    assert_chunked_equals_one_shot(default_model.model, default_tokens)


def test_chunked_prefill_and_decode_equal_one_shot_on_the_executor(
    default_executor: CpuExecutor, default_tokens: list[list[int]]
) -> None:
    assert_chunked_equals_one_shot(default_executor, default_tokens)


def test_fp32_steps_run_the_compiled_layer_ops_unless_opted_out(
    default_model: LoadedModel,
    default_executor: CpuExecutor,
    default_tokens: list[list[int]],
    cpu_kernels: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor runs the ops between its GEMMs in compiled kernels unless opted out;
    the model's own forward never does."""
    from pagedinfer.kernels.cpu import layer_ops

    # The step layer by layer: a step this small would otherwise run as one fused call
    # (tests/service/test_fused_step.py), which calls the kernels from compiled code.
    monkeypatch.setattr(default_executor, "fused", None)
    calls: Counter[str] = Counter()
    for name in ("rms_norm", "silu_mul", "rope_write_kv"):
        real = getattr(layer_ops, name)

        def counted(*args: object, real: Callable = real, name: str = name) -> object:
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(layer_ops, name, counted)
    our_logits(default_model.model, default_tokens[:2])
    assert dict(calls) == {}
    our_logits(default_executor, default_tokens[:2])
    layers = default_model.config.num_layers
    # Two norms per layer and the final one.
    compiled = {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rope_write_kv": layers}
    assert dict(calls) == (compiled if cpu_kernels == "compiled" else {})


def test_logits_only_for_requested_rows(
    default_model: LoadedModel, default_executor: CpuExecutor
) -> None:
    config = default_model.config
    tokens = torch.tensor([1, 2, 3, 4, 5])

    def forward(runner: Any) -> Any:
        cache = PagedCache(config, 1, 8)
        attn = AttentionMetadata(
            slot_mapping=(cache.block_tables[0, 0].long() * BLOCK_SIZE + torch.arange(5)),
            block_tables=cache.block_tables[:1],
            seq_lens=torch.tensor([5], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        )
        return runner.forward(tokens, torch.arange(5), cache.kv_caches, attn, torch.tensor([4]))

    logits = forward(default_model.model)
    assert logits.shape == (1, config.vocab_size)
    assert logits.dtype == torch.float32
    executor_logits, picked = forward(default_executor)
    assert picked is None  # no greedy rows asked for
    assert executor_logits.shape == (1, config.vocab_size)
    assert executor_logits.dtype == torch.float32
    torch.testing.assert_close(executor_logits, logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("runner", ["model", "executor"])
def test_batch_is_checked_once_by_the_first_layer(
    default_model: LoadedModel, default_executor: CpuExecutor, runner: str
) -> None:
    """The kernels check a forward's batch on the first layer only; bad metadata is still
    refused with the argument named, and a good batch leaves the metadata marked checked."""
    forward = default_model.model if runner == "model" else default_executor.forward
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
        forward(tokens, torch.arange(3), cache.kv_caches, bad, torch.tensor([2]))
    assert not bad.validated
    good = metadata(torch.tensor([3], dtype=torch.int32))
    forward(tokens, torch.arange(3), cache.kv_caches, good, torch.tensor([2]))
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
        ("qwen3", {}),  # q/k norms, head_dim 32 past hidden_size / num_heads
    ],
    ids=[
        "llama",
        "llama-biases-tied",
        "llama3-rope",
        "linear-rope",
        "yarn-rope",
        "mistral",
        "qwen2",
        "qwen3",
    ],
)
def test_tiny_models_match_transformers(
    make_tiny_model: Callable[..., Path], preset: str, overrides: dict, cpu_kernels: str
) -> None:
    """The torch forward, and the executor the model runner would serve them with (random
    weights lie on no grid), with the compiled kernels or without."""
    path = make_tiny_model(preset, **overrides)
    model = load_model(str(path), torch.device("cpu"), torch.float32).model
    gen = torch.Generator().manual_seed(1)
    # Long enough to pass the llama3 preset's original context (64) and the yarn one (128).
    token_lists = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (200, 7, 1)]
    theirs = hf_logits(path, token_lists)
    assert_close(our_logits(model, token_lists), theirs, atol=1e-4)
    executor = cpu.prepare(model, BLOCK_SIZE)
    if gemms.mkl_fp32_available(torch.float32):
        assert executor is not None
    if executor is not None:
        assert executor.compiled == (cpu_kernels == "compiled")
        # The grid GEMMs from fp32 tiles with the compiled kernels, else MKL's.
        assert executor.mode in (("rebuilt", "mkl") if executor.compiled else ("mkl",))
        assert_close(our_logits(executor, token_lists), theirs, atol=1e-4)


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
    biases, through the torch forward and, where the CPU has native bf16, the executor's
    oneDNN-packed GEMMs."""
    path = make_tiny_model(preset, **overrides)
    model = load_model(str(path), torch.device("cpu"), torch.bfloat16).model
    gen = torch.Generator().manual_seed(2)
    token_lists = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (90, 7, 1)]
    runs = [our_logits(model, token_lists)]
    executor = cpu.prepare(model, BLOCK_SIZE)
    assert (executor is not None) == gemms.onednn_bf16_available(torch.bfloat16)
    if executor is not None:
        assert executor.mode == "onednn"
        runs.append(our_logits(executor, token_lists))
    theirs = hf_logits(path, token_lists, torch.bfloat16)
    exact = hf_logits(path, token_lists)
    for ours in runs:
        assert_as_near_as_theirs(ours, theirs, exact)


@pytest.mark.parametrize(
    ("preset", "overrides", "products"),
    [
        ("llama", {}, True),
        ("qwen2", {}, True),
        ("llama", {"attention_bias": True, "mlp_bias": True}, False),
    ],
    ids=["llama", "qwen2", "llama-biases"],
)
def test_bfloat16_multiplies_in_bf16_and_keeps_the_rest_in_fp32(
    make_tiny_model: Callable[..., Path], preset: str, overrides: dict, products: bool
) -> None:
    """An engine asked for bf16 on a CPU with AVX512-BF16 serves a model its executor
    implements with bf16 weights in the layers' GEMMs (`bf16_layer_kind`), K and V
    in a bf16 cache and fp32 everywhere else (Qwen2's q/k/v biases included); one with
    o_proj or MLP biases stays bf16 throughout.
    Either way the logits stay as near fp32's as transformers' bf16 logits are, as do
    those of the model's own forward in fp32 over a bf16 cache (what serves while the
    kernels compile)."""
    from pagedinfer.kernels.cpu import grid_gemm
    from pagedinfer.kernels.cpu.executor import bf16_layer_kind
    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.engine import LLMEngine

    if not torch_ops.native_bf16():
        pytest.skip("bf16 matmul is emulated on this CPU")
    path = make_tiny_model(preset, **overrides)
    config = EngineConfig(
        model=str(path),
        dtype="bfloat16",
        num_gpu_blocks=32,
        max_model_len=128,
        compile_in_background=False,
    )
    runner = LLMEngine(config).runner
    products = products and cpu.bf16_products_serve(runner.loaded.config)
    assert runner.bf16_products == products
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.model.embed_tokens.weight.dtype == (torch.float32 if products else torch.bfloat16)
    executor = runner.executor
    if products:
        assert executor is not None and executor.active and executor.mode == "rebuilt"
        layers = (bf16_layer_kind(),) * 4
        assert executor.fused.kinds == (*layers, grid_gemm.BF16)
    gen = torch.Generator().manual_seed(3)
    token_lists = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (90, 7, 1)]
    theirs = hf_logits(path, token_lists, torch.bfloat16)
    exact = hf_logits(path, token_lists)
    runners = [executor if executor is not None else runner.model]
    if products:  # the executor holds the GEMM weights now: a model of the model's own
        fp32_forward = load_model(str(path), torch.device("cpu"), torch.bfloat16).model.float()
        fp32_forward.reset_buffers()
        runners.append(fp32_forward)
    for served in runners:
        assert_as_near_as_theirs(our_logits(served, token_lists, runner.kv_dtype), theirs, exact)
