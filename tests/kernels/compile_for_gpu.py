"""Compile the Triton kernels for NVIDIA GPUs without a GPU: Triton IR -> PTX -> cubin.

The interpreter checks what the kernels compute but not that they compile: it accepts
code the GPU compiler rejects (types that change inside a loop, dot shapes below the
tensor-core minimum, shared memory past the limit). Triton's wheel carries LLVM and
ptxas, so the whole pipeline runs on a CPU-only machine. The constants come from the
launchers' own heuristics, so this compiles exactly what they would launch.

Run as a script, in a process without TRITON_INTERPRET (test_gpu_compile.py does):
prints one line per kernel and exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedinfer.kernels import triton_ops

TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def signature(kernel, constants: dict, pointers: dict[str, str], floats: tuple = ()) -> dict:
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = pointers[name]
        else:
            types[name] = "fp32" if name in floats else "i32"
    return types


def compile_kernel(kernel, meta: dict, pointers: dict, target: GPUTarget, floats=()) -> str:
    constants = {k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS}
    options = {k: v for k, v in meta.items() if k in LAUNCH_OPTIONS}
    source = ASTSource(kernel, signature(kernel, constants, pointers, floats), constexprs=constants)
    compiled = triton.compile(source, target=target, options=options)
    return f"shared {compiled.metadata.shared} B"


def attention_cases() -> list[tuple[str, dict, torch.dtype]]:
    llama = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
    smollm = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16}
    return [
        ("decode llama bf16", {**llama, "decode_only": True, "num_splits": 1}, torch.bfloat16),
        (
            "split decode llama bf16",
            {**llama, "decode_only": True, "num_splits": 8},
            torch.bfloat16,
        ),
        ("prefill llama bf16", {**llama, "decode_only": False, "num_splits": 1}, torch.bfloat16),
        ("prefill smollm2 fp16", {**smollm, "decode_only": False, "num_splits": 1}, torch.float16),
    ]


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") != "1", "compile in a process without the interpreter"
    targets = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)]
    jobs = []
    for target in targets:
        for name, shape, dtype in attention_cases():
            meta = triton_ops.attention_meta(dtype=dtype, **shape)
            ptr = f"*{TYPE[dtype]}"
            pointers = {
                "out_ptr": ptr,
                "query_ptr": ptr,
                "k_cache_ptr": ptr,
                "v_cache_ptr": ptr,
                "partial_out_ptr": "*fp32",
                "partial_max_ptr": "*fp32",
                "partial_sum_ptr": "*fp32",
                "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32",
                "query_start_loc_ptr": "*i32",
            }
            jobs.append(
                (name, target, triton_ops._paged_attention_kernel, meta, pointers, ("scale_log2",))
            )
            if target.arch != 90:
                break  # one configuration is enough to cover the older architecture
        write_pointers = {
            "key_ptr": "*bf16",
            "value_ptr": "*bf16",
            "k_cache_ptr": "*bf16",
            "v_cache_ptr": "*bf16",
            "slot_ptr": "*i64",
        }
        jobs.append(
            (
                "write_kv bf16",
                target,
                triton_ops._write_kv_kernel,
                triton_ops.write_kv_meta(8, 128),
                write_pointers,
                (),
            )
        )
        reduce_pointers = {
            "out_ptr": "*bf16",
            "partial_out_ptr": "*fp32",
            "partial_max_ptr": "*fp32",
            "partial_sum_ptr": "*fp32",
        }
        jobs.append(
            (
                "reduce splits bf16",
                target,
                triton_ops._reduce_splits_kernel,
                triton_ops.reduce_meta(32, 128, 8),
                reduce_pointers,
                (),
            )
        )
    for name, target, kernel, meta, pointers, floats in jobs:
        start = time.perf_counter()
        detail = compile_kernel(kernel, meta, pointers, target, floats)
        print(f"sm_{target.arch} {name}: ok in {time.perf_counter() - start:.1f} s, {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
