"""The architecture facts a forward pass needs (`ModelConfig`), whatever checkpoint they
came from, and the names of the features they switch on (`FEATURES`).

A backend lists the features it implements and serves only configs whose `features()` it
has all; everything else runs on the model's own torch forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Every architecture feature this model layer implements, by name.
FEATURES = (
    "rms_norm",  # pre-norm RMSNorm (x * weight) before attention and MLP, and at the end
    "silu_glu",  # MLP down(silu(gate(x)) * up(x))
    "rope_neox",  # rotary embedding, neox pairing (the two halves of the rotated dims)
    "rope_scaling_linear",
    "rope_scaling_dynamic",
    "rope_scaling_llama3",
    "rope_scaling_yarn",
    "rope_scaling_longrope",  # per-frequency divisors and a cos/sin scale (Phi-3)
    "partial_rotary",  # only the first dims of each head rotate (Phi-3/Phi-4-mini)
    "no_rope_layers",  # some layers' attention has no positional embedding (SmolLM3)
    "local_layer_rope",  # sliding-window layers rotate with their own base (Gemma 3)
    "sliding_window",  # local_layers attend to the last sliding_window positions only
    "grouped_query_attention",  # fewer KV heads than query heads
    "qkv_bias",
    "o_proj_bias",
    "mlp_bias",
    "qk_norm",  # RMSNorm of each query and key head before the rotation (Qwen3, Gemma 3)
    "query_pre_attn_scalar",  # attention scale query_pre_attn_scalar**-0.5 (Gemma 3)
    "gemma_rms_norm",  # RMSNorm scaled by (1 + weight)
    "gelu_tanh_glu",  # MLP down(gelu_tanh(gate(x)) * up(x))
    "scaled_embeddings",  # token embeddings times sqrt(hidden_size)
    "sandwich_norms",  # norms after attention and MLP too, before the residual add
    "final_logit_softcapping",  # logits = cap * tanh(logits / cap)
    "tied_embeddings",  # the LM head reads the token embeddings
    "untied_lm_head",
)

# The structure each architecture's module builds, whatever the config's options.
ARCHITECTURE_FEATURES: dict[str, frozenset[str]] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3"),
        frozenset({"rms_norm", "silu_glu"}),
    ),
    "gemma3": frozenset({"gemma_rms_norm", "gelu_tanh_glu", "scaled_embeddings", "sandwich_norms"}),
}


@dataclass
class ModelConfig:
    """The architecture facts our forward pass needs, whatever checkpoint they came from."""

    architecture: str  # a key of ARCHITECTURE_FEATURES (and of models.MODEL_CLASSES)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # need not be hidden_size / num_heads (Qwen3, Gemma 3)
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # None, or a dict with "rope_type" and that type's Hugging Face parameters; for
    # "longrope", "factors" (the checkpoint's short or long factors, which the loader
    # picks for the served context length) and "attention_factor".
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2; Llama with attention_bias)
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    qk_norm: bool = False
    partial_rotary_factor: float = 1.0  # the fraction of each head's dims that rotate
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary embedding
    local_layers: tuple[int, ...] = ()  # sliding-window (local) layers: Gemma 3's
    local_rope_theta: float | None = None  # rope base of local_layers (None: rope_theta)
    # The window of local_layers: position p attends to p - W < k <= p. None: they attend
    # fully (a window no shorter than the served context changes nothing).
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None  # None: scale queries by head_dim**-0.5
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURE_FEATURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r} "
                f"(known: {', '.join(ARCHITECTURE_FEATURES)})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim % 2 != 0:
            raise ValueError(
                f"the rotated dims of each head must be even for rotary embeddings, got "
                f"{self.rotary_dim} (head_dim={self.head_dim}, "
                f"partial_rotary_factor={self.partial_rotary_factor})"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
            or not self.local_layers
        ):
            raise ValueError(
                f"sliding_window must be a positive int for some local_layers, got "
                f"{self.sliding_window!r} for local_layers {self.local_layers}"
            )
        for name in ("nope_layers", "local_layers"):
            layers = getattr(self, name)
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"{name} {layers} name layers outside 0..{self.num_layers - 1}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "longrope":
            factors = self.rope_scaling.get("factors") if self.rope_scaling else None
            if factors is None or len(factors) != self.rotary_dim // 2:
                raise ValueError(
                    f"longrope needs {self.rotary_dim // 2} 'factors' (one per rotated "
                    f"frequency), got {factors!r}"
                )

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each query and key head rotate."""
        return int(self.head_dim * self.partial_rotary_factor)

    def features(self) -> frozenset[str]:
        """The architecture features (`FEATURES`) a forward pass of this config uses."""
        used = set(ARCHITECTURE_FEATURES[self.architecture])
        if len(self.nope_layers) < self.num_layers:
            used.add("rope_neox")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type != "default":
            used.add(f"rope_scaling_{rope_type}")
        if self.num_kv_heads < self.num_heads:
            used.add("grouped_query_attention")
        for flag, name in (
            (self.attention_bias, "qkv_bias"),
            (self.o_proj_bias, "o_proj_bias"),
            (self.mlp_bias, "mlp_bias"),
            (self.qk_norm, "qk_norm"),
            (self.rotary_dim < self.head_dim, "partial_rotary"),
            (bool(self.nope_layers), "no_rope_layers"),
            (bool(self.local_layers) and self.local_rope_theta is not None, "local_layer_rope"),
            (self.sliding_window is not None, "sliding_window"),
            (self.query_pre_attn_scalar is not None, "query_pre_attn_scalar"),
            (self.final_logit_softcapping is not None, "final_logit_softcapping"),
        ):
            if flag:
                used.add(name)
        used.add("tied_embeddings" if self.tie_word_embeddings else "untied_lm_head")
        return frozenset(used)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends fully."""
        return self.sliding_window if layer in self.local_layers else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer has, or None where some layer attends fully: the KV
        behind it is never read again, so its blocks can be freed as it slides."""
        if self.sliding_window is not None and len(set(self.local_layers)) == self.num_layers:
            return self.sliding_window
        return None

    def rope_of(self, local: bool = False) -> tuple[float, dict[str, Any] | None]:
        """(rope base, scaling) of the global layers, or of the local ones: those may have
        their own base, unscaled."""
        if local and self.local_rope_theta is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling
