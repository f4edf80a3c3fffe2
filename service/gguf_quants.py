"""GGUF tensor types: their block layouts, exact dequantisation, and their grids.

Each type we read (`FORMATS`) is a run of fixed-size blocks per row; `dequantize` gives
the fp32 values llama.cpp's `dequantize_row_*` gives, with the same fp32 operations in the
same order (for Q6_K, `d * scale` first and then times the code). A file holding any other
type is refused (`check_tensor_types`) rather than served through a path nobody checked.

Every quantised type is, exactly, `fp32(d * q) + m` over runs of inputs (`block_grid`):
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 per run of 32 with fp16 d and m; the K-quants with fp32
d and m, each the product of the super-block's fp16 scale and a run's small integer scale
(exact in fp32), per run of 32 (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K). The non-linear
IQ4_NL and IQ4_XS pick each weight's level from a table of 16 (`IQ4_LEVELS`) by a 4-bit
index: their codes are those levels, with fp16 d per 32 (IQ4_NL) or fp32 d per run of 32,
the super-block's fp16 scale times a 6-bit one less 32 (IQ4_XS), and no m. Backends that
compute from such grids take them from here instead of rediscovering them in the fp32
values. A super-block type's grid also keeps its scales as the file does (`SuperScales`:
fp16 per 256 inputs, a small integer per run), from which d and m are those products.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

GRID_BLOCK = 32  # inputs per block of the 32-wide types, and per fp16 scale of a grid
FINE_BLOCK = 16  # inputs per fp32 scale of a K-quant's grid (their smallest runs)
SUPER_BLOCK = 256  # inputs per block of the K-quants


@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF tensor type stores a row: blocks of `values` weights in `nbytes` bytes."""

    name: str
    values: int
    nbytes: int
    decode: Callable[[np.ndarray], np.ndarray]  # uint8 [blocks, nbytes] -> fp32 [blocks, values]


