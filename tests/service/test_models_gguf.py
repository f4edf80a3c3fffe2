"""GGUF files of the architectures besides the embedded llama (qwen2 with its q/k/v
biases, qwen3, phi3, gemma3): a tiny random-weight model written as a GGUF file
(llama.cpp's tensor names and metadata, the default model's tokenizer) converts and
serves the original model's logits; a file whose conversion would drop something our
forward needs is refused, naming it."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from paged_cache import PagedCache

from pagedinfer.kernels.cpu.grid_gemm import SIX_BIT_CODES
from pagedinfer.service.loader import default_gguf_path, load_model

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@cache
def default_tokenizer_fields() -> dict[str, Any]:
    """The embedded model's GGUF tokenizer (a byte-level BPE), to write into other files."""
    from gguf import GGUFReader

    reader = GGUFReader(default_gguf_path())

    def strings(key: str) -> list[str]:
        field = reader.get_field(key)
        return [bytes(field.parts[i]).decode() for i in field.data]

    def integer(key: str) -> int:
        field = reader.get_field(key)
        return int(field.parts[field.data[0]][0])

    types = reader.get_field("tokenizer.ggml.token_type")
    return {
        "tokens": strings("tokenizer.ggml.tokens"),
        "merges": strings("tokenizer.ggml.merges"),
        "types": [int(types.parts[i][0]) for i in types.data],
        "pre": strings("tokenizer.ggml.pre")[0],
        "bos": integer("tokenizer.ggml.bos_token_id"),
        "eos": integer("tokenizer.ggml.eos_token_id"),
    }


