"""The CPU backend's door: the executor serves exactly the model features it implements,
gives the logits of the model's own torch forward for each of them, and leaves every
other configuration to that forward."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_cache import BLOCK_SIZE, PagedCache

from pagedinfer.kernels import cpu
from pagedinfer.service.models import FEATURES, DecoderModel, ModelConfig, build_model

BASE: dict[str, Any] = {
    "architecture": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 256,
}

# One configuration per feature the model layer knows: a feature added to the model layer
# without a case here fails `test_every_model_feature_has_a_case`.
FEATURE_CASES: dict[str, dict[str, Any]] = {
    "rms_norm": {},
    "silu_glu": {},
    "rope_neox": {},
    "rope_scaling_linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "rope_scaling_dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_scaling_llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "rope_scaling_yarn": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    },
    "grouped_query_attention": {"num_kv_heads": 2},
    "qkv_bias": {"attention_bias": True},
    "o_proj_bias": {"o_proj_bias": True},
    "mlp_bias": {"mlp_bias": True},
    "tied_embeddings": {"tie_word_embeddings": True},
    "untied_lm_head": {},
    "rope_scaling_longrope": {
        "rope_scaling": {
            "rope_type": "longrope",
            "factors": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            "attention_factor": 1.2,
        }
    },
    "partial_rotary": {"partial_rotary_factor": 0.5},
    "no_rope_layers": {"nope_layers": (1,)},
    "local_layer_rope": {"local_layers": (0,), "local_rope_theta": 100.0},
    "sliding_window": {"local_layers": (0, 1), "sliding_window": 8},  # shorter than a prompt
    "qk_norm": {"architecture": "qwen3", "qk_norm": True},
    "query_pre_attn_scalar": {"query_pre_attn_scalar": 32.0},
    "final_logit_softcapping": {"final_logit_softcapping": 3.0},
    **{
        feature: {"architecture": "gemma3", "qk_norm": True, "query_pre_attn_scalar": 16.0}
        for feature in ("gemma_rms_norm", "gelu_tanh_glu", "scaled_embeddings", "sandwich_norms")
    },
}

# A prompt each for two sequences, then a decode and a four-token run.
PROMPTS = [(0, [3, 17, 99, 5, 42, 7, 8, 200, 31, 64, 12, 9, 150, 77, 1, 2, 3, 4, 5], 0),
           (1, [250, 4, 4, 60, 61, 62], 0)]  # fmt: skip
NEXT = [(0, [11], 19), (1, [5, 6, 7, 8], 6)]


def random_model(config: ModelConfig, seed: int = 0) -> DecoderModel:
    """The architecture's model with seeded random weights, biases and norms (none left
    at their init)."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.2 * noise)
    return model


def logits_of(runner: Any, config: ModelConfig) -> torch.Tensor:
    cache = PagedCache(config, 2, 64)
    first = torch.cat(cache.step(runner, PROMPTS))
    return torch.cat((first, *cache.step(runner, NEXT)))


def test_every_model_feature_has_a_case() -> None:
    assert set(FEATURE_CASES) == set(FEATURES)


def test_the_executor_claims_only_features_the_model_layer_knows() -> None:
    assert set(FEATURES) >= cpu.SUPPORTED_FEATURES


@pytest.mark.parametrize("feature", sorted(FEATURE_CASES))
def test_each_feature_is_served_as_the_torch_forward_serves_it_or_left_to_it(
    feature: str,
) -> None:
    config = ModelConfig(**{**BASE, **FEATURE_CASES[feature]})
    assert feature in config.features()
    model = random_model(config)
    expected = logits_of(model, config)
    executor = cpu.prepare(copy.deepcopy(model), BLOCK_SIZE)
    if feature not in cpu.SUPPORTED_FEATURES:
        assert executor is None
        return
    if executor is None:
        pytest.skip("no CPU executor on this machine (no MKL for fp32)")
    assert executor.active
    torch.testing.assert_close(logits_of(executor, config), expected, rtol=1e-4, atol=1e-4)


def compiled_signatures() -> int:
    """How many kernel signatures numba has compiled (or loaded) in this process."""
    import gc

    import numba

    dispatchers = [o for o in gc.get_objects() if isinstance(o, numba.core.dispatcher.Dispatcher)]
    return sum(len(d.overloads) for d in dispatchers)


# What families change in the Llama layer, each served by the kernels a Llama of the same
# shapes compiles: the q/k norms' weights, which dims of which layer rotate by which table,
# each layer's window, the attention scale and the logits' cap are data, not kernel variants.
DATA_FEATURES = (
    "sliding_window",
    "qk_norm",
    "no_rope_layers",
    "partial_rotary",
    "rope_scaling_longrope",
    "local_layer_rope",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
)


