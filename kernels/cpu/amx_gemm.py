"""bf16 GEMMs on AMX tiles (numba, CPU): the `grid_gemm.BF16_DOT` layout multiplied by
`tdpbf16ps` where the CPU has AMX-BF16 (Intel Sapphire Rapids and later).

BF16_DOT keeps a weight as uint32 [tiles, K / 2, 16]: word (t, p, j) holds the bf16s of
inputs 2p and 2p + 1 of output 16t + j. That is AMX's layout of a B tile: the 16 words
(p, 0..15) of 16 pairs p are a 16-row, 64-byte tile, contiguous in memory. The rows,
rounded to bf16 (`grid_gemm.bf16_pairs`), are the A tiles: 16 rows of 32 inputs. One
`tdpbf16ps` multiplies a 16 x 32 block of rows by a 32 x 16 block of the weight into 16
x 16 fp32 sums, 8,192 products, where AVX-512 takes 16 instructions for 512 of them. A
decode step then reads the weight's bytes at the memory's rate, and a step of many
rows multiplies several times faster than with fp32 FMAs (`grid_gemm.BF16`).

Each output sums its products in the tile unit's order, the same for a row whatever the
other rows of the step, so a row gets the same bits in a step of any size.

Linux lends a process the tiles' registers only once it asks (arch_prctl
ARCH_REQ_XCOMP_PERM); `available` asks, once per process. Each call of a GEMM loads the
tile configuration and releases the tiles when it returns.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types

from pagedinfer.kernels.cpu import grid_gemm
from pagedinfer.kernels.cpu.int8_gemm import silu_buffers, silu_chunk
from pagedinfer.kernels.cpu.numba_support import (
    intrinsic,
    jit,
    lanes_add,
    lanes_copy,
    prefetch_all,
)

LANES = grid_gemm.LANES
ROWS = 16  # rows of an A tile (and of the sums a tile holds)
PAIRS = 16  # input pairs of a B tile: 32 inputs, 64 bytes a lane's row
TILES = grid_gemm.TILE_GROUP  # weight tiles one pass multiplies at once, each its own sums
_FEATURES = llvm.get_host_cpu_features()
# Linux's arch_prctl: ask for an extended state's permission; AMX's tile data is state 18.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def available() -> bool:
    """Whether this CPU has AMX-BF16 and the process may use its tiles (asked here, once:
    the permission holds for the whole process and the children it starts)."""
    if not (_FEATURES.get("amx-tile", False) and _FEATURES.get("amx-bf16", False)):
        return False
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _function(builder: Any, name: str, arguments: list[ir.Type]) -> Any:
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), arguments), name
    )


@intrinsic
def tiles_on(typingctx: Any) -> Any:
    """Load the tile configuration every pass uses: palette 1, the eight tiles of 16 rows
    of 64 bytes (sums 0..3, rows 4, weights 5 and 6)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8 = ir.IntType(8)
        config = [0] * 64
        config[0] = 1  # palette
        for tile in range(8):
            config[16 + 2 * tile] = 64  # bytes a row (little-endian 16 bits)
            config[48 + tile] = ROWS
        array_type = ir.ArrayType(i8, 64)
        slot = cgutils.alloca_once(builder, array_type)
        slot.align = 64
        builder.store(ir.Constant(array_type, bytearray(config)), slot)
        load = _function(builder, "llvm.x86.ldtilecfg", [i8.as_pointer()])
        builder.call(load, [builder.bitcast(slot, i8.as_pointer())])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def tiles_off(typingctx: Any) -> Any:
    """Release the tiles (the thread's saved state shrinks back)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.call(_function(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def tile_products(
    typingctx: Any, sums: Any, rows: Any, r0: Any, codes: Any, t0: Any, t1: Any, t2: Any, t3: Any
) -> Any:
    """sums[j] (fp32 [TILES, 16, 16]) = rows r0 .. r0 + 15 of rows (bf16 pairs, int32
    [M, K / 2], M >= r0 + 16) times weight tile tj of codes (BF16_DOT: uint32 [tiles,
    K / 2, 16]), for j = 0..3: per 32 inputs, one A tile of the rows and one tdpbf16ps a
    weight tile. `tiles_on` must have configured the tiles."""
    if not (
        isinstance(sums, types.Array)
        and sums.dtype == types.float32
        and sums.ndim == 3
        and isinstance(rows, types.Array)
        and rows.dtype == types.int32
        and rows.ndim == 2
        and isinstance(codes, types.Array)
        and codes.dtype == types.uint32
        and codes.ndim == 3
        and all(isinstance(i, types.Integer) for i in (r0, t0, t1, t2, t3))
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8, i64 = ir.IntType(8), ir.IntType(64)
        pointer = i8.as_pointer()
        load = _function(builder, "llvm.x86.tileloadd64", [i8, pointer, i64])
        store = _function(builder, "llvm.x86.tilestored64", [i8, pointer, i64])
        zero = _function(builder, "llvm.x86.tilezero", [i8])
        product = _function(builder, "llvm.x86.tdpbf16ps", [i8, i8, i8])
        sums_type, rows_type, codes_type = signature.args[0], signature.args[1], signature.args[3]
        sums_ = context.make_array(sums_type)(context, builder, args[0])
        rows_ = context.make_array(rows_type)(context, builder, args[1])
        codes_ = context.make_array(codes_type)(context, builder, args[3])
        r0_ = context.cast(builder, args[2], signature.args[2], types.int64)
        tiles = [
            context.cast(builder, args[i], signature.args[i], types.int64) for i in range(4, 8)
        ]
        row_stride = cgutils.unpack_tuple(builder, rows_.strides, 2)[0]
        pairs = cgutils.unpack_tuple(builder, rows_.shape, 2)[1]
        for j in range(TILES):
            builder.call(zero, [i8(j)])
        with cgutils.for_range(builder, builder.udiv(pairs, i64(PAIRS))) as loop:
            p = builder.mul(loop.index, i64(PAIRS))
            a = cgutils.get_item_pointer(context, builder, rows_type, rows_, [r0_, p])
            builder.call(load, [i8(4), builder.bitcast(a, pointer), row_stride])
            for j, t in enumerate(tiles):
                b = cgutils.get_item_pointer(context, builder, codes_type, codes_, [t, p, i64(0)])
                held = i8(5 + j % 2)
                builder.call(load, [held, builder.bitcast(b, pointer), i64(4 * LANES)])
                builder.call(product, [i8(j), i8(4), held])
        for j in range(TILES):
            at = cgutils.get_item_pointer(
                context, builder, sums_type, sums_, [i64(j), i64(0), i64(0)]
            )
            builder.call(store, [i8(j), builder.bitcast(at, pointer), i64(4 * LANES)])
        return context.get_dummy_value()

    return types.void(sums, rows, r0, codes, t0, t1, t2, t3), codegen


@functools.cache
def gemm_all_rows(in_features: int, silu: bool = False, gelu: bool = False) -> Callable[..., None]:
    """gemm(x, codes, scales, out, add, worker, workers), as `grid_gemm.gemm_all_rows`
    gives for BF16_DOT: each worker rounds the rows to bf16 (padded with zero rows to a
    multiple of 16; a small share of its work, and no barrier), then takes its share of
    the groups of TILES tiles, and multiplies each by every 16 rows on the tiles (the
    group's weight, read from memory once, stays in L2 for the later rows). scales is
    unused. silu: out [M, out_features / 32, 16] gets silu(gate) * up (gelu: gelu_tanh)."""
    if not available():
        raise RuntimeError("this CPU or process has no AMX-BF16 tiles")
    k = in_features
    half = TILES // 2
    paired_tile = grid_gemm._paired_tile

    @jit(nogil=True, error_model="numpy")
    def gemm(
        given: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        out: np.ndarray,
        add: bool,
        worker: int,
        workers: int,
    ) -> None:
        prefetch_all(given)  # in the fused step, rows every worker wrote a share of
        m = given.shape[0]
        rows = np.zeros((-(-m // ROWS) * ROWS, k // 2), dtype=np.int32)
        grid_gemm.bf16_pairs(given, rows[:m])
        sums = np.empty((TILES, ROWS, LANES), dtype=np.float32)
        tiles = codes.shape[0]
        batch, product, silu_scratch = silu_buffers(m, half, silu)
        groups = tiles // TILES
        first, end = groups * worker // workers, groups * (worker + 1) // workers
        step = batch if silu else max(end - first, 1)
        tiles_on()
        for chunk in range(first, end, step):
            chunk_end = min(end, chunk + step)
            for group in range(chunk, chunk_end):
                if silu:
                    t0, t1 = paired_tile(group, 0, half, tiles), paired_tile(group, 1, half, tiles)
                    t2, t3 = paired_tile(group, 2, half, tiles), paired_tile(group, 3, half, tiles)
                else:
                    t0 = group * TILES
                    t1, t2, t3 = t0 + 1, t0 + 2, t0 + 3
                for r0 in range(0, m, ROWS):
                    tile_products(sums, rows, r0, codes, t0, t1, t2, t3)
                    for r in range(min(ROWS, m - r0)):
                        for j in range(TILES):
                            if silu:
                                o = (group - chunk) * half + j % half
                                lanes_copy(product[j // half, r0 + r, o], sums[j, r], LANES)
                            elif add:
                                lanes_add(out[r0 + r, group * TILES + j], sums[j, r], LANES)
                            else:
                                lanes_copy(out[r0 + r, group * TILES + j], sums[j, r], LANES)
            if silu:
                silu_chunk(
                    product, out, chunk * half, (chunk_end - chunk) * half, silu_scratch, gelu
                )
        tiles_off()

    return gemm