def write_gguf(
    path: Path,
    arch: str,
    config: Any,
    state: dict[str, torch.Tensor],
    *,
    head_dim: int,
    norm_offset: float = 0.0,
    extra: dict[str, float] | None = None,
    tokenizer: bool = True,
    quantise: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
) -> Path:
    """A GGUF file as llama.cpp writes one: its metadata keys, its tensor names (gguf's own
    map from Hugging Face names), llama's q and k rows permuted as its converter does,
    fp32 tensors; norms stored plus norm_offset (Gemma's 1 + weight); the default model's
    tokenizer unless tokenizer=False. quantise(gguf name, fp32 array) may give a tensor's
    raw blocks and their type instead."""
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    for key, value in (extra or {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    if tokenizer:
        fields = default_tokenizer_fields()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(fields["pre"])
        writer.add_token_list(fields["tokens"])
        writer.add_token_types(fields["types"])
        writer.add_token_merges(fields["merges"])
        writer.add_bos_token_id(fields["bos"])
        writer.add_eos_token_id(fields["eos"])
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        array = tensor.float().numpy() + (norm_offset if "norm" in hf_name else 0.0)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        array = np.ascontiguousarray(array)
        raw = quantise(name, array) if quantise is not None else None
        if raw is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, raw[0], raw_dtype=raw[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a llama q or k weight's rows: each head's two
    rotary halves interleaved (transformers' GGUF loader undoes it)."""
    pairs = rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
    return pairs.swapaxes(1, 2).reshape(rows.shape)


def header_config(hidden_size: int, intermediate_size: int) -> Any:
    """The config fields `write_gguf` writes, for a one-layer file whose tensors a test
    writes itself (or none)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_hidden_layers=1,
        max_position_embeddings=4096,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
    )


# Each architecture as the GGUF conversion reads it back (transformers' mapping): no
# partial rotary or LongRoPE for Phi-3, Qwen3's head_dim of 128, Gemma 3's
# query_pre_attn_scalar of 256 and its default layer pattern (both layers local here).
GGUF_CASES = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, 0.0),
    "qwen3": ("Qwen3Config", {"head_dim": 128, "tie_word_embeddings": False}, 0.0),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "pad_token_id": None}, 0.0),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "pad_token_id": 0}, 1.0),
}


@pytest.mark.parametrize("arch", sorted(GGUF_CASES))
def test_gguf_file_serves_the_models_logits(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from tiny_models import TINY_BASE

    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    class_name, kwargs, norm_offset = GGUF_CASES[arch]
    config = getattr(transformers, class_name)(**{**TINY_BASE, **kwargs})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # make every norm count
                param.add_(torch.randn_like(param), alpha=0.3)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    path = write_gguf(
        tmp_path / f"tiny-{arch}.gguf",
        arch,
        config,
        model.state_dict(),
        head_dim=head_dim,
        norm_offset=norm_offset,
    )
    loaded = load_model(str(path), CPU, torch.float32, max_model_len=128)
    assert loaded.config.architecture == arch
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (ours,) = PagedCache(loaded.config, 1, len(tokens)).step(loaded.model, [(0, tokens, 0)])
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("arch", "head_dim", "extra", "message"),
    [
        ("phi3", 16, {"rope.dimension_count": 8.0}, r"partial rotary .*dimension_count=8"),
        ("phi3", 16, {"attention.sliding_window": 2047.0}, r"the sliding window \(2047\)"),
        ("qwen3", 32, {}, "head_dim=32"),
        ("gemma3", 256, {"rope.scaling.factor": 8.0}, r"rope scaling .*factor=8"),
    ],
)
def test_gguf_files_whose_conversion_loses_a_feature_are_refused(
    arch: str,
    head_dim: int,
    extra: dict[str, float],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    config = header_config(hidden_size=64, intermediate_size=96)
    path = write_gguf(
        tmp_path / f"{arch}.gguf", arch, config, {}, head_dim=head_dim, extra=extra, tokenizer=False
    )
    with pytest.raises(ValueError, match=f"would drop {message}"):
        load_model(str(path), CPU, torch.float32)


# --- quantised files: their blocks straight into the CPU executor's grids -------------

# A tiny llama whose GEMMs tile (out_features multiples of 64, in_features multiples of
# 256 for the K-quants): hidden 256, 4 heads of 64 (2 for K/V), intermediate 512.
QUANT_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
# Q6_K's kind: its 6-bit codes as they are where the CPU has 512-bit vectors, else 8-bit.
FINE = "fine6" if SIX_BIT_CODES else "fine8"
# GGUF tensor name prefix -> type, first match wins; each plan with the grid kinds the
# executor's positions get (q/k/v, o, gate/up, down, LM head; "a/b": layer 0 in kind a,
# layer 1 in kind b).
QUANT_PLANS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    # Every 32-wide type, one kind per position: Q4_0 with Q4_1 parts (4-bit), Q5_0 and
    # Q8_0 layers (8-bit, codes -16..15 and -128..127), Q5_1 (8-bit with offsets).
    "grid_types": (
        {
            "blk.0.attn_q": "Q4_0",
            "blk.0.attn_k": "Q4_1",
            "blk.0.attn_v": "Q4_0",
            "blk.1.attn_q": "Q4_1",
            "blk.1.attn_k": "Q4_1",
            "blk.1.attn_v": "Q4_1",
            "blk.0.attn_output": "Q5_0",
            "blk.1.attn_output": "Q8_0",
            "blk.0.ffn_gate": "Q5_1",
            "blk.0.ffn_up": "Q5_1",
            "blk.1.ffn_gate": "Q5_1",
            "blk.1.ffn_up": "Q5_1",
            "blk.0.ffn_down": "Q8_0",
            "blk.1.ffn_down": "Q8_0",
            "output.": "Q8_0",
            "token_embd": "Q8_0",
        },
        ("affine4", "scaled8", "scaled8", "scaled8", "scaled8"),
    ),
    # As llama-quantize's Q4_K_M mixes them: q/k/v of Q5_0 and Q8_0 parts, down Q6_K in
    # one layer (fine) and Q4_K in the other (4-bit, the file's scales), K-quant
    # embeddings.
    "q4_k_m_like": (
        {
            "blk.0.attn_v": "Q8_0",
            "blk.1.attn_v": "Q8_0",
            "blk.0.ffn_down": "Q6_K",
            "blk.1.ffn_down": "Q4_K",
            "blk.": "Q5_0",
            "output.": "Q8_0",
            "token_embd": "Q4_K",
        },
        ("scaled8", "scaled8", "scaled8", f"{FINE}/affine4", "scaled8"),
    ),
    # Q4_K_M of a model whose rows are multiples of 256: Q4_K (4-bit codes), Q5_K (8-bit
    # codes), Q6_K (fine: per 16), each with the file's scales.
    "k_quants": (
        {
            "blk.0.ffn_down": "Q6_K",
            "blk.1.ffn_down": "Q6_K",
            "blk.0.attn_output": "Q5_K",
            "blk.1.attn_output": "Q5_K",
            "blk.": "Q4_K",
            "output.": "Q6_K",
            "token_embd": "Q4_K",
        },
        ("affine4", "scaled8", "affine4", FINE, FINE),
    ),
    # An IQ4_XS file as llama-quantize makes it: IQ4_XS layers (4-bit indices into the 16
    # levels, the file's scales), IQ4_NL where a row is not whole super-blocks (the same
    # indices, fp16 scales), a Q6_K LM head (fine).
    "iq4_xs": (
        {
            "blk.0.ffn_down": "IQ4_NL",
            "blk.": "IQ4_XS",
            "output.": "Q6_K",
            "token_embd": "IQ4_XS",
        },
        ("levels4", "levels4", "levels4", "levels4", FINE),
    ),
    # The other types: K-quant parts beside an fp32 layer (rebuilt), a Q4_0 layer beside
    # a Q8_0 one (each in its own kind), Q6_K (fine), F16 and BF16 (rebuilt), and a Q5_1
    # LM head (8-bit with offsets: no 8-bit argmax).
    "the_rest": (
        {
            "blk.0.attn_q": "Q2_K",
            "blk.0.attn_k": "Q3_K",
            "blk.0.attn_v": "Q5_K",
            "blk.1.attn_q": "Q4_K",
            "blk.0.attn_output": "Q4_0",
            "blk.1.attn_output": "Q8_0",
            "blk.0.ffn_gate": "F16",
            "blk.0.ffn_up": "BF16",
            "blk.1.ffn_gate": "Q5_K",
            "blk.0.ffn_down": "Q6_K",
            "blk.1.ffn_down": "Q6_K",
            "output.": "Q5_1",
        },
        ("rebuilt", "affine4/scaled8", "rebuilt", FINE, "scaled8"),
    ),
}
# The d (and dmin) of the types gguf-py does not quantise, for weights of a few
# hundredths from random codes and scales.
K_QUANT_SCALE = {"Q2_K": 1e-3, "Q3_K": 5e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 1e-5}
K_QUANT_SCALE.update({"IQ4_NL": 3e-4, "IQ4_XS": 1e-5})


def quantiser(plan: dict[str, str], seed: int = 0) -> Callable[[str, np.ndarray], Any]:
    """write_gguf's quantise for a plan: gguf-py quantises the types it can; K-quant
    tensors are random valid blocks (their values are whatever those blocks hold)."""
    import gguf
    from test_gguf_quants import FP16_FIELDS

    rng = np.random.default_rng(seed)

    def quantise(name: str, array: np.ndarray) -> tuple[np.ndarray, Any] | None:
        type_name = next((t for prefix, t in plan.items() if name.startswith(prefix)), None)
        if type_name is None or array.ndim != 2:
            return None
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name not in K_QUANT_SCALE:
            raw = gguf.quants.quantize(array, qtype)
            return raw, None if type_name == "F16" else qtype
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, blocks = array.shape[0], array.shape[1] // values
        raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
        for offset in FP16_FIELDS[type_name]:
            field = (rng.random((rows, blocks)) + 0.5) * K_QUANT_SCALE[type_name]
            raw[:, :, offset : offset + 2] = (
                field.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
            )
        return raw.reshape(rows, blocks * nbytes), qtype

    return quantise


def quantised_llama(tmp_path: Path, plan_name: str) -> Path:
    """A tiny random llama written as a GGUF file of the plan's tensor types."""
    import transformers
    from tiny_models import TINY_BASE

    config = transformers.LlamaConfig(**{**TINY_BASE, **QUANT_CONFIG})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.3)
            else:
                param.normal_(0, 0.05)
    return write_gguf(
        tmp_path / f"tiny-{plan_name}.gguf",
        "llama",
        config,
        model.state_dict(),
        head_dim=64,
        quantise=quantiser(QUANT_PLANS[plan_name][0]),
    )


def greedy_tokens(runner: Any, config: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding: through an executor with its greedy rows (picked without their
    logits where it can), or through a model's torch forward."""
    from pagedinfer.service.models import DecoderModel

    cache = PagedCache(config, 1, len(prompt) + steps)
    tokens: list[int] = []
    chunk = (0, prompt, 0)
    for _ in range(steps):
        greedy = None if isinstance(runner, DecoderModel) else torch.tensor([True])
        logits, picked = cache.forward(runner, [chunk], greedy, [len(chunk[1]) - 1])
        picked_token = -1 if picked is None else int(picked[0])
        tokens.append(picked_token if picked_token >= 0 else int(logits[0].argmax()))
        chunk = (0, [tokens[-1]], chunk[2] + len(chunk[1]))
    return tokens


@pytest.mark.parametrize("plan_name", sorted(QUANT_PLANS))
def test_quantised_gguf_file_serves_transformers_logits_from_its_blocks(
    plan_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file loads, serves transformers' logits of the same file, and the CPU executor's
    grids come from its blocks where their type is one (each equal to the model's weight),
    with at most two kinds per position (each layer in its own) or that position rebuilt."""
    import transformers

    from pagedinfer.kernels.cpu.executor import choose_grids, weight_grid

    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = quantised_llama(tmp_path, plan_name)
    loaded = load_model(str(path), CPU, torch.float32, max_model_len=128)
    model = loaded.model
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (ours,) = PagedCache(loaded.config, 1, len(tokens)).step(model, [(0, tokens, 0)])
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        theirs = theirs_model(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4

    from pagedinfer.service.gguf_quants import GRID_TYPES

    params = dict(model.named_parameters())
    for name in model.gguf_grids:
        assert set(model.gguf_grids.types(name)) <= set(GRID_TYPES)
        grid, source = weight_grid(params[name], name, model.gguf_grids)
        assert "blocks" in source, name
        assert torch.equal(grid.dense(), params[name].detach()), name
    layers, lm_head = choose_grids(model)
    kinds = [[g.kind for g in position] for position in zip(*layers, strict=True)]
    kinds.append([lm_head.kind])
    assert tuple("/".join(dict.fromkeys(k)) for k in kinds) == QUANT_PLANS[plan_name][1]


def test_quantised_gguf_file_decodes_greedily_through_the_executor_as_torch_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Q4_K_M-like file through the CPU executor (grids from its blocks, the down
    projections' Q6_K and Q4_K each in its own kind): the torch forward's greedy tokens."""
    import copy

    from paged_cache import BLOCK_SIZE

    from pagedinfer.kernels import cpu, torch_ops

    if not torch_ops.compiled_kernels():
        pytest.skip("the grids run on the compiled kernels")
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_model(str(quantised_llama(tmp_path, "q4_k_m_like")), CPU, torch.float32)
    reference = copy.deepcopy(loaded.model)
    executor = cpu.prepare(loaded.model, BLOCK_SIZE)
    assert executor is not None and executor.active and executor.mode == "grid"
    plan = [kinds.split("/") for kinds in QUANT_PLANS["q4_k_m_like"][1]]
    assert executor.fused.kinds == tuple(k[0] for k in plan)
    assert executor.fused.second_kinds == tuple(k[1] if len(k) > 1 else None for k in plan[:4])
    prompt = torch.randint(3, 49152, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = greedy_tokens(reference, loaded.config, prompt, 12)
    assert greedy_tokens(executor, loaded.config, prompt, 12) == expected


@pytest.mark.parametrize(("type_name", "values"), [("IQ2_XXS", 256), ("TQ1_0", 256)])
def test_a_gguf_file_with_a_type_we_do_not_read_is_refused_before_converting(
    type_name: str, values: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf
    import transformers

    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))

    def no_conversion(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("converted a file it should have refused")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    config = header_config(hidden_size=256, intermediate_size=256)
    qtype = gguf.GGMLQuantizationType[type_name]
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]

    def quantise(name: str, array: np.ndarray) -> tuple[np.ndarray, Any] | None:
        if "ffn_down" not in name:
            return None
        raw = np.zeros((array.shape[0], array.shape[1] // values * nbytes), dtype=np.uint8)
        return raw, qtype

    state = {
        "model.layers.0.mlp.down_proj.weight": torch.zeros(256, 256),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(256, 256),
    }
    path = write_gguf(tmp_path / "odd.gguf", "llama", config, state, head_dim=64, quantise=quantise)
    with pytest.raises(
        ValueError, match=rf"'blk.0.ffn_down.weight' has GGUF type {type_name}.*supported: F32"
    ):
        load_model(str(path), CPU, torch.float32)


@pytest.mark.parametrize("plan_name", ["grid_types", "k_quants", "q4_k_m_like"])
def test_int8_products_run_the_files_codes_and_give_logits_close_to_fp32(
    plan_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With int8 products every layer position on a grid runs the integer GEMM of its
    codes (the LM head keeps its grid), in a prompt step and in decode steps, and the
    logits stay within a few percent of the exact fp32 path's: the rows' rounding to
    int8 and nothing more (a wrong scale or offset moves them by their whole size)."""
    import copy

    from paged_cache import BLOCK_SIZE

    from pagedinfer.kernels import cpu, torch_ops
    from pagedinfer.kernels.cpu import grid_gemm

    if not torch_ops.compiled_kernels():
        pytest.skip("the grids run on the compiled kernels")
    monkeypatch.setenv("PAGEDINFER_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_model(str(quantised_llama(tmp_path, plan_name)), CPU, torch.float32)
    exact = cpu.prepare(copy.deepcopy(loaded.model), BLOCK_SIZE)
    ints = cpu.prepare(loaded.model, BLOCK_SIZE, int8_products=True)
    assert ints is not None and ints.active and ints.mode == "grid"
    dots = {
        grid_gemm.AFFINE4: grid_gemm.DOT4,
        grid_gemm.SCALED8: grid_gemm.DOT8,
        grid_gemm.FINE8: grid_gemm.DOT6_FINE,  # a Q6_K's codes, kept in 6 bits
        grid_gemm.FINE6: grid_gemm.DOT6_FINE,
    }
    for position in range(4):
        for kind, int_kind in (
            (exact.fused.kinds[position], ints.fused.kinds[position]),
            (exact.fused.second_kinds[position], ints.fused.second_kinds[position]),
        ):
            # 8-bit codes that fit 5 bits (Q5_1's) are kept in 5
            expected = (grid_gemm.DOT5, grid_gemm.DOT8) if kind == grid_gemm.SCALED8 else ()
            assert int_kind == dots.get(kind, kind) or int_kind in expected, (position, kind)
    assert ints.fused.kinds[4] == exact.fused.kinds[4]
    assert any(k in grid_gemm.DOTS for k in ints.fused.kinds)
    if plan_name == "grid_types":  # gate/up: Q5_1 in both layers
        assert ints.fused.kinds[2] == grid_gemm.DOT5
    prompt = torch.randint(3, 49152, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    steps = [(0, prompt, 0), (0, [7], 21), (0, [11], 22)]
    caches = [PagedCache(loaded.config, 1, 32) for _ in range(2)]
    for chunk in steps:
        (want,) = caches[0].step(exact, [chunk])
        (got,) = caches[1].step(ints, [chunk])
        error = (got - want).abs().max() / want.abs().max()
        assert error < 0.05, (chunk[2], float(error))
