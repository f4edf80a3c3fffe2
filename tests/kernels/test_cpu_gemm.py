"""GEMMs from weights kept on their quantisation grid: the grid is found exactly, and
every product carries the bits of its sum order (the one fixed order the executor uses),
whatever the number of rows; the executor's GEMM objects compute x @ W.T (+ bias)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba", reason="the grid GEMM is compiled with numba")

from threads import torch_threads

from pagedinfer.kernels.cpu import gemms, grid_gemm


def affine4_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as a Q4_1 model dequantises: fp32(d * q) + m per run of 32 inputs, with
    d and m fp16 values and q in 0..15."""
    rng = np.random.default_rng(seed)
    blocks = (out_features, in_features // 32, 1)
    d = (rng.random(blocks) * 0.01 + 1e-4).astype(np.float16).astype(np.float32)
    m = (-rng.random(blocks) * 0.08).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (out_features, in_features // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15  # as quantising does: the block's least and largest values
    w = (d * q).astype(np.float32) + m
    return torch.from_numpy(w.reshape(out_features, in_features))


def scaled8_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as a Q8_0 model dequantises: fp32(d * q) with q in -127..127."""
    rng = np.random.default_rng(seed)
    d = (rng.random((out_features, in_features // 32, 1)) * 0.01 + 1e-4).astype(np.float16)
    q = rng.integers(-127, 128, (out_features, in_features // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    w = (d.astype(np.float32) * q).astype(np.float32)
    return torch.from_numpy(w.reshape(out_features, in_features))


def k_quant_blocks(
    out_features: int, in_features: int, low: int, high: int, run: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight as a GGUF K-quant holds it: codes int8 [out, in] in low..high and fp32 d
    and m per `run` inputs, each an fp16 times a small integer (exact in fp32, not fp16)."""
    rng = np.random.default_rng(seed)
    runs = (out_features, in_features // run)
    d16 = (rng.random(runs) * 1e-3 + 1e-5).astype(np.float16).astype(np.float32)
    d = d16 * rng.integers(1, 64, runs).astype(np.float32)
    m = -(d16 * rng.integers(0, 64, runs).astype(np.float32))
    codes = rng.integers(low, high + 1, (out_features, in_features)).astype(np.int8)
    return codes, d, m


def k_quant_weight(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """fp32(d * q) + m per run, as the dequantisation computes it."""
    q = codes.astype(np.float32).reshape(codes.shape[0], d.shape[1], -1)
    w = (d[:, :, None] * q).astype(np.float32) + m[:, :, None]
    return torch.from_numpy(w.reshape(codes.shape))


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32(a * b + c) rounded once, as a fused multiply-add gives it (fp32 arrays).

    a * b is exact in fp64 (48 significant bits); the sum with c is taken exactly as a
    rounded sum and its error (TwoSum), then rounded to odd in fp64: of the two doubles
    around the exact value, the one with an odd last bit. With 53 >= 24 + 2 bits, the
    one rounding of that to fp32 is the correct rounding of the exact value."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    shifted = s - c
    error = (p - shifted) + (c - (s - shifted))
    even = (s.view(np.int64) & 1) == 0
    towards = np.where(error > 0, np.inf, -np.inf)
    s = np.where((error != 0) & even, np.nextafter(s, towards), s)
    return s.astype(np.float32)


def emulate(weight: torch.Tensor, x: torch.Tensor, order: grid_gemm.SumOrder) -> torch.Tensor:
    """x @ weight.T summed in `order`, in numpy, every step rounded to fp32: each part one
    chain from 0 over its inputs in K order (fused multiply-adds, or a rounded product
    then a rounded add), then the parts added in order."""
    w, xs = weight.numpy(), x.numpy()
    total = np.zeros((xs.shape[0], w.shape[0]), dtype=np.float32)
    start = 0
    for end in order.ends:
        acc = np.zeros_like(total)
        for i in range(start, end):
            xi, wi = xs[:, i, None], w[None, :, i]
            acc = fma32(xi, wi, acc) if order.fused else acc + xi * wi
        total = total + acc
        start = end
    return torch.from_numpy(total)


def test_the_emulated_fma_rounds_once() -> None:
    """Cases where rounding the product first, or the sum in fp64, gives other bits."""
    x = 1 + 2.0**-12  # x * x = 1 + 2^-11 + 2^-24: a tie in fp32
    a = np.array([x, x, 1], dtype=np.float32)
    b = np.array([x, x, 2.0**-24], dtype=np.float32)
    c = np.array([-(1 + 2.0**-11), 2.0**-60, 1], dtype=np.float32)
    # The product's last bit, lost when it is rounded first; a tie broken by a tiny
    # addend (up), which the sum in fp64 rounds away (the tie then goes to even); 1 plus
    # half an ulp, a tie, to even.
    expected = np.array([2.0**-24, 1 + 2.0**-11 + 2.0**-23, 1], dtype=np.float32)
    assert np.array_equal(fma32(a, b, c), expected)
    rounded_product = a * b + c
    assert not np.array_equal(rounded_product[:2], expected[:2])
    sum_in_fp64 = (a.astype(np.float64) * b + c).astype(np.float32)
    assert sum_in_fp64[1] != expected[1]


def test_the_4_bit_grid_is_found_and_holds_every_value() -> None:
    weight = affine4_weight(128, 576)
    grid = grid_gemm.to_grid(weight)
    assert grid is not None and grid.kind == grid_gemm.AFFINE4
    assert torch.equal(grid.dense(), weight)
    assert grid.nbytes * 6 < weight.numel() * 4  # about 5 bits a weight in place of 32


def test_the_8_bit_grid_is_found_and_holds_every_value() -> None:
    weight = scaled8_weight(192, 576)
    grid = grid_gemm.to_grid(weight)
    assert grid is not None and grid.kind == grid_gemm.SCALED8
    assert torch.equal(grid.dense(), weight)


def test_a_transposed_view_is_read_as_the_weight_it_shows() -> None:
    weight = affine4_weight(64, 256, seed=4)
    stored = weight.t().contiguous()  # [in, out] storage, read through a transposed view
    grid = grid_gemm.to_grid(stored.t())
    assert grid is not None and torch.equal(grid.dense(), weight)


def test_weights_off_every_grid_have_none() -> None:
    nudged = affine4_weight(64, 256)
    nudged[5, 77] = torch.nextafter(nudged[5, 77], torch.tensor(1.0))
    with_nan = affine4_weight(64, 256)
    with_nan[0, 0] = float("nan")
    assert grid_gemm.to_grid(torch.randn(64, 256)) is None
    assert grid_gemm.to_grid(nudged) is None
    assert grid_gemm.to_grid(with_nan) is None
    assert grid_gemm.to_grid(affine4_weight(48, 256)) is None  # 3 tiles: not whole groups
    assert grid_gemm.to_grid(affine4_weight(64, 256).double()) is None


def test_the_fixed_order_is_one_fused_chain() -> None:
    assert grid_gemm.fixed_order(576) == grid_gemm.SumOrder((576,), True)


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (affine4_weight, (960, 576)),
        (affine4_weight, (576, 1536)),
        (affine4_weight, (576, 256)),
        (scaled8_weight, (512, 576)),
    ],
    ids=["qkv", "down", "small", "lm-head"],
)
def test_every_row_carries_the_bits_of_the_fixed_order_in_a_call_of_any_size(make, shape) -> None:
    """A row's product is the same in a call of any size, one pass over the weight (up to
    MAX_ROWS rows) or over tiles rebuilt into scratch (more), and those are the bits of
    one fused chain over K; close to the exact product."""
    weight = make(*shape)
    grid = grid_gemm.to_grid(weight)
    assert grid is not None
    order = grid_gemm.fixed_order(shape[1])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(grid_gemm.GRID_MAX_ROWS + 9, shape[1], generator=generator)
    whole = grid_gemm.grid_linear(x, grid, order)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, grid_gemm.GRID_MAX_ROWS):
        assert torch.equal(grid_gemm.grid_linear(x[-rows:], grid, order), whole[-rows:]), rows
    # The emulation of the first rows (a full pass of SCRATCH_ROWS) and the last 17.
    checked = torch.cat((x[:7], x[-17:]))
    expected = emulate(weight, checked, order)
    assert torch.equal(torch.cat((whole[:7], whole[-17:])), expected)
    exact = (checked.double() @ weight.double().t()).float()
    torch.testing.assert_close(expected, exact, rtol=1e-4, atol=1e-4)


def test_any_fp32_weight_in_tile_layout_carries_the_bits_of_the_fixed_order() -> None:
    """A weight on no grid, held as already-rebuilt fp32 tiles (`rebuilt`), runs the same
    kernels, in one pass over the weight and over scratch: the bits of one fused chain."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(192, 256, generator=generator)
    tiles = grid_gemm.rebuilt(weight)
    assert tiles is not None and tiles.kind == grid_gemm.REBUILT
    assert grid_gemm.rebuilt(torch.randn(48, 256)) is None  # 3 tiles: not whole groups
    assert grid_gemm.rebuilt(weight.double()) is None
    order = grid_gemm.fixed_order(256)
    x = torch.randn(2 * grid_gemm.IN_PLACE_ROWS + 1, 256, generator=generator)
    expected = emulate(weight, x, order)
    in_place = grid_gemm.IN_PLACE_ROWS
    for rows in (1, grid_gemm.WIDE_ROWS + 1, grid_gemm.MAX_ROWS, in_place, in_place + 1, len(x)):
        assert torch.equal(grid_gemm.grid_linear(x[:rows], tiles, order), expected[:rows]), rows


@pytest.mark.parametrize(
    ("low", "high", "run", "kind"),
    [
        (-32, 31, 16, grid_gemm.FINE6 if grid_gemm.SIX_BIT_CODES else grid_gemm.FINE8),  # Q6_K
        (-128, 127, 16, grid_gemm.FINE8),  # Q6_K beside Q8_0 in one weight
        (0, 15, 32, grid_gemm.AFFINE4),  # Q4_K
        (0, 31, 32, grid_gemm.SCALED8),  # Q5_K
    ],
    ids=["q6_k", "fine8", "q4_k", "q5_k"],
)
def test_a_k_quant_weight_runs_from_its_grid_in_the_bits_of_the_fixed_order(
    low, high, run, kind
) -> None:
    """Codes with fp32 scales and offsets per run of 16 (FINE8, FINE6) or 32 (4-bit or 8-bit codes
    with fp32 scales): the grid holds the weight, and every call size (one pass, scratch)
    gives the bits of one fused chain over K."""
    codes, d, m = k_quant_blocks(192, 512, low, high, run, seed=4)
    weight = k_quant_weight(codes, d, m)
    grid = grid_gemm.from_codes(codes, d, m, low, high)
    assert grid is not None and grid.kind == kind
    assert grid.scales.dtype == np.float32 and grid.scales.shape == (12, 512 // run, 2, 16)
    assert grid_gemm.holds(grid, weight) and torch.equal(grid.dense(), weight)
    off = weight.clone()
    off[5, 17] = torch.nextafter(off[5, 17], torch.tensor(1.0))
    assert not grid_gemm.holds(grid, off)
    assert grid_gemm.from_codes(codes, d[:, ::4].copy(), m[:, ::4].copy(), low, high) is None
    order = grid_gemm.fixed_order(512)
    x = torch.randn(grid_gemm.MAX_ROWS + 13, 512, generator=torch.Generator().manual_seed(6))
    expected = emulate(weight, x, order)
    for rows in (1, grid_gemm.WIDE_ROWS + 1, grid_gemm.MAX_ROWS, len(x)):
        assert torch.equal(grid_gemm.grid_linear(x[:rows], grid, order), expected[:rows]), rows


@pytest.mark.parametrize("make", [affine4_weight, scaled8_weight])
def test_a_grid_made_fine_gives_the_same_products(make) -> None:
    """`fine` turns a 4-bit or 8-bit grid into FINE8 holding the same weights: the same
    bits from every path; `one_kind` makes a position's 4-bit and 8-bit grids all 8-bit
    with fp32 scales (the same bits again), and all fine where one is."""
    weight = make(256, 576, seed=8)
    grid = grid_gemm.to_grid(weight)
    fine = grid_gemm.fine(grid)
    assert fine.kind == grid_gemm.FINE8 and torch.equal(fine.dense(), weight)
    assert grid_gemm.holds(fine, weight)
    order = grid_gemm.fixed_order(576)
    x = torch.randn(grid_gemm.MAX_ROWS + 5, 576, generator=torch.Generator().manual_seed(1))
    for rows in (2, len(x)):
        assert torch.equal(
            grid_gemm.grid_linear(x[:rows], fine, order),
            grid_gemm.grid_linear(x[:rows], grid, order),
        )
    other = grid_gemm.to_grid(
        scaled8_weight(256, 576) if make is affine4_weight else affine4_weight(256, 576)
    )
    assert grid_gemm.one_kind([grid, grid]) == [grid, grid]
    mixed = grid_gemm.one_kind([grid, other])
    assert [(g.kind, g.scales.dtype) for g in mixed] == [(grid_gemm.SCALED8, np.float32)] * 2
    assert torch.equal(mixed[0].dense(), weight)
    for rows in (1, len(x)):
        assert torch.equal(
            grid_gemm.grid_linear(x[:rows], mixed[0], order),
            grid_gemm.grid_linear(x[:rows], grid, order),
        )
    assert [g.kind for g in grid_gemm.one_kind([grid, fine])] == [grid_gemm.FINE8] * 2
    assert grid_gemm.one_kind([grid, grid_gemm.rebuilt(weight)]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoints_weight_runs_from_its_16_bits(dtype) -> None:
    """An fp32 weight whose every value is a bf16 (fp16) is held in those 16 bits and runs
    the bits of the fp32 tiles in every call size; one value off that type keeps fp32."""
    generator = torch.Generator().manual_seed(12)
    weight = (torch.randn(192, 256, generator=generator) * 0.05).to(dtype).float()
    kind = grid_gemm.narrowest(weight)
    assert kind == (grid_gemm.BF16 if dtype == torch.bfloat16 else grid_gemm.FP16)
    narrow, full = grid_gemm.rebuilt(weight, kind), grid_gemm.rebuilt(weight)
    assert narrow.codes.dtype == np.uint16 and narrow.nbytes < full.nbytes / 1.9
    assert torch.equal(narrow.dense(), weight)
    order = grid_gemm.fixed_order(256)
    x = torch.randn(grid_gemm.MAX_ROWS + 13, 256, generator=generator)
    for rows in (1, grid_gemm.WIDE_ROWS + 1, grid_gemm.MAX_ROWS, len(x)):
        assert torch.equal(
            grid_gemm.grid_linear(x[:rows], narrow, order),
            grid_gemm.grid_linear(x[:rows], full, order),
        ), rows
    off = weight.clone()
    off[7, 3] = torch.nextafter(off[7, 3], torch.tensor(1.0))
    assert grid_gemm.narrowest(off) == grid_gemm.REBUILT


def emulate_bf16_pairs(weight: torch.Tensor, x: torch.Tensor, order: grid_gemm.SumOrder):
    """x @ weight.T as a BF16_DOT GEMM computes it: both rounded to bf16, and in each part
    of the order each pair of inputs' products added to the chain, input 2p + 1's first
    (bf16 products are exact in fp32, so each step is one rounded fp32 add)."""
    w = weight.bfloat16().float().numpy()
    xs = x.bfloat16().float().numpy()
    total = np.zeros((xs.shape[0], w.shape[0]), dtype=np.float32)
    start = 0
    for end in order.ends:
        acc = np.zeros_like(total)
        for i in range(start, end, 2):
            for j in (i + 1, i):
                acc = acc + xs[:, j, None] * w[None, :, j]
        total = total + acc
        start = end
    return torch.from_numpy(total)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_products_sum_each_pair_into_the_chain(threads) -> None:
    """BF16_DOT: the weight rounded to bf16 and kept in pairs of inputs, each row rounded
    to bf16 (to nearest, ties to even) as the call starts, and two products a step in the
    order; every row the same bits whatever the call's size and the workers. (On AMX
    tiles the unit sums in its own order: `test_cpu_amx_gemm`.)"""
    if grid_gemm.amx_tiles():
        pytest.skip("BF16_DOT weights multiply on AMX tiles on this CPU")
    generator = torch.Generator().manual_seed(21)
    weight = torch.randn(576, 256, generator=generator) * 0.05
    paired = grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT)
    assert paired.codes.dtype == np.uint32 and paired.codes.shape == (36, 128, 16)
    assert torch.equal(paired.dense(), weight.bfloat16().float())
    order = grid_gemm.SumOrder((128, 256), True)
    x = torch.randn(max(SHARED_ROWS), 256, generator=generator)
    x[0, :4] = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, float("inf"), -0.0])  # ties
    expected = emulate_bf16_pairs(weight, x, order)
    with torch_threads(threads):
        for rows in SHARED_ROWS:
            product = grid_gemm.grid_linear(x[:rows], paired, order)
            if grid_gemm.NATIVE_BF16_DOT:  # vdpbf16ps flushes denormals: none arise here
                assert torch.equal(product[1:], expected[1:rows]), rows
                assert torch.equal(product[0].isinf(), expected[0].isinf())
            else:
                assert torch.equal(product, expected[:rows]), rows


def test_bf16_pairs_round_as_torch_rounds() -> None:
    """The rows' rounding to bf16: to nearest, ties to even, infinities and NaNs kept."""
    edges = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-9), 3.4e38, float("inf"), -0.0, 1e-40]
    values = torch.tensor([*edges, float("nan"), 0.1, 0.3]).reshape(1, -1)
    packed = np.empty((1, values.shape[1] // 2), dtype=np.int32)
    grid_gemm.bf16_pairs(values.numpy(), packed)
    halves = np.stack((packed & 0xFFFF, (packed >> 16) & 0xFFFF), axis=-1).reshape(1, -1)
    ours = torch.from_numpy(halves.astype(np.int16)).view(torch.bfloat16)
    theirs = values.bfloat16()
    assert torch.equal(ours.isnan(), theirs.isnan())
    keep = ~theirs.isnan()
    assert torch.equal(ours[keep].view(torch.int16), theirs[keep].view(torch.int16))


def test_bf16_products_take_fused_chains_of_pairs() -> None:
    with pytest.raises(ValueError, match="input pairs in fused chains"):
        grid_gemm.gemm_kernel(grid_gemm.BF16_DOT, 1, 256, (127, 256), True)
    with pytest.raises(ValueError, match="input pairs in fused chains"):
        grid_gemm.gemm_kernel(grid_gemm.BF16_DOT, 1, 256, (256,), False)


def test_other_orders_give_other_bits() -> None:
    """The kernels sum in the order they are given: a split into parts changes the bits of
    some outputs (so the emulation above would see an order other than the fixed one)."""
    weight = affine4_weight(64, 256, seed=3)
    grid = grid_gemm.to_grid(weight)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    orders = [
        grid_gemm.SumOrder((256,), True),
        grid_gemm.SumOrder((256,), False),
        grid_gemm.SumOrder((128, 256), True),
        grid_gemm.SumOrder((96, 192, 256), True),
    ]
    products = []
    for order in orders:
        product = grid_gemm.grid_linear(x, grid, order)
        assert torch.equal(product, emulate(weight, x, order)), order
        products.append(product)
    for i in range(len(products)):
        for j in range(i):
            assert not torch.equal(products[i], products[j]), (orders[i], orders[j])


# Row counts that take each way of sharing the work: four tiles at a time (up to
# WIDE_ROWS), two (up to MAX_ROWS), and past MAX_ROWS whole groups rebuilt into scratch,
# the groups left over shared by rows, SCRATCH_ROWS at a time and then every count of
# rows left over (1 to SCRATCH_ROWS - 1); weights read in place, one pass up to
# IN_PLACE_ROWS and passes of that many past it (three, the last of one row); and each
# side of this CPU's `row_limits`.
SHARED_ROWS = tuple(
    sorted(
        {
            1,
            grid_gemm.WIDE_ROWS,
            grid_gemm.WIDE_ROWS + 1,
            grid_gemm.MAX_ROWS,
            *range(grid_gemm.MAX_ROWS + 1, grid_gemm.MAX_ROWS + grid_gemm.SCRATCH_ROWS + 1),
            grid_gemm.MAX_ROWS + 14,
            2 * grid_gemm.IN_PLACE_ROWS + 1,
            *(rows + 1 for rows in (*grid_gemm.row_limits(), *grid_gemm.row_limits(True))),
            *(rows + 1 for rows in grid_gemm.row_limits(kind=grid_gemm.REBUILT)),
        }
    )
)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_row_and_output_is_summed_once_however_the_workers_share_them(threads) -> None:
    """Nine tile groups, taken four tiles at a time (up to WIDE_ROWS rows), two at a time
    (up to MAX_ROWS) or past MAX_ROWS rows whole, and the groups left over shared among the
    workers by rows. Every output is x @ W.T in the order, added once into out."""
    weight = affine4_weight(576, 256, seed=7)
    grid = grid_gemm.to_grid(weight)
    order = grid_gemm.SumOrder((128, 256), True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(max(SHARED_ROWS), 256, generator=generator)
    expected = emulate(weight, x, order)  # row by row: the same in any call
    with torch_threads(threads):
        for rows in SHARED_ROWS:
            assert torch.equal(grid_gemm.grid_linear(x[:rows], grid, order), expected[:rows])
            out = torch.ones(rows, 576)
            grid_gemm.grid_linear(x[:rows], grid, order, out, add=True)
            assert torch.equal(out, expected[:rows] + 1), rows


@pytest.mark.parametrize(
    ("form", "gelu"),
    [
        (grid_gemm.to_grid, False),
        (grid_gemm.rebuilt, False),
        (lambda weight: grid_gemm.rebuilt(weight, grid_gemm.BF16_DOT), False),
        (grid_gemm.to_grid, True),
    ],
    ids=["grid", "fp32", "bf16-products", "grid-gelu"],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_gate_up_gemm_gives_silu_mul_of_its_product(threads, form, gelu) -> None:
    """A [gate | up] weight of 2 x 288 outputs (nine groups of two gate tiles and the same
    two of up), on its grid or as fp32 or bf16 tiles (whose gate and up halves run in
    place): with
    silu, each group's product goes through `layer_ops.silu_times` and out gets what
    `silu_mul` makes of the whole product, bit for bit, for every row count and however
    the workers share the groups; with gelu too, GELU (tanh) in place of SiLU."""
    from pagedinfer.kernels.cpu import layer_ops
    from pagedinfer.kernels.cpu.numba_support import Job, run_jobs

    weight = affine4_weight(576, 256, seed=11)
    grid = form(weight)
    order = grid_gemm.SumOrder((128, 256), True)
    gemm = grid_gemm.gemm_all_rows(grid.kind, 256, order.ends, order.fused, True, gelu)
    generator = torch.Generator().manual_seed(3)
    with torch_threads(threads):
        for rows in SHARED_ROWS:
            x = torch.randn(rows, 256, generator=generator) * 4  # SiLU's both sides
            expected = layer_ops.silu_mul(grid_gemm.grid_linear(x, grid, order), gelu)
            out = np.full((rows, 288 // 16, 16), np.nan, dtype=np.float32)
            run_jobs([Job(gemm, (x.numpy(), grid.codes, grid.scales, out, False), 18)])
            assert np.array_equal(out.reshape(rows, 288), expected.numpy()), rows


@pytest.mark.parametrize("rows", [3, grid_gemm.MAX_ROWS + 31], ids=["one-pass", "scratch"])
def test_adding_into_out_rounds_as_an_inplace_add(rows: int) -> None:
    """out += the product, rounded once more: as `residual += x @ W.T` gives it, in one
    pass over the weight and over tiles rebuilt into scratch."""
    weight = affine4_weight(576, 576, seed=2)
    grid = grid_gemm.to_grid(weight)
    order = grid_gemm.fixed_order(576)
    generator = torch.Generator().manual_seed(5)
    x, residual = torch.randn(rows, 576, generator=generator), torch.randn(rows, 576)
    expected = residual + emulate(weight, x, order)
    grid_gemm.grid_linear(x, grid, order, residual, add=True)
    assert torch.equal(residual, expected)


def test_an_input_of_the_wrong_shape_is_refused() -> None:
    grid = grid_gemm.to_grid(affine4_weight(64, 256))
    order = grid_gemm.SumOrder((256,), True)
    with pytest.raises(ValueError, match=r"contiguous \[M, 256\]"):
        grid_gemm.grid_linear(torch.randn(2, 128), grid, order)
    with pytest.raises(ValueError, match="add needs out"):
        grid_gemm.grid_linear(torch.randn(2, 256), grid, order, add=True)
    with pytest.raises(ValueError, match=r"out must be contiguous \[2, 64\]"):
        grid_gemm.grid_linear(torch.randn(2, 256), grid, order, torch.empty(64, 2).t(), add=True)


def test_the_grid_gemm_object_adds_into_any_output() -> None:
    """`gemms.GridGemm`: the grid's product in its order, added in place into a
    contiguous output or into a strided view (through a temporary)."""
    weight = affine4_weight(64, 256, seed=8)
    gemm = gemms.GridGemm(grid_gemm.to_grid(weight), grid_gemm.fixed_order(256))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))[:, ::2]  # strided
    expected = emulate(weight, x.contiguous(), grid_gemm.fixed_order(256))
    assert gemm.out_features == 64
    assert torch.equal(gemm(x), expected)
    base = torch.randn(9, 128)
    out, strided = base.clone(), base.clone()[:, ::2]
    gemm.add_into(out[:, :64], x)  # a view with rows 128 apart: not contiguous
    strided_before = strided.clone()
    gemm.add_into(strided, x)
    assert torch.equal(out[:, :64], base[:, :64] + expected)
    assert torch.equal(out[:, 64:], base[:, 64:])
    assert torch.equal(strided, strided_before + expected)
    contiguous = base[:, :64].contiguous()
    gemm.add_into(contiguous, x)
    assert torch.equal(contiguous, base[:, :64] + expected)


needs_mkl = pytest.mark.skipif(
    not gemms.mkl_fp32_available(torch.float32), reason="torch was built without MKL"
)


@needs_mkl
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_an_mkl_packed_weight_serves_every_batch_size(bias: bool) -> None:
    """One packed weight, from a transposed view of [in, out] storage, gives x @ W.T (+ b)
    below, at and above the batch its layout was tuned for."""
    generator = torch.Generator().manual_seed(7)
    stored = torch.randn(256, 96, generator=generator)  # [in, out]
    b = torch.randn(96, generator=generator) if bias else None
    gemm = gemms.MklGemm.of(stored.t(), b)
    assert gemm.out_features == 96
    for rows in (1, 5, gemms.MKL_BATCH_HINT, gemms.MKL_BATCH_HINT + 37):
        x = torch.randn(rows, 256, generator=generator)
        expected = F.linear(x.double(), stored.t().double(), None if b is None else b.double())
        torch.testing.assert_close(gemm(x), expected.float(), rtol=1e-5, atol=1e-4)
        out = torch.ones(rows, 96)
        gemm.add_into(out, x)
        torch.testing.assert_close(out, expected.float() + 1, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(
    not gemms.onednn_bf16_available(torch.bfloat16), reason="no native bf16 matmul on this CPU"
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_onednn_packed_bf16_weight_serves_every_batch_size(bias: bool) -> None:
    """The bf16 weight in oneDNN's layout gives the bf16 product torch's own linear gives
    (the same bf16 inputs, fp32 sums: within bf16's rounding of the output)."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(96, 256, generator=generator).bfloat16()
    b = torch.randn(96, generator=generator).bfloat16() if bias else None
    gemm = gemms.OneDnnGemm.of(weight, b)
    assert gemm.out_features == 96
    for rows in (1, 5, gemms.ONEDNN_BATCH_HINT, gemms.ONEDNN_BATCH_HINT + 37):
        x = torch.randn(rows, 256, generator=generator).bfloat16()
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        product = gemm(x)
        assert product.dtype == torch.bfloat16
        torch.testing.assert_close(product.double(), expected, rtol=1e-2, atol=5e-2)
        out = torch.zeros(rows, 96, dtype=torch.bfloat16)
        gemm.add_into(out, x)
        assert torch.equal(out, product)
