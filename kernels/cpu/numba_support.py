"""What the numba-compiled CPU kernels share: the jit decorator, fast-math flags, an exp,
a prefetch hint, stack arrays, bf16 values as 16 bits (a bf16 KV cache), exact
whole-vector lane ops, and the worker threads.

Importing this module imports numba; the kernel modules that use it are imported only
where numba is installed (the CPU executor's and `torch_ops`' compiled paths).

LLVM vectorises simple loops by itself, but not a register-blocked kernel: given a loop
nest that accumulates a few rows of 16 floats over a long loop, it vectorises the long
loop instead (with horizontal sums), and it keeps no accumulator in a register when it
cannot prove that the accumulator's memory aliases no other array. `stack_array` gives
memory that LLVM knows is private (and 64-byte aligned), and the `lanes_*` ops each
compile to one LLVM vector operation on the first `width` floats of their arrays: an
accumulator tile written only through them becomes vector registers (512-bit where the
CPU has AVX-512), as in `paged_verify`. The lane ops are also exact (see below), which lets
two kernels compute the same attention to the bit.

numba's disk cache checks only the file that defines a kernel: a kernel that uses a
helper from here keeps the old helper after an edit here alone. An install rewrites
every file; in a working tree, delete the `*.nbi`/`*.nbc` files beside the kernels (or
under NUMBA_CACHE_DIR) after editing this module.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic as numba_intrinsic
from numba.extending import overload
from numba.np.arrayobj import make_array, populate_array

# A read-only cache of kernels compiled when the image was built (the Dockerfile sets it).
PREBUILT_CACHE_ENV = "PAGEDINFER_NUMBA_PREBUILT"


def seed_disk_cache(prebuilt: str | None = None, target: str | None = None) -> bool:
    """Copy a prebuilt kernel cache into the writable numba cache directory, once.

    numba reads and writes its cache in one directory, so a read-only cache baked into an
    image cannot serve directly: its files are copied into NUMBA_CACHE_DIR (an emptyDir in
    a pod) before the first kernel loads. Entries compiled for another CPU simply miss.
    Returns whether anything was copied.
    """
    prebuilt = prebuilt if prebuilt is not None else os.environ.get(PREBUILT_CACHE_ENV)
    target = target if target is not None else numba.config.CACHE_DIR
    if not prebuilt or not target or not os.path.isdir(prebuilt):
        return False
    if os.path.realpath(prebuilt) == os.path.realpath(target):
        return False
    marker = os.path.join(target, ".seeded")
    if os.path.exists(marker):
        return False
    try:
        shutil.copytree(prebuilt, target, dirs_exist_ok=True)
        with open(marker, "w"):
            pass
    except OSError:  # an unwritable target: the kernels compile as without a cache
        return False
    return True


seed_disk_cache()

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# Reassociation lets LLVM vectorise dot products and sums. No "no-inf" or "no-NaN" flags:
# running maxima start at -inf, and NaN in the input must come out as NaN.
# A dict, not a set: its order (and so the kernels' disk-cache keys) is the same in every
# process (`_stable_identity`).
FASTMATH = {"reassoc": True, "contract": True, "nsz": True, "arcp": True}
CACHE_LINE = 64  # bytes
_LOG2E = np.float32(1.0 / math.log(2.0))
# ln 2 in two parts (Cody and Waite): k * _LN2_HI is exact for the k here, so r keeps
# its precision at large |x|, where one fp32 ln 2 would cost 4e-6 of relative error.
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(math.log(2.0) - 0.693359375)


def cache_array(cache: torch.Tensor) -> np.ndarray:
    """A KV cache tensor as the compiled kernels take it: fp32 as numpy's fp32, bf16 as
    its 16-bit patterns (uint16; numpy has no bf16), both views of the same memory."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy()


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is what the compiled kernels take: fp32, on CPU, not tracked
    by autograd (they have no backward)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors
    )


