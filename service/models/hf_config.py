"""A Hugging Face config.json, as a dict, translated into our `ModelConfig`, one
architecture at a time; every config feature our forward passes do not implement is
refused with an error naming it, never served wrong.
"""

from __future__ import annotations

import math
from typing import Any

from pagedinfer.service.models.config import ModelConfig

# Hugging Face model_type -> our architecture name.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "gemma3_text": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Relatives of the supported architectures that we do not serve, and why.
REFUSED_ARCHITECTURES = {
    "gemma3": "multimodal Gemma 3 (Gemma3ForConditionalGeneration, a vision tower beside "
    "language_model weights) is not supported; serve a text-only checkpoint "
    "(model_type 'gemma3_text', Gemma3ForCausalLM)",
    "qwen3_moe": "Qwen3 mixture-of-experts models are not supported",
    "phi3small": "Phi-3-small (blocksparse attention, gegelu MLP) is not supported",
    "phimoe": "Phi-3.5-MoE (mixture of experts) is not supported",
    "phi3_v": "Phi-3-vision (multimodal) is not supported",
}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# Hugging Face's defaults where a config.json may leave a field out.
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma3_text": 256}
_DEFAULT_ROPE_THETA = {"gemma3_text": 1_000_000.0}
_DEFAULT_LOCAL_ROPE_THETA = 10_000.0  # Gemma 3's sliding-window layers
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2 and Qwen3
_DEFAULT_PHI3_ORIGINAL_MAX = 4096
# Architectures that may rotate only part of each head (their HF modeling slices it).
_PARTIAL_ROTARY = ("phi3",)
_LONGROPE = ("phi3",)


def model_config_from_hf(
    raw: dict[str, Any], max_model_len: int | None = None, name: str = ""
) -> ModelConfig:
    """Translate a Hugging Face config.json (as a dict) into our ModelConfig, or refuse it.

    max_model_len: the longest context that will be served (default: the model's
    max_position_embeddings); features that only break beyond some length (dynamic
    rope) are refused only when it reaches them, a sliding window is served as one only
    where it is shorter, and LongRoPE picks its factors by it.
    """
    model_type = raw.get("model_type")
    if model_type in REFUSED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r}: "
            f"{REFUSED_ARCHITECTURES[model_type]}"
        )
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r}, "
            f"architectures={raw.get('architectures')} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    _refuse_unimplemented(raw, model_type)

    max_pos = int(raw.get("max_position_embeddings", 2048))
    used_len = max_model_len or max_pos
    if used_len > max_pos:
        raise ValueError(
            f"max_model_len={used_len} exceeds the model's max_position_embeddings={max_pos}: "
            f"give --max-model-len {max_pos} or less"
        )
    num_layers = int(raw["num_hidden_layers"])
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    head_dim = int(
        raw.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or hidden_size // num_heads
    )
    window, local_layers = _sliding_window(raw, model_type, num_layers)
    # A window no shorter than the served context is full attention and changes nothing.
    sliding_window = window if window is not None and window < used_len else None
    rope_theta, rope_scaling, partial = _rope(raw, model_type, used_len)
    local_rope_theta = _gemma3_local_rope_theta(raw) if model_type == "gemma3_text" else None
    attention_bias, o_proj_bias, mlp_bias = _biases(raw, model_type)
    gemma = model_type == "gemma3_text"
    return ModelConfig(
        architecture=ARCHITECTURES[model_type],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # Hugging Face's base-config default is True; Llama-family configs write it out.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=attention_bias,
        max_position_embeddings=max_pos,
        eos_token_ids=as_id_list(raw.get("eos_token_id")),
        name=name,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        partial_rotary_factor=partial,
        nope_layers=_nope_layers(raw, num_layers) if model_type == "smollm3" else (),
        # Gemma 3's local layers rotate with their own base, window or not; elsewhere
        # they differ from the others only by a window shorter than the context.
        local_layers=local_layers if gemma or sliding_window is not None else (),
        local_rope_theta=local_rope_theta,
        sliding_window=sliding_window,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
        final_logit_softcapping=(
            float(raw["final_logit_softcapping"])
            if gemma and raw.get("final_logit_softcapping") is not None
            else None
        ),
    )