@dataclass(frozen=True)
class SuperScales:
    """A super-block type's scales as its blocks keep them: per SUPER_BLOCK inputs an fp16
    d (and dmin), per run a small integer scale (and min), so that the run's d is fp32(d *
    scale) and its m is -fp32(dmin * min), both exact in fp32 (an fp16 times at most 8
    bits). Without offsets, dmin and mins are None."""

    d: np.ndarray  # fp16 [rows, in_features / SUPER_BLOCK]
    scales: np.ndarray  # int8 [rows, runs]
    dmin: np.ndarray | None = None  # fp16 as d
    mins: np.ndarray | None = None  # uint8 as scales

    def repeated(self, times: int) -> SuperScales:
        """Each run's scale (and min) repeated `times` times: the same weights in runs of
        1 / times the inputs."""
        mins = None if self.mins is None else np.repeat(self.mins, times, axis=1)
        return SuperScales(self.d, np.repeat(self.scales, times, axis=1), self.dmin, mins)

    def with_offsets(self) -> SuperScales:
        """With dmin and mins (zeros where there were none), as the offset-free parts of a
        weight whose other parts have offsets keep them."""
        if self.mins is not None:
            return self
        return SuperScales(
            self.d, self.scales, np.zeros_like(self.d), np.zeros(self.scales.shape, np.uint8)
        )

    def products(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(d, m) per run, fp32 [rows, runs] (m None without offsets), as the
        dequantisation computes them."""
        per_super = self.scales.shape[1] // self.d.shape[1]
        d = np.repeat(self.d.astype(np.float32), per_super, axis=1) * self.scales.astype(np.float32)
        if self.mins is None or self.dmin is None:
            return d, None
        dmin = np.repeat(self.dmin.astype(np.float32), per_super, axis=1)
        return d, -(dmin * self.mins.astype(np.float32))


@dataclass(frozen=True)
class BlockGrid:
    """Rows of weights that are exactly fp32(d * q) + m in each run of `group` inputs:
    integer codes q in low..high, scales d and offsets m per run: fp16 per run of 32
    (the 32-wide types), fp32 per run of 32 or 16 (the K-quants; any mix of types is
    fp32 per 16, `fine`)."""

    codes: np.ndarray  # int8 [rows, in_features]
    d: np.ndarray  # fp16 or fp32 [rows, in_features / group]
    m: np.ndarray  # as d
    low: int
    high: int
    supers: SuperScales | None = None  # d and m as the super-block types keep them

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.d.shape[1]

    def dense(self) -> np.ndarray:
        """The fp32 weights, as the dequantisation computes them."""
        d = np.repeat(self.d.astype(np.float32), self.group, axis=1)
        m = np.repeat(self.m.astype(np.float32), self.group, axis=1)
        return self.codes.astype(np.float32) * d + m

    def fine(self) -> BlockGrid:
        """The same weights with fp32 scales per run of FINE_BLOCK inputs (exact: each run
        of 32 repeats its fp16 scale and offset, which fp32 holds)."""
        if self.d.dtype == np.float32 and self.group == FINE_BLOCK:
            return self
        times = self.group // FINE_BLOCK
        d = np.repeat(self.d.astype(np.float32), times, axis=1)
        m = np.repeat(self.m.astype(np.float32), times, axis=1)
        supers = None if self.supers is None else self.supers.repeated(times)
        return BlockGrid(self.codes, d, m, self.low, self.high, supers)


def concatenate(grids: Iterable[BlockGrid]) -> BlockGrid:
    """Grids stacked along their rows (a fused weight from its parts): the codes' range
    is the union of theirs; parts with different runs all become fine, parts with the
    same runs and different scale types get fp32 scales (which hold fp16's exactly).
    Where every part keeps `SuperScales`, so does the whole (with offsets where a part
    has them)."""
    grids = list(grids)
    if len({g.group for g in grids}) > 1:
        grids = [g.fine() for g in grids]
    elif len({g.d.dtype for g in grids}) > 1:
        grids = [
            BlockGrid(
                g.codes, g.d.astype(np.float32), g.m.astype(np.float32), g.low, g.high, g.supers
            )
            for g in grids
        ]
    parts = [g.supers for g in grids]
    supers = None
    if all(p is not None for p in parts):
        held = [p for p in parts if p is not None]
        if any(p.mins is not None for p in held):
            held = [p.with_offsets() for p in held]
        offsets = held[0].mins is not None
        supers = SuperScales(
            d=np.concatenate([p.d for p in held]),
            scales=np.concatenate([p.scales for p in held]),
            dmin=np.concatenate([p.dmin for p in held]) if offsets else None,  # type: ignore[misc]
            mins=np.concatenate([p.mins for p in held]) if offsets else None,  # type: ignore[misc]
        )
    return BlockGrid(
        codes=np.concatenate([g.codes for g in grids]),
        d=np.concatenate([g.d for g in grids]),
        m=np.concatenate([g.m for g in grids]),
        low=min(g.low for g in grids),
        high=max(g.high for g in grids),
        supers=supers,
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 fields [blocks, 2] as fp32 [blocks, 1]."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block as 32 codes: the low nibbles first, then the high ones."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes a block (a little-endian uint32) as bit j of value j, times 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [blocks, 32], bit j = value j
    return bits << 4


# -- the 32-wide types: codes, scales and offsets --------------------------------------


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _nibbles(raw[:, 2:18]).astype(np.int16) - 8, raw[:, 0:2], None


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _nibbles(raw[:, 4:20]).astype(np.int16), raw[:, 0:2], raw[:, 2:4]


def _q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    q = (_nibbles(raw[:, 6:22]) | _high_bits(raw[:, 2:6])).astype(np.int16) - 16
    return q, raw[:, 0:2], None


def _q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    q = (_nibbles(raw[:, 8:24]) | _high_bits(raw[:, 4:8])).astype(np.int16)
    return q, raw[:, 0:2], raw[:, 2:4]


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return raw[:, 2:34].view(np.int8).astype(np.int16), raw[:, 0:2], None


# The non-linear 4-bit types' 16 levels (ggml's kvalues_iq4nl): a 4-bit index picks one,
# and the weight is the block's scale times that level.
IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16
)


def _iq4_nl(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return IQ4_LEVELS[_nibbles(raw[:, 2:18])], raw[:, 0:2], None


# type -> (codes int16 [blocks, 32], d bytes [blocks, 2], m bytes [blocks, 2] or None)
_SCALED_PARTS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "IQ4_NL": _iq4_nl,
}


def _scaled_decoder(name: str) -> Callable[[np.ndarray], np.ndarray]:
    parts = _SCALED_PARTS[name]

    def decode(raw: np.ndarray) -> np.ndarray:
        q, d, m = parts(raw)
        y = q.astype(np.float32) * _f16(d)  # llama.cpp: x * d, then + m where there is one
        return y if m is None else y + _f16(m)

    return decode


# -- the K-quants -----------------------------------------------------------------------


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins as 8 each, uint8 [blocks, 8]."""
    sc = np.concatenate((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), axis=1)
    mn = np.concatenate((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), axis=1)
    return sc, mn


def _by_chunks(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Codes [blocks, 4, 32] of each 64-value chunk's low and high nibbles as [blocks, 8, 32]:
    sub-block 2c is chunk c's low nibbles, 2c + 1 its high ones."""
    return np.stack((low, high), axis=2).reshape(low.shape[0], 8, 32)


# Each K-quant's parts: codes int16 [blocks, 256], and its scales (one super-block a row)
# with a run of 32 (Q4_K, Q5_K, IQ4_XS) or 16 values, so that a value is fp32(d * q) + m.
KParts = tuple[np.ndarray, SuperScales]


def _supers(
    d: np.ndarray,
    scales: np.ndarray,
    dmin: np.ndarray | None = None,
    mins: np.ndarray | None = None,
) -> SuperScales:
    """SuperScales of blocks' fp16 fields [blocks, 2] and integer scales [blocks, runs]."""
    return SuperScales(
        d=d.copy().view(np.float16),
        scales=scales.astype(np.int8),
        dmin=None if dmin is None else dmin.copy().view(np.float16),
        mins=None if mins is None else mins.astype(np.uint8),
    )


def _q4_k(raw: np.ndarray) -> KParts:
    sc, mn = _k4_scales(raw[:, 4:16])
    qs = raw[:, 16:144].reshape(-1, 4, 32)
    q = _by_chunks(qs & 15, qs >> 4).astype(np.int16).reshape(-1, SUPER_BLOCK)
    return q, _supers(raw[:, 0:2], sc, raw[:, 2:4], mn)


def _q5_k(raw: np.ndarray) -> KParts:
    sc, mn = _k4_scales(raw[:, 4:16])
    qh = raw[:, 16:48]  # [blocks, 32]: bit 2c of byte l is value l of chunk c's low half
    qs = raw[:, 48:176].reshape(-1, 4, 32)
    chunk = np.arange(4, dtype=np.uint8)[None, :, None]
    low = (qs & 15) + (((qh[:, None, :] >> (2 * chunk)) & 1) << 4)
    high = (qs >> 4) + (((qh[:, None, :] >> (2 * chunk + 1)) & 1) << 4)
    q = _by_chunks(low, high).astype(np.int16).reshape(-1, SUPER_BLOCK)
    return q, _supers(raw[:, 0:2], sc, raw[:, 2:4], mn)


def _q6_k(raw: np.ndarray) -> KParts:
    ql = raw[:, 0:128].reshape(-1, 2, 64)
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32)
    sc = raw[:, 192:208].view(np.int8)  # [blocks, 16]
    # Per half of 128 values: four runs of 32, from ql's low nibbles (bytes 0..31, then
    # 32..63), then its high nibbles; each run's 2 high bits from qh at shifts 0, 2, 4, 6.
    low4 = np.concatenate((ql[:, :, None, 0:32], ql[:, :, None, 32:64]), axis=2)
    low4 = np.concatenate((low4 & 15, low4 >> 4), axis=2)  # [blocks, 2, 4, 32]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    q = (low4 | (((qh >> shifts) & 3) << 4)).astype(np.int16) - 32
    return q.reshape(-1, SUPER_BLOCK), _supers(raw[:, 208:210], sc)  # d * sc, then times q


def _q2_k(raw: np.ndarray) -> KParts:
    scales = raw[:, 0:16]  # [half, shift, run of 16] flattened
    qs = raw[:, 16:80].reshape(-1, 2, 1, 2, 16)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None, None]
    q = ((qs >> shifts) & 3).astype(np.int16).reshape(-1, SUPER_BLOCK)
    return q, _supers(raw[:, 80:82], scales & 15, raw[:, 82:84], scales >> 4)


def _q3_k(raw: np.ndarray) -> KParts:
    hmask = raw[:, 0:32].reshape(-1, 1, 1, 2, 16)
    qs = raw[:, 32:96].reshape(-1, 2, 1, 2, 16)
    s = raw[:, 96:108]
    low, high = s[:, 0:8], s[:, 8:12]
    six = np.concatenate(
        (
            (low[:, 0:4] & 15) | ((high & 3) << 4),
            (low[:, 4:8] & 15) | (((high >> 2) & 3) << 4),
            (low[:, 0:4] >> 4) | (((high >> 4) & 3) << 4),
            (low[:, 4:8] >> 4) | (((high >> 6) & 3) << 4),
        ),
        axis=1,
    )
    scales = six.astype(np.int16) - 32  # [blocks, 16]: 8 per half, 2 per shift
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None, None]
    bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)  # hmask bit 4 * half + shift
    lows = ((qs >> shifts) & 3).astype(np.int16)
    q = lows - np.where((hmask >> bit) & 1, np.int16(0), np.int16(4))
    return q.reshape(-1, SUPER_BLOCK), _supers(raw[:, 108:110], scales)