def jit(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """numba.njit, cached on disk when some cache directory is writable (else in memory)."""

    def compile_lazily(function: Callable[..., Any]) -> Callable[..., Any]:
        identity = _stable_identity(function)
        if identity is not None:
            # Each kernel a factory makes gets cache files of its own. numba keeps every
            # variant of one function in one index, numbering their files as it saves
            # them: processes compiling different variants at once (a test and the server
            # it started) could give two variants one number, and a later process then
            # loaded one variant's code for the other (a crash).
            function.__qualname__ = f"{function.__qualname__}.{identity[-16:]}"
        try:
            dispatcher = numba.njit(cache=True, **options)(function)
        except RuntimeError:  # numba found no writable cache directory (read-only root fs)
            return numba.njit(**options)(function)
        _name(dispatcher, identity)
        return dispatcher

    return compile_lazily


def intrinsic(definition: Callable[..., Any]) -> Any:
    """numba.extending.intrinsic, with the same id in every process (`_stable_identity`:
    a kernel's disk-cache key pickles the intrinsics it calls)."""
    result = numba_intrinsic(definition)
    key = f"{definition.__module__}.{definition.__qualname__}"
    _name(result, "pagedinfer-" + hashlib.sha256(key.encode()).hexdigest())
    return result


def _name(numba_object: Any, identity: str | None) -> None:
    """Give a dispatcher or intrinsic its stable id (numba's own hook for ids that must
    survive pickling); without one, or with a numba that has no such hook, it keeps the
    random id numba draws, and only the disk cache misses."""
    if identity is not None and hasattr(numba_object, "_set_uuid"):
        numba_object._set_uuid(identity)


def _stable_identity(function: Callable[..., Any]) -> str | None:
    """The same id in every process for a kernel made by a factory, or None.

    numba keys a closure's disk cache on its pickled closure values, and a dispatcher
    pickles with an id drawn at random per process: a kernel that calls a helper made by
    the same factory would miss the cache in every process and compile again. From the
    function's name and its closure's plain values (and the helpers' ids, themselves
    stable), the pickle is the same in every process and the cache hits.
    """
    parts = [function.__module__, function.__qualname__]
    for cell in function.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, numba.core.registry.CPUDispatcher):
            parts.append(str(value._uuid))
        elif isinstance(value, (bool, int, float, str, tuple, type(None))):
            parts.append(repr(value))
        else:
            return None
    return "pagedinfer-" + hashlib.sha256("|".join(parts).encode()).hexdigest()


@jit(fastmath=FASTMATH, inline="always")
def exp_into(x: np.ndarray, out: np.ndarray, bits: np.ndarray) -> None:
    """out[:n] = exp(x[:n]) for x <= 0 (n = len(x); bits: int32 scratch of n or more).

    As 2**k * e**r with |r| <= ln2 / 2 and a degree-7 polynomial for e**r (within a few
    fp32 ulps): this loop vectorises, where numba's scalar exp is a libm call
    per element. Below -87 the result is exp(-87), about 1.6e-38, in place of 0.
    """
    n = x.shape[0]
    for t in range(n):
        v = max(x[t], np.float32(-87.0))
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = (v - k * _LN2_HI) - k * _LN2_LO
        p = np.float32(1.0 / 5040.0)
        p = p * r + np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        out[t] = p
        bits[t] = (np.int32(k) + np.int32(127)) << np.int32(23)
    powers = bits[:n].view(np.float32)
    for t in range(n):
        out[t] *= powers[t]


