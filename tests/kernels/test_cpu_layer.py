"""The compiled kernels for the ops between a layer's GEMMs, against the torch ops they
replace (`pagedinfer.service.models.llama`'s torch path)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.kernels import torch_ops
from pagedinfer.kernels.cpu import layer_ops
from pagedinfer.service.models.llama import apply_rotary


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    scale = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (x64 * scale * weight.double()).float()


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_matches_the_definition(tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    x[0] *= 1e3  # a row of large values: no overflow in the sum of squares
    weight = torch.rand(hidden, generator=gen) + 0.5
    out = layer_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_rms_norm_of_a_strided_input_reads_its_rows() -> None:
    x = torch.randn(4, 2 * 32)[:, ::2]  # every other column
    weight = torch.ones(32)
    out = layer_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_silu_mul_matches_torch_over_the_whole_range() -> None:
    gate = torch.cat(
        [
            torch.linspace(-100.0, 100.0, 2001),
            torch.tensor([-88.0, -87.0, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 88.0, 1e30]),
        ]
    )
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(0))
    gate_up = torch.cat([gate, up]).view(1, -1).repeat(3, 1)
    out = layer_ops.silu_mul(gate_up)
    expected = (F.silu(gate.double()) * up.double()).float().expand(3, -1)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-30)


def test_gelu_mul_matches_torch_over_the_whole_range() -> None:
    """Gemma 3's GeGLU: gelu (tanh approximation) of the gate times up, by the same kernel."""
    gate = torch.cat(
        [
            torch.linspace(-30.0, 30.0, 2001),
            torch.tensor([-1e4, -88.0, -10.0, -1e-3, -0.0, 0.0, 1e-3, 10.0, 88.0, 1e4]),
        ]
    )
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(0))
    gate_up = torch.cat([gate, up]).view(1, -1).repeat(3, 1)
    out = layer_ops.silu_mul(gate_up, gelu=True)
    # 0.5 * (1 + tanh(u)) = sigmoid(2u): in double without tanh's cancellation below -5,
    # where torch's formula loses every digit of the tiny results.
    g = gate.double()
    exact = g * torch.sigmoid(2 * (2 / math.pi) ** 0.5 * (g + 0.044715 * g**3)) * up.double()
    torch.testing.assert_close(out, exact.float().expand(3, -1), rtol=1e-5, atol=1e-30)
    torch_fp32 = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, torch_fp32.expand(3, -1), rtol=1e-5, atol=1e-6)
    assert not torch.equal(out, layer_ops.silu_mul(gate_up))


def test_silu_mul_propagates_nan() -> None:
    gate_up = torch.tensor([[float("nan"), 1.0, 1.0, float("nan")]])
    out = layer_ops.silu_mul(gate_up)
    assert torch.isnan(out).tolist() == [[True, True]]


def make_rope_batch(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv rows, their cos/sin rows, and NaN-filled caches of 8 blocks of 4 slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    cache = torch.full((8, 4, num_kv_heads, head_dim), float("nan"))
    return qkv, cos_sin, cache, cache.clone()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 128)]
)
def test_rope_write_kv_does_what_rotary_and_write_kv_do(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    qkv, cos_sin, k_cache, v_cache = make_rope_batch(5, num_heads, num_kv_heads, head_dim)
    slots = torch.tensor([3, 17, -1, 31, 0])  # -1: padding, not written
    # The torch path, on copies.
    expected_qkv = qkv.clone()
    qk = expected_qkv[:, : (num_heads + num_kv_heads) * head_dim].view(5, -1, head_dim)
    apply_rotary(qk, cos_sin)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    rows = k_cache.shape[0] * k_cache.shape[1]
    key = qk[:, num_heads:].reshape(5, -1)
    value = expected_qkv[:, (num_heads + num_kv_heads) * head_dim :]
    expected_k.view(rows, -1)[slots[keep]] = key[keep]
    expected_v.view(rows, -1)[slots[keep]] = value[keep]

    layer_ops.rope_write_kv(qkv, cos_sin, slots, k_cache, v_cache, num_heads)
    torch.testing.assert_close(qkv, expected_qkv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, expected_k, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    # Exactly the four slots were written; the rest still hold NaN.
    written = ~torch.isnan(k_cache.view(rows, -1)).any(-1)
    assert written.nonzero().flatten().tolist() == [0, 3, 17, 31]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 40), (8, 1, 128)])