def as_id_list(value: Any) -> list[int]:
    """A config's token id field (an int, a list or None) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _refuse_unimplemented(raw: dict[str, Any], model_type: str) -> None:
    for key in _MOE_KEYS:
        if raw.get(key):
            raise ValueError(f"mixture-of-experts models are not supported ({key}={raw[key]})")
    if model_type == "gemma3_text":
        activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"unsupported activation hidden_activation={activation!r} "
                "(Gemma 3 needs gelu_pytorch_tanh)"
            )
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise ValueError(f"Gemma 3 with {key}={raw[key]!r} is not supported")
    elif raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation hidden_act={raw['hidden_act']!r} (need silu)")


def _biases(raw: dict[str, Any], model_type: str) -> tuple[bool, bool, bool]:
    """(q/k/v biases, o_proj bias, MLP biases), as each architecture's HF modeling has them."""
    attention_bias = bool(raw.get("attention_bias", False))
    if model_type == "qwen2":
        return True, False, False
    if model_type == "phi3":
        return False, False, False
    if model_type in ("qwen3", "gemma3_text"):
        return attention_bias, attention_bias, False
    return attention_bias, attention_bias, bool(raw.get("mlp_bias", False))


def _sliding_window(
    raw: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it), or (None, ()) when every layer attends fully."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if model_type in ("qwen2", "qwen3", "smollm3") and not raw.get("use_sliding_window", False):
        return None, ()
    if model_type == "gemma3_text":
        if layer_types is None:  # older configs give the period of the pattern instead
            period = int(raw.get("sliding_window_pattern", 6))
            layer_types = [
                "sliding_attention" if (i + 1) % period else "full_attention"
                for i in range(num_layers)
            ]
        local = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        return (int(window) if window and local else None), local
    if not window:
        return None, ()
    if layer_types is not None:
        local = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        local = tuple(range(first, num_layers))
    elif model_type == "smollm3":
        local = _nope_layers(raw, num_layers)  # its NoPE layers are the windowed ones
    else:
        local = tuple(range(num_layers))
    return (int(window) if local else None), local


def _nope_layers(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without a rotary embedding: no_rope_layers[i] == 0 (1 = rope)."""
    uses_rope = raw.get("no_rope_layers")
    if uses_rope is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        uses_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(uses_rope) != num_layers:
        raise ValueError(
            f"no_rope_layers has {len(uses_rope)} entries for {num_layers} layers: {uses_rope}"
        )
    return tuple(i for i, rope in enumerate(uses_rope) if not rope)


def _rope(
    raw: dict[str, Any], model_type: str, used_len: int
) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling dict with a "rope_type" key or None, partial_rotary_factor) of
    the global layers, from either config style.

    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); older configs
    write `rope_theta` and `rope_scaling` (whose type key may be "type").
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        if model_type != "gemma3_text" or "full_attention" not in params:
            raise ValueError(f"per-layer-type rope parameters are not supported: {list(params)}")
        params = dict(params["full_attention"])
    default_theta = _DEFAULT_ROPE_THETA.get(model_type, 10000.0)
    rope_theta = float(params.pop("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0)
    if partial != 1.0 and model_type not in _PARTIAL_ROTARY:
        raise ValueError(
            f"partial rotary embeddings are not supported for {model_type} "
            f"(partial_rotary_factor={partial})"
        )
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's older names for it
    if rope_type == "default":
        return rope_theta, None, partial
    if rope_type == "longrope":
        if model_type not in _LONGROPE:
            raise ValueError(f"rope type 'longrope' is supported for phi3 only, not {model_type}")
        return rope_theta, _longrope(raw, params, used_len), partial
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
    # ModelConfig refuses the rope types our forward pass does not implement.
    return rope_theta, {"rope_type": rope_type, **params}, partial


def _longrope(raw: dict[str, Any], params: dict[str, Any], used_len: int) -> dict[str, Any]:
    """LongRoPE's factor set for the served context: "short" while it fits the original
    window, "long" beyond (see `models.phi3`), and its cos/sin scale, as Hugging Face
    computes them."""
    for key in ("short_factor", "long_factor"):
        if not params.get(key):
            raise ValueError(f"rope type 'longrope' needs {key} in the rope parameters")
    # Phi-3 keeps the pretraining length at the top level, which takes precedence.
    original_max = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or _DEFAULT_PHI3_ORIGINAL_MAX
    )
    factor = params.get("factor") or int(raw["max_position_embeddings"]) / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        )
    factors = params["long_factor"] if used_len > original_max else params["short_factor"]
    return {
        "rope_type": "longrope",
        "factors": [float(f) for f in factors],
        "attention_factor": float(attention_factor),
    }


def _gemma3_local_rope_theta(raw: dict[str, Any]) -> float:
    """The rope base of Gemma 3's sliding-window layers; their rope must be unscaled."""
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        rope_type = local.get("rope_type") or local.get("type") or "default"
        if rope_type != "default":
            raise ValueError(
                f"Gemma 3 local layers with rope type {rope_type!r} are not supported "
                "(only unscaled local rope)"
            )
        return float(local.get("rope_theta", _DEFAULT_LOCAL_ROPE_THETA))
    return float(raw.get("rope_local_base_freq", _DEFAULT_LOCAL_ROPE_THETA))
