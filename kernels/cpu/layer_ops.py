"""The small ops between a layer's GEMMs, compiled for CPU with numba (fp32).

Between its four GEMMs a Llama layer runs two RMSNorms, the rotary embedding of q and k,
the K/V cache write and SiLU-and-multiply: about 30 torch ops on a few KB each at decode
batch sizes, where each op costs mostly its dispatch. These kernels do the same work in
three calls:
- `rms_norm`: one pass per row, fp32 sums;
- `rope_write_kv`: RMS-norms each q and k head where the model has q/k norms (Qwen3),
  rotates the leading dims of q and k that the layer rotates (all, some, or none in a
  NoPE layer) in place inside the q/k/v GEMM's output and copies
  each token's k and v rows into its cache slot (slot -1: padding, skipped), rounded to
  bf16 where the cache is bf16;
- `silu_mul`: SiLU (or GELU, tanh approximation: Gemma 3's) of the gate half times the
  up half.
Each op costs more in a step than in a loop of its own (the GEMM before it has streamed
the weights through the caches, and the Python around it runs cold): fewer ops is what
pays.

The CPU executor calls them layer by layer, on the calling thread. The fused step calls
`rms_norm_rows` and `rope_write_kv_rows` inside its own kernel, each worker on a share of
the rows, and the grid's gate/up GEMM applies `silu_times` to its own outputs.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedinfer.kernels.cpu.numba_support import (
    FASTMATH,
    as_cached,
    cache_array,
    exp_into,
    fp32_cpu,
    jit,
    lanes_add,
    lanes_copy,
    lanes_div,
    lanes_fma,
    lanes_mul,
    lanes_silu_times,
    lanes_sum,
    prefetch_all,
    stack_array,
)

LANES = 16  # `silu_times` works on vectors of 16 fp32 values: a GEMM tile's outputs
# gelu_tanh(g) = g * sigmoid(GELU_SCALE * (g + GELU_CUBIC * g^3)): 0.5 * (1 + tanh(u)) is
# sigmoid(2u), with u = sqrt(2 / pi) * (g + 0.044715 * g^3).
GELU_SCALE = np.float32(2.0 * (2.0 / np.pi) ** 0.5)
GELU_CUBIC = np.float32(0.044715)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these kernels serve the tensors: fp32, on CPU, none tracked by autograd."""
    return fp32_cpu(*tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, per row of x [tokens, hidden]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    rms_norm_rows(_rows(x), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def silu_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up of gate_up [tokens, 2 * intermediate] = [gate | up]; gelu:
    gelu_tanh(gate) * up (`silu_times`)."""
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=gate_up.dtype)
    _silu_mul(rows, out.numpy(), gelu)
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    qk_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    rotary_dim: int | None = None,
    table: int = 0,
) -> None:
    """RMS-norm each q and k head where qk_norm is given (fp32 [2, head_dim]: the query
    and key norms' weights, with eps), rotate the first `rotary_dim` dims of each q and k
    head in place and store k and v at their cache slots.

    qkv: contiguous [tokens, (num_heads + 2 * num_kv_heads) * head_dim], the q/k/v
    GEMM's output (q heads, then k heads, then v heads). cos_sin: [tokens, 2 * tables,
    half], each token's cos and sin rows of one or more rotary tables (neox style: the two
    halves of the rotated dims form the pairs); `table` picks the layer's. rotary_dim: the
    rotated dims of each head, at most 2 * half (None: 2 * half; 0: none, a NoPE layer).
    slot_mapping: int64 [tokens]. k_cache, v_cache: contiguous [num_blocks, block_size,
    num_kv_heads, head_dim], fp32 or bf16 (k and v rounded to nearest, as torch rounds).
    Raises ValueError for a strided cache (the writes would land in a copy), a rotary
    dim or table the arguments do not hold, or a slot past the cache's end.
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_write_kv: k_cache and v_cache must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    half = cos_sin.shape[2]
    if rotary_dim is None:
        rotary_dim = 2 * half
    if rotary_dim % 2 or not 0 <= rotary_dim <= min(2 * half, head_dim):
        raise ValueError(
            f"rope_write_kv: rotary_dim {rotary_dim} must be even and at most "
            f"min(2 * {half}, head_dim {head_dim})"
        )
    if not 0 <= 2 * table < cos_sin.shape[1]:
        raise ValueError(f"rope_write_kv: table {table} is not among cos_sin's tables")
    shape = (num_blocks * block_size, num_kv_heads * head_dim)
    bad = rope_write_kv_rows(
        qkv.numpy(),
        cos_sin.numpy(),
        slot_mapping.numpy(),
        cache_array(k_cache).reshape(shape),
        cache_array(v_cache).reshape(shape),
        num_heads,
        num_kv_heads,
        _NO_QK_NORM if qk_norm is None else qk_norm.detach().float().contiguous().numpy(),
        np.float32(eps),
        rotary_dim,
        table,
    )
    if bad >= 0:
        raise ValueError(
            f"slot_mapping: slot {int(slot_mapping[bad])} of token {bad} is outside the "
            f"cache's {shape[0]} slots"
        )


# The q/k norm weights of a model without them: the same array type as a model's, so one
# compiled kernel serves both.
_NO_QK_NORM = np.zeros((0, 0), np.float32)


def _rows(x: torch.Tensor) -> np.ndarray:
    if not x.is_contiguous():
        x = x.contiguous()
    return x.numpy()


@jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x^2) + eps) * weight, per row of x [tokens, hidden]
    (`rms_norm_row`)."""
    acc = stack_array((LANES,))
    rest = stack_array((3, LANES))
    prefetch_all(x)  # written by every worker's GEMM tiles in the fused step
    for t in range(x.shape[0]):
        rms_norm_row(x[t], weight, eps, out[t], acc, rest)


@jit(fastmath=FASTMATH, inline="always", error_model="numpy")
def rms_norm_row(
    row: np.ndarray,
    weight: np.ndarray,
    eps: np.float32,
    out_row: np.ndarray,
    acc: np.ndarray,
    rest: np.ndarray,
) -> None:
    """out_row = row / sqrt(mean(row^2) + eps) * weight: a hidden state, or one query or
    key head (Qwen3's q/k norms); out_row may be row. acc: fp32 scratch [LANES]; rest:
    [3, LANES].

    Every step is an exact lane op in a fixed order: the squares summed in 16 lanes by
    fused multiply-adds, then across the lanes by halving, then scaled. Left to fast math,
    LLVM summed and scaled a row in one order here and in another where the fused step
    inlines this kernel (on AVX2), and the two paths' outputs came an ulp apart."""
    n = row.shape[0]
    whole = n - n % LANES  # the rest of a row goes in lanes of its own
    lanes_copy(acc, np.float32(0.0), LANES)
    for c in range(0, whole, LANES):
        lanes_fma(acc, row[c : c + LANES], row[c : c + LANES], LANES)
    if whole < n:
        lanes_copy(rest[0], np.float32(0.0), LANES)
        lanes_copy(rest[1], np.float32(0.0), LANES)
        for i in range(n - whole):
            rest[0, i] = row[whole + i]
            rest[1, i] = weight[whole + i]
        lanes_fma(acc, rest[0], rest[0], LANES)
    # 1 / sqrt(sum / n + eps), each operation rounded once, in lane 0.
    lanes_copy(acc, lanes_sum(acc, LANES), LANES)
    lanes_div(acc, acc, np.float32(n), LANES)
    lanes_add(acc, eps, LANES)
    lanes_copy(acc, np.sqrt(acc[0]), LANES)
    scale = acc[0]
    lanes_copy(acc, np.float32(1.0), LANES)
    lanes_div(acc, acc, scale, LANES)
    scale = acc[0]
    for c in range(0, whole, LANES):
        lanes_mul(out_row[c : c + LANES], row[c : c + LANES], scale, LANES)
        lanes_mul(out_row[c : c + LANES], out_row[c : c + LANES], weight[c : c + LANES], LANES)
    if whole < n:
        lanes_mul(rest[2], rest[0], scale, LANES)
        lanes_mul(rest[2], rest[2], rest[1], LANES)
        for i in range(n - whole):
            out_row[whole + i] = rest[2, i]


@jit(fastmath=FASTMATH, inline="always", error_model="numpy")
def silu_times(
    gate: np.ndarray,
    up: np.ndarray,
    out: np.ndarray,
    negative: np.ndarray,
    decay: np.ndarray,
    bits: np.ndarray,
    gelu: bool,
) -> None:
    """out = silu(gate) * up over n values (n: len(gate), a multiple of LANES): the
    SiLU-and-multiply of `silu_mul` and of the gate/up GEMM on its own outputs
    (`grid_gemm`), so that both give the same bits. negative, decay (fp32) and bits
    (int32): scratch of n or more. gelu: gelu_tanh(gate) * up instead, the same
    operations on z = GELU_SCALE * (g + GELU_CUBIC * g^3) in place of g inside the
    sigmoid (z has g's sign), so one kernel serves both activations.

    silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|), which cannot overflow:
    g / (1 + e) for g >= 0, g * e / (1 + e) below. After the exp each operation is
    rounded once (`numba_support.lanes_silu_times`): left to fast math, LLVM rounded them one
    way in a loop over a row and another over 16 values, an ulp apart."""
    n = gate.shape[0]
    if gelu:  # z in exact lane ops: g * (1 + GELU_CUBIC * g * g) * GELU_SCALE
        for c in range(0, n, LANES):
            z = negative[c : c + LANES]
            lanes_mul(z, gate[c : c + LANES], gate[c : c + LANES], LANES)
            lanes_mul(z, z, GELU_CUBIC, LANES)
            lanes_add(z, np.float32(1.0), LANES)
            lanes_mul(z, z, gate[c : c + LANES], LANES)
            lanes_mul(z, z, GELU_SCALE, LANES)
        for i in range(n):
            v = negative[i]
            negative[i] = min(v, -v)
    else:
        for i in range(n):
            g = gate[i]
            negative[i] = min(g, -g)
    exp_into(negative[:n], decay, bits)
    for c in range(0, n, LANES):
        lanes_silu_times(
            out[c : c + LANES], gate[c : c + LANES], decay[c:], up[c : c + LANES], LANES
        )


@jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
def _silu_mul(gate_up: np.ndarray, out: np.ndarray, gelu: bool) -> None:
    width = out.shape[1]
    whole = width - width % LANES  # the rest of a row goes in lanes of its own
    negative = np.empty(whole + LANES, dtype=np.float32)
    decay = np.empty(whole + LANES, dtype=np.float32)
    bits = np.empty(whole + LANES, dtype=np.int32)
    last = np.zeros((3, LANES), dtype=np.float32)  # gate, up and out of that rest
    for t in range(out.shape[0]):
        gate, up = gate_up[t, :whole], gate_up[t, width : width + whole]
        silu_times(gate, up, out[t, :whole], negative, decay, bits, gelu)
        if whole < width:
            for i in range(width - whole):
                last[0, i] = gate_up[t, whole + i]
                last[1, i] = gate_up[t, width + whole + i]
            silu_times(last[0], last[1], last[2], negative, decay, bits, gelu)
            for i in range(width - whole):
                out[t, whole + i] = last[2, i]


@jit(fastmath=FASTMATH, nogil=True, error_model="numpy")
def rope_write_kv_rows(
    qkv: np.ndarray,
    cos_sin: np.ndarray,
    slots: np.ndarray,
    k_rows: np.ndarray,
    v_rows: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: np.ndarray,
    eps: np.float32,
    rotary_dim: int,
    table: int,
) -> int:
    """qk_norm: fp32 [2, head_dim], the query and key heads' RMSNorm weights (Qwen3's),
    applied before the rotation; [0, 0] for a model without them. rotary_dim and table:
    the leading dims of each head that rotate (0: none) by cos_sin's rows 2 * table and
    2 * table + 1. Which layers rotate how many dims by which table is data, so one
    compiled kernel serves every family of a shape (NoPE layers, partial rotary, a rope
    of the local layers' own). Returns the first token whose slot is past the cache's
    end, or -1 (all written)."""
    width = k_rows.shape[1]
    head_dim = width // num_kv_heads
    half = rotary_dim // 2
    cos_row, sin_row = 2 * table, 2 * table + 1
    k_start = num_heads * head_dim
    v_start = k_start + width
    normed = qk_norm.shape[0] > 0
    acc = stack_array((LANES,))
    rest = stack_array((3, LANES))
    prefetch_all(qkv)  # written by every worker's GEMM tiles in the fused step
    for t in range(qkv.shape[0]):
        row = qkv[t]
        for h in range(num_heads + num_kv_heads):
            first = h * head_dim
            if normed:
                head = row[first : first + head_dim]
                weight = qk_norm[0] if h < num_heads else qk_norm[1]
                rms_norm_row(head, weight, eps, head, acc, rest)
            for j in range(half):
                cos, sin = cos_sin[t, cos_row, j], cos_sin[t, sin_row, j]
                x1, x2 = qkv[t, first + j], qkv[t, first + half + j]
                qkv[t, first + j] = x1 * cos - x2 * sin
                qkv[t, first + half + j] = x2 * cos + x1 * sin
        slot = slots[t]
        if slot < 0:
            continue
        if slot >= k_rows.shape[0]:
            return t
        for j in range(width):
            k_rows[slot, j] = as_cached(k_rows, qkv[t, k_start + j])
            v_rows[slot, j] = as_cached(v_rows, qkv[t, v_start + j])
    return -1
