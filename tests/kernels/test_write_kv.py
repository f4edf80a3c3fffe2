"""write_kv: both backends store exactly what the reference stores, and nothing else."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from pagedinfer.kernels.reference import write_kv_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def nan_cache(block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (7, block_size, 3, 64)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(
        shape, float("nan"), dtype=dtype
    )


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_writes_slots_and_skips_padding(
    backend: ModuleType, block_size: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(block_size)
    num_slots = 7 * block_size
    num_tokens = min(20, num_slots)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::4] = -1  # padding tokens
    key = torch.randn(num_tokens, 3, 64, generator=generator).to(dtype)
    value = torch.randn(num_tokens, 3, 64, generator=generator).to(dtype)
    k_expected, v_expected = nan_cache(block_size, dtype)
    write_kv_reference(key, value, k_expected, v_expected, slots)

    k_cache, v_cache = (t.to(DEVICE) for t in nan_cache(block_size, dtype))
    backend.write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    # equal_nan: every slot not written must still hold its NaN.
    torch.testing.assert_close(k_cache.cpu(), k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_expected, atol=0, rtol=0, equal_nan=True)


def test_strided_key_value_from_a_fused_projection(backend: ModuleType) -> None:
    fused = torch.randn(10, 8, 64, device=DEVICE)
    key, value = fused[:, 2:5], fused[:, 5:8]
    slots = torch.tensor([3, 0, -1, 9, 40, 41, 17, -1, 22, 30], device=DEVICE)
    k_cache, v_cache = (t.to(DEVICE) for t in nan_cache(16, torch.float32))
    backend.write_kv(key, value, k_cache, v_cache, slots)
    k_expected, v_expected = nan_cache(16, torch.float32)
    write_kv_reference(key.cpu(), value.cpu(), k_expected, v_expected, slots.cpu())
    torch.testing.assert_close(k_cache.cpu(), k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_expected, atol=0, rtol=0, equal_nan=True)


def test_all_padding_and_no_tokens_write_nothing(backend: ModuleType) -> None:
    for num_tokens in (0, 3):
        k_cache, v_cache = (t.to(DEVICE) for t in nan_cache(16, torch.float32))
        key = torch.randn(num_tokens, 3, 64, device=DEVICE)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE)
        backend.write_kv(key, key, k_cache, v_cache, slots)
        assert k_cache.isnan().all() and v_cache.isnan().all()


def test_fp32_rows_round_into_a_bf16_cache_on_the_torch_path() -> None:
    # A model served with bf16 products writes fp32 K/V into a bf16 cache (CPU only).
    from pagedinfer import kernels
    from pagedinfer.kernels import torch_ops

    k_cache, v_cache = nan_cache(16, torch.bfloat16)
    key = torch.randn(4, 3, 64)
    value = torch.randn(4, 3, 64)
    slots = torch.tensor([5, -1, 40, 0])
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = nan_cache(16, torch.bfloat16)
    torch_ops.write_kv(key.bfloat16(), value.bfloat16(), expected_k, expected_v, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))
    fp32_k, fp32_v = nan_cache(16, torch.float32)
    with pytest.raises(ValueError, match=r"key: dtype torch\.bfloat16 != k_cache dtype"):
        kernels.write_kv(key.bfloat16(), value.bfloat16(), fp32_k, fp32_v, slots)