def _iq4_xs(raw: np.ndarray) -> KParts:
    high = raw[:, 2:4].copy().view(np.uint16)  # 2 high bits of run r's scale at bit 2r
    low = raw[:, 4:8]  # 4 low bits of run 2i's scale in byte i's low nibble, 2i + 1's high
    runs = np.arange(8, dtype=np.uint16)
    six = _nibbles(low)[:, [0, 4, 1, 5, 2, 6, 3, 7]] | (((high >> (2 * runs)) & 3) << 4)
    qs = raw[:, 8:136].reshape(-1, 8, 16)  # per run of 32: 16 bytes, as IQ4_NL's block
    q = IQ4_LEVELS[_nibbles(qs)].reshape(-1, SUPER_BLOCK)
    return q, _supers(raw[:, 0:2], six.astype(np.int16) - 32)  # d * (scale - 32), times q


_K_PARTS: dict[str, Callable[[np.ndarray], KParts]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_XS": _iq4_xs,  # not a K-quant, but a super-block of runs of 32 with fp32 scales
}
# Each super-block type's code range (the grid's low..high).
_K_RANGES = {
    "Q2_K": (0, 3),
    "Q3_K": (-4, 3),
    "Q4_K": (0, 15),
    "Q5_K": (0, 31),
    "Q6_K": (-32, 31),
    "IQ4_XS": (-127, 113),
}


