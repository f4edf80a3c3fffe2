"""Phi-3 and Phi-4-mini: the Llama decoder with the checkpoint's fused projections, a
rotary embedding of only the first dims of each head where the config asks for it, and
LongRoPE.

    q, k, v = split(qkv_proj(rms_norm(h)))          # one tensor in the checkpoint too
    q[..., :r], k[..., :r] = rope(q[..., :r]), rope(k[..., :r])
                                                    # r = head_dim * partial_rotary_factor
    mlp(x) = down(silu(gate) * up), gate, up = split(gate_up_proj(x))

LongRoPE divides each rotated frequency by its own factor and scales cos and sin by an
attention factor (`layers.rope_inv_freq`). The checkpoint carries two factor sets:
"short" for contexts up to original_max_position_embeddings, "long" beyond. Hugging
Face switches sets with the running length, which re-rotates nothing already cached; we
pick one set per served context length instead (the loader: short when max_model_len
fits the original window, long otherwise), so that a token's rotation never depends on
what else is batched or on how long its sequence will grow.
"""

from __future__ import annotations

from pagedinfer.service.models.llama import LlamaModel


class Phi3Model(LlamaModel):
    """A Phi-3 decoder over a flat token batch with a paged KV cache."""
