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
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
# The tensor types of the GGUF files people download (Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0,
# Q4_0, IQ4_XS, BF16, F16: llama-quantize's file types are mixes of these; an IQ4_XS file
# keeps IQ4_NL where a row is not whole super-blocks).
DOWNLOADED_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ4_NL", "BF16", "F16")
# The ggml tensor types we refuse: the codebook i-quants (lattice grids of 256 to 2048
# entries), the ternary, 1- and 2-bit and FP4 types, the integer and f64 tensors no model
# file holds, and Q8_1 and Q8_K, ggml's intermediate formats for activations.
REFUSED_TYPES = {
    "Q1_0",
    "Q2_0",
    "NVFP4",
    "Q8_1",
    "Q8_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ1_S",
    "IQ1_M",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "I8",
    "I16",
    "I32",
    "I64",
    "F64",
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
    k_quant = type_name.endswith("_K") or type_name == "IQ4_XS"
    fine = type_name in ("Q2_K", "Q3_K", "Q6_K")
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
        "IQ4_NL": (-127, 113),  # the levels themselves
        "IQ4_XS": (-127, 113),
    }
    assert gguf_quants.block_grid(random_blocks("F16", 2, 64), "F16") is None


def test_q4_0_whose_offset_overflows_fp16_keeps_signed_codes() -> None:
    raw = random_blocks("Q4_0", 2, 2)
    raw[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # -8d: -inf in fp16
    grid = gguf_quants.block_grid(raw, "Q4_0")
    assert (grid.low, grid.high) == (-8, 7) and not grid.m.any()
    np.testing.assert_array_equal(grid.dense(), gguf_quants.dequantize(raw, "Q4_0"))


def test_a_tensor_of_an_unclaimed_type_is_refused_by_name() -> None:
    tensors = [("blk.0.attn_q.weight", "Q4_K"), ("blk.0.ffn_up.weight", "IQ2_XXS")]
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' has GGUF type IQ2_XXS") as err:
        gguf_quants.check_tensor_types(tensors, "model.gguf")
    assert "supported: F32, F16, BF16, Q4_0" in str(err.value)
    gguf_quants.check_tensor_types(tensors[:1], "model.gguf")


def test_the_downloaded_types_are_read_and_the_rest_refused() -> None:
    import gguf

    assert set(DOWNLOADED_TYPES) <= set(gguf_quants.SUPPORTED_TYPES)
    every = {t.name for t in gguf.GGMLQuantizationType}
    assert every - set(gguf_quants.SUPPORTED_TYPES) == REFUSED_TYPES & every
    for name in REFUSED_TYPES & every:
        with pytest.raises(ValueError, match=f"has GGUF type {name}, which pagedinfer"):
            gguf_quants.check_tensor_types([("blk.0.ffn_up.weight", name)], "model.gguf")


def iq4_xs_as_llama_cpp(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_iq4_xs, one value at a time in fp32: [blocks, 136] bytes
    as [blocks, 256]."""
    levels = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    out = np.empty((raw.shape[0], 256), dtype=np.float32)
    for i, block in enumerate(raw):
        d = np.float32(block[0:2].view(np.float16)[0])
        scales_h = int(block[2]) | int(block[3]) << 8
        for ib in range(8):
            ls = (int(block[4 + ib // 2]) >> 4 * (ib % 2)) & 15 | ((scales_h >> 2 * ib) & 3) << 4
            dl = np.float32(d * np.float32(ls - 32))
            for j in range(16):
                byte = int(block[8 + 16 * ib + j])
                out[i, 32 * ib + j] = dl * np.float32(levels[byte & 15])
                out[i, 32 * ib + j + 16] = dl * np.float32(levels[byte >> 4])
    return out


def test_iq4_xs_is_llama_cpps_dequantisation_value_by_value() -> None:
    raw = random_blocks("IQ4_XS", rows=3, blocks=2, seed=7)
    expected = iq4_xs_as_llama_cpp(raw.reshape(6, 136)).reshape(3, 512)
    assert_same_bits(gguf_quants.dequantize(raw, "IQ4_XS"), expected)


def test_iq4_xs_block_of_known_scales_and_levels() -> None:
    """d = 0.5; run r's 6-bit scale 33 + r, but 55 for run 7 (top bits 3, the others' 2);
    every byte of run r holds levels r (low nibble) and 15 - r (high nibble)."""
    block = np.zeros(136, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    scales = [33 + r for r in range(7)] + [55]
    block[2:4] = np.array([sum((s >> 4) << 2 * r for r, s in enumerate(scales))], np.uint16).view(
        np.uint8
    )
    for r, s in enumerate(scales):
        block[4 + r // 2] |= (s & 15) << 4 * (r % 2)
        block[8 + 16 * r : 24 + 16 * r] = r | (15 - r) << 4
    values = gguf_quants.dequantize(block[None], "IQ4_XS")[0].reshape(8, 2, 16)
    levels = gguf_quants.IQ4_LEVELS
    for r, s in enumerate(scales):
        dl = 0.5 * (s - 32)
        assert (values[r, 0] == dl * levels[r]).all(), r
        assert (values[r, 1] == dl * levels[15 - r]).all(), r


def test_iq4_nl_block_of_known_levels() -> None:
    block = np.zeros(18, dtype=np.uint8)
    block[0:2] = np.array([-0.25], dtype=np.float16).view(np.uint8)
    block[2:18] = np.arange(16, dtype=np.uint8) | (15 - np.arange(16, dtype=np.uint8)) << 4
    values = gguf_quants.dequantize(block[None], "IQ4_NL")[0]
    levels = gguf_quants.IQ4_LEVELS.astype(np.float32)
    np.testing.assert_array_equal(values, -0.25 * np.concatenate((levels, levels[::-1])))


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_super_block_types_keep_their_scales_as_the_file_does(type_name: str) -> None:
    """The fp16 scale per 256 values and the small integer per run, whose products are the
    grid's d and m to the bit; mins only where the type has offsets."""
    grid = gguf_quants.block_grid(random_blocks(type_name, rows=8, blocks=3, seed=4), type_name)
    assert grid is not None and grid.supers is not None
    supers = grid.supers
    assert supers.d.dtype == np.float16 and supers.d.shape == (8, 3)
    assert supers.scales.dtype == np.int8 and supers.scales.shape == grid.d.shape
    assert (supers.mins is not None) == (type_name in ("Q2_K", "Q4_K", "Q5_K"))
    d, m = supers.products()
    assert_same_bits(d, grid.d)
    if m is None:
        assert not grid.m.any()
    else:
        assert_same_bits(m, grid.m)
    fine = grid.fine()
    assert fine.supers is not None
    assert_same_bits(fine.supers.products()[0], fine.d)


def test_a_fused_weight_keeps_super_scales_only_where_every_part_has_them() -> None:
    """Q4_K beside Q6_K: runs of 16, Q6_K's mins zero; beside Q8_0: fp32 scales only."""
    q4, q6, q8 = (
        gguf_quants.block_grid(random_blocks(name, rows=4, blocks=n, seed=7), name)
        for name, n in (("Q4_K", 1), ("Q6_K", 1), ("Q8_0", 8))
    )
    whole = gguf_quants.concatenate([q4, q6])
    assert whole.supers is not None and whole.supers.mins is not None
    assert not whole.supers.mins[4:].any() and not whole.supers.dmin[4:].astype(bool).any()
    d, m = whole.supers.products()
    assert_same_bits(d, whole.d)
    np.testing.assert_array_equal(m, whole.m)
    assert gguf_quants.concatenate([q4, q8]).supers is None