def test_rope_write_kv_norms_each_q_and_k_head_before_rotating(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Qwen3's q/k norms: each query head RMS-normed with the q weight and each key head
    with the k weight (a head_dim of 40 has a rest past its 16-lane chunks), then rotated
    and written; v is left as it is."""
    qkv, cos_sin, k_cache, v_cache = make_rope_batch(3, num_heads, num_kv_heads, head_dim, 1)
    qkv[1] *= 50.0  # the norm, not the scale of the product, sets what is rotated
    gen = torch.Generator().manual_seed(2)
    weights = torch.rand(2, head_dim, generator=gen) + 0.5
    slots = torch.tensor([5, 0, 9])
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected = qkv.clone()
    q = expected[:, :q_size].view(3, num_heads, head_dim)
    k = expected[:, q_size : q_size + kv_size].view(3, num_kv_heads, head_dim)
    q.copy_(reference_rms_norm(q, weights[0], 1e-6))
    k.copy_(reference_rms_norm(k, weights[1], 1e-6))
    apply_rotary(expected[:, : q_size + kv_size].view(3, -1, head_dim), cos_sin)

    layer_ops.rope_write_kv(qkv, cos_sin, slots, k_cache, v_cache, num_heads, weights, 1e-6)
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    rows = k_cache.shape[0] * k_cache.shape[1]
    torch.testing.assert_close(
        k_cache.view(rows, -1)[slots], expected[:, q_size : q_size + kv_size]
    )
    assert torch.equal(v_cache.view(rows, -1)[slots], expected[:, q_size + kv_size :])


@pytest.mark.parametrize(("rotary_dim", "table"), [(0, 0), (16, 0), (32, 1), (64, 1)])
def test_rope_write_kv_rotates_the_leading_dims_the_layer_rotates_by_its_table(
    rotary_dim: int, table: int
) -> None:
    """NoPE (no dims), partial rotary (the first 16 or 32 of 64 dims) and a second cos/sin
    table (a local layer's rope): the dims past rotary_dim and v are left as they are."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    qkv, _, k_cache, v_cache = make_rope_batch(3, num_heads, num_kv_heads, head_dim, seed=3)
    angles = torch.rand(3, 2, 32, generator=torch.Generator().manual_seed(4)) * 100
    tables = torch.stack((angles.cos(), angles.sin()), dim=2).flatten(1, 2)  # [3, 4, 32]
    cos_sin = tables[:, 2 * table : 2 * table + 2, : rotary_dim // 2]
    slots = torch.tensor([2, 9, 30])
    q_and_k = (num_heads + num_kv_heads) * head_dim
    expected = qkv.clone()
    if rotary_dim:
        apply_rotary(expected[:, :q_and_k].view(3, -1, head_dim)[..., :rotary_dim], cos_sin)

    layer_ops.rope_write_kv(
        qkv, tables.contiguous(), slots, k_cache, v_cache, num_heads,
        rotary_dim=rotary_dim, table=table,
    )  # fmt: skip
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, q_and_k:], expected[:, q_and_k:])
    rows = k_cache.shape[0] * k_cache.shape[1]
    torch.testing.assert_close(
        k_cache.view(rows, -1)[slots],
        expected[:, num_heads * head_dim :][:, : num_kv_heads * head_dim],
    )
    assert torch.equal(v_cache.view(rows, -1)[slots], expected[:, q_and_k:])


@pytest.mark.parametrize(("rotary_dim", "table"), [(66, 0), (7, 0), (16, 2)])
def test_rope_write_kv_refuses_dims_or_a_table_its_arguments_do_not_hold(
    rotary_dim: int, table: int
) -> None:
    qkv, cos_sin, k_cache, v_cache = make_rope_batch(2, 2, 1, 64)
    with pytest.raises(ValueError, match=r"rotary_dim|table"):
        layer_ops.rope_write_kv(
            qkv, cos_sin, torch.tensor([0, 1]), k_cache, v_cache, 2,
            rotary_dim=rotary_dim, table=table,
        )  # fmt: skip


def test_rope_write_kv_rounds_into_a_bf16_cache_as_torch_does() -> None:
    qkv, cos_sin, k_cache, v_cache = make_rope_batch(5, 9, 3, 64, seed=2)
    # v (not rotated) of token 0: two ties, inf and -0; k of token 1: a NaN.
    qkv[0, 12 * 64 : 12 * 64 + 4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("inf"), -0.0])
    qkv[1, 9 * 64] = float("nan")
    slots = torch.tensor([3, 17, -1, 31, 0])
    fp32_qkv = qkv.clone()
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    layer_ops.rope_write_kv(qkv, cos_sin, slots, k16, v16, 9)
    layer_ops.rope_write_kv(fp32_qkv, cos_sin, slots, k_cache, v_cache, 9)
    assert torch.equal(qkv.view(torch.int32), fp32_qkv.view(torch.int32))  # q: fp32 still
    # Ties to even (1 + 2^-8 down, 1 + 3 * 2^-8 up), inf and -0 as torch rounds them; a
    # NaN stays a NaN (torch's own NaN bits differ between its scalar and vector code).
    for ours, fp32 in ((k16, k_cache), (v16, v_cache)):
        nan = fp32.isnan()
        assert torch.equal(ours.isnan(), nan)
        assert torch.equal(ours[~nan].view(torch.int16), fp32[~nan].bfloat16().view(torch.int16))
    written = v16[0, 3, 0, :4].view(torch.int16).tolist()  # token 0's slot 3
    assert [w & 0xFFFF for w in written] == [0x3F80, 0x3F82, 0x7F80, 0x8000]
    assert k16[4, 1, 0, 0].isnan()  # token 1's slot 17


def test_rope_write_kv_refuses_a_slot_past_the_cache() -> None:
    qkv, cos_sin, k_cache, v_cache = make_rope_batch(2, 2, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping: slot 32 of token 1"):
        layer_ops.rope_write_kv(qkv, cos_sin, torch.tensor([0, 32]), k_cache, v_cache, 2)


def test_rope_write_kv_refuses_a_strided_cache() -> None:
    qkv, cos_sin, k_cache, _ = make_rope_batch(2, 2, 2, 8)
    strided = k_cache.transpose(1, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        layer_ops.rope_write_kv(qkv, cos_sin, torch.tensor([0, 1]), strided, strided, 2)


def test_only_fp32_cpu_tensors_outside_autograd_are_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(2, 8)
    assert layer_ops.supports(x, x)
    assert not layer_ops.supports(x, x.bfloat16())
    assert not layer_ops.supports(x.clone().requires_grad_())
    monkeypatch.delenv("PAGEDINFER_CPU_KERNELS", raising=False)
    assert torch_ops.compiled_kernels()
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")
    assert not torch_ops.compiled_kernels()