@pytest.mark.parametrize("feature", DATA_FEATURES)
def test_family_features_are_data_of_the_kernels_a_llama_of_their_shapes_runs(
    feature: str,
) -> None:
    """Serving a model with the feature after a Llama of the same shapes compiles no new
    kernel signature (Qwen3's q/k norms, SmolLM3's NoPE layers, Phi-3's partial rotary and
    LongRoPE, a local layers' rope)."""
    llama = cpu.prepare(random_model(ModelConfig(**BASE)), BLOCK_SIZE)
    if llama is None or not llama.compiled:
        pytest.skip("no compiled kernels on this machine")
    before = compiled_signatures()
    config = ModelConfig(**{**BASE, **FEATURE_CASES[feature]})
    family = cpu.prepare(random_model(config), BLOCK_SIZE)
    assert family is not None and family.active and family.fused is not None
    assert compiled_signatures() == before
    layers, head_dim = BASE["num_layers"], BASE["head_dim"]
    assert llama.fused.qk_norm.shape == (layers, 0, 0)
    assert llama.fused.rope.tolist() == [[head_dim, 0]] * layers
    if feature == "qk_norm":
        assert family.fused.qk_norm.shape == (layers, 2, head_dim)
    rope = {
        "no_rope_layers": [[head_dim, 0], [0, 0]],
        "partial_rotary": [[head_dim // 2, 0]] * layers,
        "local_layer_rope": [[head_dim, 1], [head_dim, 0]],
    }
    assert family.fused.rope.tolist() == rope.get(feature, [[head_dim, 0]] * layers)
    windows = {"sliding_window": [8, 8]}
    assert family.fused.windows.tolist() == windows.get(feature, [0] * layers)


def test_a_feature_the_executor_lacks_leaves_the_model_to_its_torch_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ModelConfig(**BASE)
    monkeypatch.setattr(
        ModelConfig, "features", lambda self: frozenset({"rms_norm", "a_new_kind_of_norm"})
    )
    assert cpu.unsupported_features(config) == ["a_new_kind_of_norm"]
    assert not cpu.supports(config)
    assert cpu.prepare(random_model(config), BLOCK_SIZE) is None


def test_activating_releases_the_models_dense_gemm_weights() -> None:
    config = ModelConfig(**BASE)
    model = random_model(config)
    executor = cpu.prepare(model, BLOCK_SIZE)
    if executor is None:
        pytest.skip("no CPU executor on this machine (no MKL for fp32)")
    for layer in model.layers:
        assert all(linear.weight.is_meta for linear in layer.linears())
    assert model.lm_head is not None and model.lm_head.weight.is_meta
    assert not model.embed_tokens.weight.is_meta  # the token lookup still reads it


def test_a_background_warm_up_leaves_the_dense_weights_until_activated() -> None:
    config = ModelConfig(**BASE)
    model = random_model(config)
    executor = cpu.prepare(model, BLOCK_SIZE, background=True)
    if executor is None:
        pytest.skip("no CPU executor on this machine (no MKL for fp32)")
    assert not executor.active
    assert executor.wait_ready(timeout=600)
    assert not model.layers[0].self_attn.qkv_proj.weight.is_meta
    executor.activate()
    assert model.layers[0].self_attn.qkv_proj.weight.is_meta


def test_the_same_configuration_always_takes_the_same_path() -> None:
    config = dataclasses.replace(ModelConfig(**BASE))
    modes = {cpu.executor.choose_mode(random_model(config, seed)) for seed in range(3)}
    assert len(modes) == 1


# Run in a fresh interpreter: this process's kernels are already compiled in memory.
CHILD_COMPILE_SCRIPT = """
import gc, json, logging, sys
import numba, torch
sys.path.insert(0, sys.argv[1])
from test_cpu_executor import BASE, random_model
from pagedinfer.kernels import cpu
from pagedinfer.service.models import ModelConfig
logging.basicConfig(level=logging.INFO)
model = random_model(ModelConfig(**BASE))
executor = cpu.prepare(model, 16, background=True)
if executor is None or not executor.compiled:
    print(json.dumps(None)); sys.exit()
assert executor.wait_ready(timeout=900), executor.error
dispatchers = [o for o in gc.get_objects() if isinstance(o, numba.core.dispatcher.Dispatcher)]
print(json.dumps({
    "hits": sum(sum(d._cache_hits.values()) for d in dispatchers),
    "misses": sum(sum(d._cache_misses.values()) for d in dispatchers),
}))
"""


def test_a_background_warm_up_compiles_in_a_child_and_only_loads_here(
    tmp_path: Path,
) -> None:
    """The server's warm-up compiles its kernels in a forked child (LLVM's memory is
    never the server's); this process then loads every kernel from numba's disk cache
    (empty at first) and compiles none itself."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("PAGEDINFER_NUMBA_PREBUILT", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD_COMPILE_SCRIPT, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    if counts is None:
        pytest.skip("no compiled CPU kernels on this machine")
    assert "compiling the kernels in a child process" in done.stderr
    assert counts["misses"] == 0, done.stderr[-3000:]
    assert counts["hits"] > 0


# As above, with a weight store: the child stores the weights it built, and this process
# reads them back at activation, once the model's dense weights are released.
STORED_COMPILE_SCRIPT = """
import gc, json, logging, sys
from pathlib import Path
import numba, torch
sys.path.insert(0, sys.argv[1])
from paged_cache import PagedCache
from test_cpu_executor import BASE, random_model
from pagedinfer.kernels import cpu
from pagedinfer.service.models import ModelConfig
logging.basicConfig(level=logging.INFO)
config = ModelConfig(**BASE)
model = random_model(config)
executor = cpu.prepare(model, 16, background=True, store=Path(sys.argv[2]))
if executor is None or executor.mode != "grid":
    print(json.dumps(None)); sys.exit()
assert executor.wait_ready(timeout=900), executor.error
prompt = [(0, list(range(3, 30)), 0)]
with torch.inference_mode():
    want = PagedCache(config, 1, 40, seed=3).step(model, prompt)[0]
built_ready = executor.fused is not None
dense_at_build = []
build = executor._build
def spy():
    dense_at_build.append(not model.layers[0].self_attn.qkv_proj.weight.is_meta)
    build()
executor._build = spy
executor.activate()
with torch.inference_mode():
    got = PagedCache(config, 1, 40, seed=3).step(executor, prompt)[0]
dispatchers = [o for o in gc.get_objects() if isinstance(o, numba.core.dispatcher.Dispatcher)]
print(json.dumps({
    "built_when_ready": built_ready,
    "dense_at_build": dense_at_build,
    "max_diff": float((got - want).abs().max()),
    "misses": sum(sum(d._cache_misses.values()) for d in dispatchers),
    "hits": sum(sum(d._cache_hits.values()) for d in dispatchers),
}))
"""


def test_after_a_child_compile_the_stored_weights_are_read_once_the_dense_ones_are_released(
    tmp_path: Path,
) -> None:
    """The server never holds the executor's form of the weights beside the dense ones:
    the child stores what it built, and activation releases the dense weights, then reads
    the store and loads every kernel the child compiled (none compiled here: the kinds
    read back give the kernels the keys the child's had), and serves the torch forward's
    logits."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    env.pop("PAGEDINFER_NUMBA_PREBUILT", None)
    done = subprocess.run(
        [sys.executable, "-c", STORED_COMPILE_SCRIPT, str(Path(__file__).parent),
         str(tmp_path / "grids.bin")],
        capture_output=True, text=True, timeout=1200, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found is None:
        pytest.skip("no compiled grid GEMMs on this machine")
    assert "compiling the kernels in a child process" in done.stderr
    assert (tmp_path / "grids.bin").is_file()
    assert not found["built_when_ready"]
    assert found["dense_at_build"] == [False]
    assert found["misses"] == 0, done.stderr[-3000:]
    assert found["hits"] > 0
    assert found["max_diff"] < 1e-3


def test_zero_pages_gives_back_the_whole_pages_of_a_large_array_only() -> None:
    """The compiling child's built weights read as zeros afterwards, page by page: the
    pages wholly inside the array, none of its neighbours' bytes; small arrays stay."""
    import numpy as np

    from pagedinfer.kernels.cpu.executor import zero_pages

    page = os.sysconf("SC_PAGE_SIZE")
    buffer = np.ones(4 * 2**20 + 3, np.uint8)
    array = buffer[5 : buffer.size - 7]  # C-contiguous, its ends inside pages
    zero_pages(array)
    start = -(-array.ctypes.data // page) * page - buffer.ctypes.data
    end = (array.ctypes.data + array.nbytes) // page * page - buffer.ctypes.data
    assert not buffer[start:end].any()
    assert buffer[:start].all() and buffer[end:].all()
    small = np.ones(2**19, np.uint8)
    zero_pages(small)
    assert small.all()
