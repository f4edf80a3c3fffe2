"""The GEMMs the CPU executor runs, one object per weight: the matmul library's packed
layouts (MKL's for fp32, oneDNN's for bf16 where the CPU has native bf16) and the grid
GEMM (`grid_gemm`) for weights in its tile layouts (a quantisation grid, fp32 or bf16).

Each takes x [rows, in_features] and gives x @ W.T (+ bias), or adds it into `out`.
A packed weight serves a batch of any size; the batch hint only tunes its layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedinfer.kernels import torch_ops

# The batch sizes the libraries tune a packed layout for (any batch runs on it).
ONEDNN_BATCH_HINT = 32
MKL_BATCH_HINT = 128


def onednn_bf16_available(dtype: torch.dtype) -> bool:
    """Whether bf16 weights can be packed for oneDNN's AMX/AVX512-BF16 GEMMs on this CPU."""
    return (
        dtype == torch.bfloat16
        and torch_ops.native_bf16()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def amx_bf16() -> bool:
    """Whether this CPU has AMX tiles (as the matmul library sees it)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(probe()) and torch.backends.mkldnn.is_available()


def mkl_fp32_available(dtype: torch.dtype) -> bool:
    """Whether fp32 weights can be packed for MKL's sgemm (torch built with MKL)."""
    return (
        dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


class Gemm(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None: ...


@dataclass
class OneDnnGemm:
    """A bf16 weight in oneDNN's blocked layout."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = ONEDNN_BATCH_HINT
    ) -> OneDnnGemm:
        """weight: [out_features, in_features], nn.Linear's layout (a view is fine)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        return cls(packed, None if bias is None else bias.detach(), weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out += self(x)


@dataclass
class MklGemm:
    """An fp32 weight in MKL's packed layout.

    torch's `_mkl_linear` also takes the dense weight, which it reads only when the batch
    size it is told differs from the input's; we always tell it the input's, so a
    one-element stand-in of the right shape takes the dense weight's place.
    """

    packed: torch.Tensor
    shape_only: torch.Tensor
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = MKL_BATCH_HINT
    ) -> MklGemm:
        """weight: [out_features, in_features], nn.Linear's layout (a view is fine)."""
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        shape_only = torch.zeros(1, dtype=weight.dtype).expand(weight.shape)
        return cls(packed, shape_only, None if bias is None else bias.detach(), weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape_only, self.bias, x.shape[0])

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out += self(x)


@dataclass
class GridGemm:
    """A weight held as its quantisation grid (`grid_gemm.GridWeight`), summed in one
    fixed order, so that a row gets the same bits in a batch of any size. A bias is added
    to the product, rounded once more, as the fused step adds q/k/v's."""

    weight: object  # grid_gemm.GridWeight
    order: object  # grid_gemm.SumOrder
    bias: torch.Tensor | None = None  # fp32 [out_features]

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagedinfer.kernels.cpu import grid_gemm

        out = grid_gemm.grid_linear(x.contiguous(), self.weight, self.order)
        if self.bias is not None:
            out += self.bias
        return out

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        from pagedinfer.kernels.cpu import grid_gemm

        if out.is_contiguous() and self.bias is None:
            grid_gemm.grid_linear(x.contiguous(), self.weight, self.order, out=out, add=True)
        else:
            out += self(x)


@dataclass
class DenseGemm:
    """A weight as the checkpoint gives it, for CPUs where neither library layout applies."""

    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseGemm:
        bias = None if bias is None else bias.detach()
        return cls(weight.detach(), bias, weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.addmm_(x, self.weight.t())
        if self.bias is not None:
            out += self.bias
