"""What the numba-compiled CPU kernels share: the jit decorator, fast-math flags, an exp.

Importing this module imports numba; the kernels' modules are imported only where numba
is installed (`torch_ops.compiled_kernels`).

numba's disk cache checks only the file that defines a kernel: a kernel compiled with
`exp_into` keeps the old one after an edit here alone. An install rewrites every file;
in a working tree, delete the `*.nbi`/`*.nbc` files beside the kernels (or under
NUMBA_CACHE_DIR) after editing this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# Reassociation lets LLVM vectorise dot products and sums. No "no-inf" or "no-NaN" flags:
# running maxima start at -inf, and NaN in the input must come out as NaN.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_LOG2E = np.float32(1.0 / math.log(2.0))
# ln 2 in two parts (Cody and Waite): k * _LN2_HI is exact for the k here, so r keeps
# its precision at large |x|, where one fp32 ln 2 would cost 4e-6 of relative error.
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(math.log(2.0) - 0.693359375)


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is what the compiled kernels take: fp32, on CPU, not tracked
    by autograd (they have no backward)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors
    )


def jit(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """numba.njit, cached on disk when some cache directory is writable (else in memory)."""

    def compile_lazily(function: Callable[..., Any]) -> Callable[..., Any]:
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError:  # numba found no writable cache directory (read-only root fs)
            return numba.njit(**options)(function)

    return compile_lazily


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
