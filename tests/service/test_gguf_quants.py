"""GGUF tensor types: our dequantisation gives gguf-py's values bit for bit on random valid
blocks of every type we claim; every quantised type's grid gives the same values; any
other type is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer.service import gguf_quants

# Where each type keeps its fp16 fields (d, and dmin or m): the rest of a block is codes
# and scales, valid whatever their bits.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, blocks * block bytes]: random codes and scales, finite fp16 fields."""
    rng = np.random.default_rng(seed)
    fmt = gguf_quants.FORMATS[type_name]
    if fmt.values == 1:  # plain floats of the type's width, all finite
        values = rng.normal(scale=3.0, size=(rows, blocks)).astype(np.float32)
        if type_name == "F16":
            return values.astype(np.float16).view(np.uint8)
        if type_name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    raw = rng.integers(0, 256, (rows, blocks, fmt.nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        # Across fp16's range, signs included, zero and subnormals too.
        field = rng.normal(size=(rows, blocks)) * 2.0 ** rng.integers(-26, 12, (rows, blocks))
        field[:, 0] = 0.0
        raw[:, :, offset : offset + 2] = (
            field.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
        )
    return raw.reshape(rows, blocks * fmt.nbytes)


def gguf_py(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


def assert_same_bits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_the_claimed_types_have_gguf_pys_block_sizes() -> None:
    import gguf

    for name, fmt in gguf_quants.FORMATS.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.values, fmt.nbytes), name


@pytest.mark.parametrize("type_name", gguf_quants.SUPPORTED_TYPES)
def test_dequantisation_matches_gguf_py_bit_for_bit(type_name: str) -> None:
    raw = random_blocks(type_name, rows=24, blocks=8)
    ours = gguf_quants.dequantize(raw, type_name)
    assert ours.shape == (24, 8 * gguf_quants.FORMATS[type_name].values)
    assert_same_bits(ours, gguf_py(raw, type_name))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"])
def test_dequantisation_of_gguf_pys_quantisation(type_name: str) -> None:
    import gguf

    weights = np.random.default_rng(1).normal(size=(16, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(16, -1)
    assert_same_bits(gguf_quants.dequantize(raw, type_name), gguf_py(raw, type_name))


@pytest.mark.parametrize("type_name", gguf_quants.GRID_TYPES)
def test_grid_types_are_their_dequantisation_on_a_grid(type_name: str) -> None:
    raw = random_blocks(type_name, rows=16, blocks=4, seed=2)
    grid = gguf_quants.block_grid(raw, type_name)
    values = 4 * gguf_quants.FORMATS[type_name].values
    k_quant, fine = type_name.endswith("_K"), type_name in ("Q2_K", "Q3_K", "Q6_K")
    runs = values // 16 if fine else values // 32
    scale_type = np.float32 if k_quant else np.float16
    assert grid is not None and grid.codes.shape == (16, values)
    assert grid.d.shape == grid.m.shape == (16, runs) and grid.d.dtype == scale_type
    assert grid.low <= grid.codes.min() and grid.codes.max() <= grid.high
    # Values equal (a zero's sign aside: d * (q - 8) at q = 8 is -0.0 for a negative d).
    np.testing.assert_array_equal(grid.dense(), gguf_quants.dequantize(raw, type_name))
    # As fp32(d * q) + m with one rounding, as the kernels rebuild it.
    d = np.repeat(grid.d.astype(np.float32), grid.group, axis=1)
    m = np.repeat(grid.m.astype(np.float32), grid.group, axis=1)
    exact = grid.codes.astype(np.float64) * d.astype(np.float64)
    assert (exact.astype(np.float32) == exact).all()
    np.testing.assert_array_equal(
        (exact + m).astype(np.float32), gguf_quants.dequantize(raw, type_name)
    )
    # The fine form (fp32 per run of 16) holds the same weights.
    np.testing.assert_array_equal(grid.fine().dense(), grid.dense())
    assert grid.fine().group == 16 and grid.fine().d.dtype == np.float32


def test_parts_of_different_types_concatenate_as_fine_grids() -> None:
    """A fused weight whose parts are Q5_0 (fp16 per 32) and Q6_K (fp32 per 16)."""
    parts = [("Q5_0", 8), ("Q6_K", 1)]  # 256 values a row each
    raws = [random_blocks(name, rows=16, blocks=blocks, seed=5) for name, blocks in parts]
    grids = [gguf_quants.block_grid(raw, name) for raw, (name, _) in zip(raws, parts, strict=True)]
    whole = gguf_quants.concatenate(grids)
    assert whole.group == 16 and whole.d.dtype == np.float32
    assert (whole.low, whole.high) == (-32, 31)
    expected = np.concatenate(
        [gguf_quants.dequantize(r, n) for r, (n, _) in zip(raws, parts, strict=True)]
    )
    np.testing.assert_array_equal(whole.dense(), expected)


def test_parts_with_the_same_runs_concatenate_with_fp32_scales() -> None:
    """A fused weight whose parts are Q4_K (fp32 per 32) and Q8_0 (fp16 per 32): runs of
    32 kept, fp16 scales widened exactly, not made fine."""
    parts = [("Q4_K", 1), ("Q8_0", 8)]  # 256 values a row each
    raws = [random_blocks(name, rows=16, blocks=blocks, seed=6) for name, blocks in parts]
    grids = [gguf_quants.block_grid(raw, name) for raw, (name, _) in zip(raws, parts, strict=True)]
    whole = gguf_quants.concatenate(grids)
    assert whole.group == 32 and whole.d.dtype == np.float32
    expected = np.concatenate(
        [gguf_quants.dequantize(r, n) for r, (n, _) in zip(raws, parts, strict=True)]
    )
    np.testing.assert_array_equal(whole.dense(), expected)


def test_grid_ranges_per_type() -> None:
    ranges = {
        name: (g.low, g.high)
        for name in gguf_quants.GRID_TYPES
        if (g := gguf_quants.block_grid(random_blocks(name, 2, 1), name)) is not None
    }
    assert ranges == {
        "Q4_0": (0, 15),  # m = -8d
        "Q4_1": (0, 15),
        "Q5_0": (-16, 15),
        "Q5_1": (0, 31),
        "Q8_0": (-128, 127),
        "Q2_K": (0, 3),
        "Q3_K": (-4, 3),
        "Q4_K": (0, 15),
        "Q5_K": (0, 31),
        "Q6_K": (-32, 31),
    }
    assert gguf_quants.block_grid(random_blocks("F16", 2, 64), "F16") is None


def test_q4_0_whose_offset_overflows_fp16_keeps_signed_codes() -> None:
    raw = random_blocks("Q4_0", 2, 2)
    raw[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # -8d: -inf in fp16
    grid = gguf_quants.block_grid(raw, "Q4_0")
    assert (grid.low, grid.high) == (-8, 7) and not grid.m.any()
    np.testing.assert_array_equal(grid.dense(), gguf_quants.dequantize(raw, "Q4_0"))


def test_a_tensor_of_an_unclaimed_type_is_refused_by_name() -> None:
    tensors = [("blk.0.attn_q.weight", "Q4_K"), ("blk.0.ffn_up.weight", "IQ4_NL")]
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' has GGUF type IQ4_NL") as err:
        gguf_quants.check_tensor_types(tensors, "model.gguf")
    assert "supported: F32, F16, BF16, Q4_0" in str(err.value)
    gguf_quants.check_tensor_types(tensors[:1], "model.gguf")