def _k_decoder(name: str) -> Callable[[np.ndarray], np.ndarray]:
    parts = _K_PARTS[name]

    def decode(raw: np.ndarray) -> np.ndarray:
        q, supers = parts(raw)
        d, m = supers.products()
        runs = q.astype(np.float32).reshape(-1, d.shape[1], SUPER_BLOCK // d.shape[1])
        y = d[:, :, None] * runs  # llama.cpp: d * q, then - min where there is one
        return (y if m is None else y + m[:, :, None]).reshape(-1, SUPER_BLOCK)

    return decode


def _decode_f32(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float32)


def _decode_f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _decode_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 1, 4, _decode_f32),
        BlockFormat("F16", 1, 2, _decode_f16),
        BlockFormat("BF16", 1, 2, _decode_bf16),
        BlockFormat("Q4_0", 32, 18, _scaled_decoder("Q4_0")),
        BlockFormat("Q4_1", 32, 20, _scaled_decoder("Q4_1")),
        BlockFormat("Q5_0", 32, 22, _scaled_decoder("Q5_0")),
        BlockFormat("Q5_1", 32, 24, _scaled_decoder("Q5_1")),
        BlockFormat("Q8_0", 32, 34, _scaled_decoder("Q8_0")),
        BlockFormat("Q2_K", 256, 84, _k_decoder("Q2_K")),
        BlockFormat("Q3_K", 256, 110, _k_decoder("Q3_K")),
        BlockFormat("Q4_K", 256, 144, _k_decoder("Q4_K")),
        BlockFormat("Q5_K", 256, 176, _k_decoder("Q5_K")),
        BlockFormat("Q6_K", 256, 210, _k_decoder("Q6_K")),
        BlockFormat("IQ4_NL", 32, 18, _scaled_decoder("IQ4_NL")),
        BlockFormat("IQ4_XS", 256, 136, _k_decoder("IQ4_XS")),
    )
}
SUPPORTED_TYPES = tuple(FORMATS)
GRID_TYPES = (*_SCALED_PARTS, *_K_PARTS)  # the types `block_grid` takes


