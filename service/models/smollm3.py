"""SmolLM3: the Llama decoder in which every few layers attend without a rotary
embedding (NoPE), which the config lists as `no_rope_layers` (0 = no rope).

    layer i:  q, k = rope(q), rope(k)   unless i is a NoPE layer: q, k as projected

Which layers skip the rotation is the config's `nope_layers`, read by `Attention`.
"""

from __future__ import annotations

from pagedinfer.service.models.llama import LlamaModel


class SmolLM3Model(LlamaModel):
    """A SmolLM3 decoder over a flat token batch with a paged KV cache."""