@intrinsic
def prefetch(typingctx: Any, array: Any, index: Any) -> Any:
    """Ask the CPU to fetch the cache line of `array.flat[index]` into L2 (C-contiguous
    arrays). A hint: it changes no result and never faults, whatever the address.

    The paged KV cache defeats the hardware prefetcher at every block boundary (the next
    block is anywhere in memory); the decode kernel asks for the next block's rows while
    it computes on the current one.
    """
    if not (
        isinstance(array, types.Array) and array.layout == "C" and isinstance(index, types.Integer)
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        function = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, locality 2 (L2 and outward), data cache
        builder.call(function, [address, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@jit(inline="always")
def prefetch_all(array: np.ndarray) -> None:
    """`prefetch` every cache line of a C-contiguous array. In the fused step a phase's
    rows were just written by the other workers (each its own GEMM tiles or rows); asked
    for all at once, their lines cross between cores together, where reading them in
    order would wait for each line in turn."""
    for i in range(0, array.size, CACHE_LINE // array.itemsize):
        prefetch(array, i)


@dataclass(frozen=True)
class Job:
    """A compiled kernel's call: kernel(*args, worker, workers) runs its tasks worker,
    worker + workers, ... of num_tasks."""

    kernel: Callable[..., None]
    args: tuple[Any, ...]
    num_tasks: int


def attention_job(
    kernel_for: Callable[[int, int, int, int], Callable[..., None]],
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tasks: tuple[np.ndarray, ...],
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> Job:
    """A paged attention kernel's call: the kernel for the cache's shape (`kernel_for`:
    block size, query heads, KV heads, head dim), called as kernel(query, k_cache,
    v_cache, *tasks, scale, window, out) on numpy views, one task per row of tasks[0]
    (window: the sliding window in positions, 0 for none)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    kernel = kernel_for(block_size, query.shape[1], num_kv_heads, head_dim)
    caches = cache_array(k_cache), cache_array(v_cache)
    args = (query.numpy(), *caches, *tasks, np.float32(scale), np.int64(window), out.numpy())
    return Job(kernel, args, tasks[0].shape[0])


def run_jobs(jobs: Sequence[Job]) -> None:
    """Run the jobs' tasks on the caller and pool threads: a worker per torch thread (at
    most one per task of the largest job), each doing its share of every job in turn, so
    that one dispatch to the threads serves them all. The kernels release the GIL;
    sorting each job's tasks by work, largest first, gives the workers similar shares.
    """
    jobs = [job for job in jobs if job.num_tasks]
    if not jobs:
        return
    workers = max(1, min(torch.get_num_threads(), max(job.num_tasks for job in jobs)))

    def share(worker: int) -> None:
        for job in jobs:
            job.kernel(*job.args, worker, workers)

    others = [_pool(workers).submit(share, w) for w in range(1, workers)]
    share(0)
    for other in others:
        other.result()


_pool_lock = threading.Lock()


@functools.cache
def _pool_of(size: int, pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(size, thread_name_prefix="pagedinfer-attention")


def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads for the workers beyond the caller's own, one pool per size in use. Keyed by
    process too: a forked child inherits the pool object but none of its threads."""
    with _pool_lock:
        return _pool_of(workers - 1, os.getpid())


def _stack_array_of(dtype: Any, element: ir.Type, name: str) -> Any:
    """The intrinsic `name(shape)`: a C-contiguous array of `dtype` and `shape` (a tuple
    of integer constants) in the calling function's stack frame: one buffer per call
    site, allocated once per call of that function, uninitialised. It must not outlive
    the function (never return it)."""

    def definition(typingctx: Any, shape: Any) -> Any:
        if not (
            isinstance(shape, types.BaseTuple)
            and len(shape) > 0
            and all(isinstance(n, types.IntegerLiteral) for n in shape)
        ):
            return None
        dims = [n.literal_value for n in shape]
        array_type = types.Array(dtype, len(dims), "C")
        size = dtype.bitwidth // 8

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            with builder.goto_entry_block():
                slot = builder.alloca(ir.ArrayType(element, math.prod(dims)))
                slot.align = 64  # whole cache lines: a 16-lane row is one aligned vector
            intp = context.get_value_type(types.intp)
            array = make_array(array_type)(context, builder)
            populate_array(
                array,
                data=builder.bitcast(slot, element.as_pointer()),
                shape=[ir.Constant(intp, n) for n in dims],
                strides=[
                    ir.Constant(intp, size * math.prod(dims[i + 1 :])) for i in range(len(dims))
                ],
                itemsize=ir.Constant(intp, size),
                meminfo=None,
            )
            return array._getvalue()

        return array_type(shape), codegen

    definition.__name__ = definition.__qualname__ = name
    return intrinsic(definition)


# stack_array(shape): float32; int_stack_array(shape): int32 (`_stack_array_of`).
stack_array = _stack_array_of(types.float32, ir.FloatType(), "stack_array")
int_stack_array = _stack_array_of(types.int32, ir.IntType(32), "int_stack_array")


# -- bf16 values as their 16-bit patterns (a bf16 KV cache) --------------------------------


@intrinsic
def float_bits(typingctx: Any, x: Any) -> Any:
    """The 32 bits of fp32 x, as an int32."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        return builder.bitcast(value, ir.IntType(32))

    return types.int32(x), codegen


@intrinsic
def bits_float(typingctx: Any, bits: Any) -> Any:
    """The fp32 whose 32 bits are the low 32 bits of the integer `bits`."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        word = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(word, ir.FloatType())

    return types.float32(bits), codegen


@jit(inline="always")
def bf16_bits(bits: int) -> int:
    """The 16 bits of the bf16 nearest the fp32 whose bits (int32) are given, ties to
    even, as torch rounds (a NaN stays a NaN, made quiet, its sign kept)."""
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return ((bits >> 16) | 0x40) & 0xFFFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def as_cached(cache: np.ndarray, x: float) -> Any:
    """x as a KV cache of `cache`'s type holds it: fp32 as it is; a bf16 cache (uint16,
    `cache_array`) the bits of its nearest bf16. For compiled kernels (`overload` below);
    from Python, the same through torch's rounding."""
    if cache.dtype == np.uint16:
        value = torch.tensor([x], dtype=torch.float32).bfloat16().view(torch.int16)
        return np.uint16(int(value) & 0xFFFF)
    return np.float32(x)


# numba checks that an overload's typing and implementations have the same signature,
# annotations included: these go without.


@overload(as_cached)
def _as_cached(cache, x):
    if cache.dtype == types.uint16:
        return lambda cache, x: np.uint16(bf16_bits(float_bits(np.float32(x))))
    if cache.dtype == types.float32:
        return lambda cache, x: np.float32(x)
    return None


def fp32_positions(block: np.ndarray, scratch: np.ndarray, n: int) -> np.ndarray:
    """A KV cache block's first n positions in fp32: the block itself where the cache is
    fp32; from a bf16 cache (uint16), widened exactly into `scratch` (fp32, the block's
    shape), which is returned. For compiled kernels (`overload` below)."""
    if block.dtype == np.uint16:
        scratch[:n] = (block[:n].astype(np.uint32) << 16).view(np.float32)
        return scratch
    return block


@overload(fp32_positions)
def _fp32_positions(block, scratch, n):
    if block.dtype == types.float32:
        return lambda block, scratch, n: block
    if block.dtype != types.uint16:
        return None

    def widen(block, scratch, n):
        src, dst = block.reshape(block.size), scratch.reshape(scratch.size)
        for i in range(n * (block.size // block.shape[0])):
            dst[i] = bits_float(np.uint32(src[i]) << 16)
        return scratch

    return widen


def _is_lanes(t: Any, dtype: Any = types.float32) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == 1 and t.layout == "C"


def _lane_op(args: tuple[Any, ...], combine: Callable[..., Any]) -> Any:
    """Typing and code of `y[:width] = combine(y, operands...)` as one LLVM vector operation.

    args: (y, operands..., width). y is a 1-D C-contiguous float32 array; each operand is
    one too (its first `width` elements), or such an array of bf16 bits (uint16, as a bf16
    KV cache holds them: widened exactly in registers), or a float scalar (the same in
    every lane); width is an integer constant. Nothing is bounds-checked.
    """
    y, *operands, width = args
    if not (
        isinstance(width, types.IntegerLiteral)
        and _is_lanes(y)
        and all(
            _is_lanes(a) or _is_lanes(a, types.uint16) or isinstance(a, types.Float)
            for a in operands
        )
    ):
        return None
    w = width.literal_value

    def codegen(context: Any, builder: Any, signature: Any, cargs: Any) -> Any:
        vector = ir.VectorType(ir.FloatType(), w)

        def lanes(i: int) -> Any:
            if not isinstance(signature.args[i], types.Array):
                one = context.cast(builder, cargs[i], signature.args[i], types.float32)
                lane0 = builder.insert_element(
                    ir.Constant(vector, ir.Undefined), one, ir.IntType(32)(0)
                )
                zeros = ir.Constant(ir.VectorType(ir.IntType(32), w), [0] * w)
                return builder.shuffle_vector(lane0, ir.Constant(vector, ir.Undefined), zeros)
            if signature.args[i].dtype == types.uint16:  # bf16 bits: the high half of fp32
                halves = builder.load(pointer(i, ir.VectorType(ir.IntType(16), w)), align=2)
                words = builder.zext(halves, ir.VectorType(ir.IntType(32), w))
                shift = ir.Constant(words.type, [16] * w)
                return builder.bitcast(builder.shl(words, shift), vector)
            return builder.load(pointer(i), align=4)

        def pointer(i: int, of: Any = vector) -> Any:
            data = context.make_array(signature.args[i])(context, builder, cargs[i]).data
            return builder.bitcast(data, of.as_pointer())

        values = [lanes(i) for i in range(1 + len(operands))]
        builder.store(combine(builder, *values), pointer(0), align=4)
        return context.get_dummy_value()

    return types.void(*args), codegen


# The lane ops are exact IEEE operations, each rounded once: LLVM may not reassociate,
# fuse or approximate them, so two kernels that compute a value with the same sequence of
# lane ops get the same bits (`paged_verify` and `paged_decode` rely on it). numba gives the
# kernel's fast-math flags to every float instruction that has none, so these carry
# "afn" (approximate library functions), which changes nothing for +, * and /.
EXACT = ("afn",)


def fma_ir(builder: Any, x: Any, a: Any, y: Any) -> Any:
    """x * a + y, rounded once: llvm.fma on float vectors (IR for intrinsics)."""
    name = f"llvm.fma.v{x.type.count}f32"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(x.type, [x.type] * 3), name
    )
    return builder.call(function, [x, a, y])


@intrinsic
def lanes_fma(typingctx: Any, y: Any, x: Any, a: Any, width: Any) -> Any:
    """y[:width] = x[:width] * a + y[:width], rounded once (a: lanes or a scalar)."""
    return _lane_op((y, x, a, width), lambda b, y, x, a: fma_ir(b, x, a, y))


@intrinsic
def lanes_mul_add(typingctx: Any, y: Any, x: Any, a: Any, width: Any) -> Any:
    """y[:width] = x[:width] * a + y[:width], the product rounded, then the sum (a: lanes
    or a scalar): the unfused chain of a `grid_gemm.SumOrder` (fused=False)."""
    return _lane_op(
        (y, x, a, width), lambda b, y, x, a: b.fadd(b.fmul(x, a, flags=EXACT), y, flags=EXACT)
    )


@intrinsic
def lanes_fma_where(typingctx: Any, y: Any, x: Any, a: Any, width: Any) -> Any:
    """`lanes_fma` in the lanes where x is not 0: elsewhere y stays as it is, even where a
    is NaN or inf (0 * a would be NaN)."""

    def combine(b: Any, y: Any, x: Any, a: Any) -> Any:
        nonzero = b.fcmp_ordered("!=", x, ir.Constant(x.type, None))
        return b.select(nonzero, fma_ir(b, x, a, y), y)

    return _lane_op((y, x, a, width), combine)


@intrinsic
def lanes_add(typingctx: Any, y: Any, x: Any, width: Any) -> Any:
    """y[:width] = y[:width] + x (x: lanes or a scalar)."""
    return _lane_op((y, x, width), lambda b, y, x: b.fadd(y, x, flags=EXACT))


@intrinsic
def lanes_mul(typingctx: Any, y: Any, x: Any, s: Any, width: Any) -> Any:
    """y[:width] = x[:width] * s (s: lanes or a scalar)."""
    return _lane_op((y, x, s, width), lambda b, y, x, s: b.fmul(x, s, flags=EXACT))


@intrinsic
def lanes_div(typingctx: Any, y: Any, x: Any, s: Any, width: Any) -> Any:
    """y[:width] = x[:width] / s (s: lanes or a scalar)."""
    return _lane_op((y, x, s, width), lambda b, y, x, s: b.fdiv(x, s, flags=EXACT))


@intrinsic
def lanes_silu_times(typingctx: Any, y: Any, gate: Any, decay: Any, up: Any, width: Any) -> Any:
    """y[:width] = silu(gate) * up, from decay = exp(-|gate|): g * (decay if g < 0 else 1)
    / (decay + 1) * up, each operation rounded once (a NaN gate gives NaN)."""

    def combine(b: Any, y: Any, g: Any, e: Any, u: Any) -> Any:
        one = ir.Constant(g.type, [1.0] * g.type.count)
        below = b.fcmp_ordered("<", g, ir.Constant(g.type, None))
        numerator = b.fmul(g, b.select(below, e, one), flags=EXACT)
        sigmoid = b.fdiv(numerator, b.fadd(e, one, flags=EXACT), flags=EXACT)
        return b.fmul(sigmoid, u, flags=EXACT)

    return _lane_op((y, gate, decay, up, width), combine)


@intrinsic
def lanes_max(typingctx: Any, y: Any, x: Any, width: Any) -> Any:
    """y[:width] = max(y[:width], x), elementwise (x where either is NaN)."""
    return _lane_op((y, x, width), lambda b, y, x: b.select(b.fcmp_ordered(">=", y, x), y, x))


@intrinsic
def lanes_copy(typingctx: Any, y: Any, x: Any, width: Any) -> Any:
    """y[:width] = x (x: lanes or a scalar)."""
    return _lane_op((y, x, width), lambda b, y, x: x)


@intrinsic
def lanes_sum(typingctx: Any, x: Any, width: Any) -> Any:
    """The sum of x[:width] (width a power of 2) by halving: the first half plus the second,
    elementwise, until one lane is left."""
    if not (
        _is_lanes(x)
        and isinstance(width, types.IntegerLiteral)
        and width.literal_value > 0
        and width.literal_value & (width.literal_value - 1) == 0
    ):
        return None
    w = width.literal_value

    def codegen(context: Any, builder: Any, signature: Any, cargs: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, cargs[0]).data
        vector = ir.VectorType(ir.FloatType(), w)
        values = builder.load(builder.bitcast(data, vector.as_pointer()), align=4)
        i32 = ir.IntType(32)
        half = w // 2
        while half:
            low = ir.Constant(ir.VectorType(i32, half), list(range(half)))
            high = ir.Constant(ir.VectorType(i32, half), list(range(half, 2 * half)))
            values = builder.fadd(
                builder.shuffle_vector(values, values, low),
                builder.shuffle_vector(values, values, high),
                flags=EXACT,
            )
            half //= 2
        return builder.extract_element(values, i32(0))

    return types.float32(x, width), codegen


def _int64_element(context: Any, builder: Any, array_type: Any, array: Any, index: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [index])


def _is_int64_vector(t: Any) -> bool:
    return isinstance(t, types.Array) and t.dtype == types.int64 and t.layout == "C"


@intrinsic
def atomic_add(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    """array.flat[index] += value as one atomic operation (sequentially consistent: what
    this thread wrote before is visible to a thread that sees the new count)."""
    if not (_is_int64_vector(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _int64_element(context, builder, signature.args[0], args[0], args[1])
        amount = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.atomic_rmw("add", pointer, amount, "seq_cst")
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def atomic_load(typingctx: Any, array: Any, index: Any) -> Any:
    """array.flat[index], read as one atomic operation (sequentially consistent)."""
    if not (_is_int64_vector(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _int64_element(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(pointer, "seq_cst", 8)

    return types.int64(array, index), codegen


@intrinsic
def cycle_counter(typingctx: Any) -> Any:
    """The CPU's cycle counter, for timing phases inside a kernel (x86: the time-stamp
    counter, which counts at a constant rate whatever the clock; `cycles` reads it from
    Python, to relate it to seconds)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.IntType(64), [])
        counter = cgutils.get_or_insert_function(builder.module, fnty, "llvm.readcyclecounter")
        return builder.call(counter, [])

    return types.int64(), codegen


@jit(nogil=True)
def cycles() -> int:
    """`cycle_counter`, read from Python."""
    return cycle_counter()


@intrinsic
def spin_pause(typingctx: Any) -> Any:
    """The CPU's spin-wait hint (x86 `pause`): a waiting loop yields the core's pipeline."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            pause = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@jit(inline="always", nogil=True)
def snake_task(turn: int, worker: int, workers: int) -> int:
    """The task a worker takes at its turn-th turn when tasks, sorted by cost (largest
    first), are dealt to the workers in a snake: 0, 1, ..., workers - 1, then back from
    workers - 1 to 0, and so on (the task may be past the last one: none that turn).

    Dealt round-robin, the first worker gets the largest task of every round, and that
    adds up while the others wait for it; in a snake each round makes up for the last."""
    if turn % 2 == 0:
        return turn * workers + worker
    return turn * workers + workers - 1 - worker


@intrinsic
def yield_core(typingctx: Any) -> Any:
    """sched_yield(2): let another thread that is ready to run have this core (the symbol
    is resolved when the code is loaded, so a kernel that calls it stays cacheable)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.IntType(32), [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_yield"), [])
        return context.get_dummy_value()

    return types.void(), codegen


# Pauses a worker spins at a barrier before it yields its core at each further check:
# tens of microseconds, longer than the waits of a step's phases on idle cores.
BARRIER_SPINS = 1024


@jit(inline="always", nogil=True)
def barrier(sync: np.ndarray, workers: int, passed: int) -> int:
    """Wait until all `workers` have reached their barrier number passed + 1 (sync[0]: the
    arrivals so far, 0 before the first); returns passed + 1, the caller's new count.
    Workers spin (phases take microseconds), then yield the core: where another process
    shares the cores, a worker it preempted gets one back instead of waiting out the
    time slices of those spinning for it."""
    atomic_add(sync, 0, 1)
    target = workers * (passed + 1)
    spins = 0
    while atomic_load(sync, 0) < target:
        if spins < BARRIER_SPINS:
            spin_pause()
            spins += 1
        else:
            yield_core()
    return passed + 1


def avx2_madds(builder: Any) -> tuple[Any, Any]:
    """AVX2's vpmaddubsw (32 bytes by 32 bytes into 16 pair sums) and vpmaddwd (16 words
    by 16 into 8 quad sums) on 256-bit halves, as functions of the module."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    half_bytes, half_words = ir.VectorType(i8, 32), ir.VectorType(i16, 16)
    half_ints = ir.VectorType(i32, 8)
    pair_sums = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(half_words, [half_bytes, half_bytes]),
        "llvm.x86.avx2.pmadd.ub.sw",
    )
    quads = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(half_ints, [half_words, half_words]),
        "llvm.x86.avx2.pmadd.wd",
    )
    return pair_sums, quads