def check_tensor_types(tensors: Iterable[tuple[str, str]], source: object) -> None:
    """Refuse a file (`source`, for the message) with a tensor of a type not in FORMATS,
    given (tensor name, type name) pairs; ValueError names the first such tensor."""
    for name, type_name in tensors:
        if type_name not in FORMATS:
            raise ValueError(
                f"{source}: tensor {name!r} has GGUF type {type_name}, which pagedinfer does "
                f"not read (supported: {', '.join(SUPPORTED_TYPES)})"
            )


def _blocks(raw: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """uint8 [..., row bytes] as [blocks, nbytes]."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.shape[-1] % fmt.nbytes:
        raise ValueError(f"{fmt.name}: a row of {raw.shape[-1]} bytes is not whole blocks")
    return raw.reshape(-1, fmt.nbytes)


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Rows of raw blocks (uint8 [..., row bytes]) of a type in FORMATS as fp32
    [..., row values], exactly as llama.cpp dequantises them."""
    fmt = FORMATS[type_name]
    values = fmt.decode(_blocks(raw, fmt))
    per_row = raw.shape[-1] // fmt.nbytes * fmt.values
    return values.reshape(*raw.shape[:-1], per_row)


def block_grid(raw: np.ndarray, type_name: str) -> BlockGrid | None:
    """Rows of raw blocks (uint8 [rows, row bytes]) as their `BlockGrid`, for the types
    that are one (GRID_TYPES); None for the others.

    Q4_0 (d * (q - 8)) keeps its codes 0..15 with m = -8d, which fp32(d * q) + m gives
    exactly (d * (q - 8) is exact in fp32), unless -8d overflows fp16: then codes -8..7."""
    rows = raw.shape[0]
    if type_name in _K_PARTS:
        q, parts = _K_PARTS[type_name](_blocks(raw, FORMATS[type_name]))
        supers = SuperScales(
            d=parts.d.reshape(rows, -1),
            scales=parts.scales.reshape(rows, -1),
            dmin=None if parts.dmin is None else parts.dmin.reshape(rows, -1),
            mins=None if parts.mins is None else parts.mins.reshape(rows, -1),
        )
        d, m = supers.products()
        m = np.zeros_like(d) if m is None else m
        low, high = _K_RANGES[type_name]
        return BlockGrid(q.astype(np.int8).reshape(rows, -1), d, m, low, high, supers)
    if type_name not in _SCALED_PARTS:
        return None
    fmt = FORMATS[type_name]
    q, d_raw, m_raw = _SCALED_PARTS[type_name](_blocks(raw, fmt))
    d = d_raw.copy().view(np.float16).reshape(rows, -1)
    low, high = {
        "Q4_0": (-8, 7),
        "Q4_1": (0, 15),
        "Q5_0": (-16, 15),
        "Q5_1": (0, 31),
        "IQ4_NL": (-127, 113),
    }.get(type_name, (-128, 127))
    if m_raw is not None:
        m = m_raw.copy().view(np.float16).reshape(rows, -1)
    else:
        m = np.zeros_like(d)
        if type_name == "Q4_0":
            with np.errstate(over="ignore"):
                offset = (d.astype(np.float32) * -8).astype(np.float16)
            if np.isfinite(offset)[np.isfinite(d)].all():
                q, m, low, high = q + 8, offset, 0, 15
    return BlockGrid(q.astype(np.int8).reshape(rows, -1), d, m, low, high)
