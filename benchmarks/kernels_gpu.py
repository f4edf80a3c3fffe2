"""Paged-attention kernel benchmark for a machine with an NVIDIA GPU (scripts/bench_gpu.sh).

Three measurements, side by side in one run, on Llama-3-8B's attention shape (32 query
heads, 8 KV heads, head_dim 128, bf16, block size 16):

1. Decode bandwidth over a grid of batch x context length: KV bytes the kernel must
   read per second, as a percentage of the GPU's peak HBM bandwidth (a table of known
   cards, or --peak-gbps) and of a device-to-device copy measured in the same run.
2. Paged versus contiguous: the same K/V laid out contiguously per sequence and run
   through torch's scaled_dot_product_attention (flash), and our kernel on an identity
   block table (contiguous blocks) to isolate the cost of scattered blocks.
3. Prefill TFLOP/s (causal, counted as 4 * heads * head_dim * L * (L + 1) / 2 per
   sequence), against SDPA with is_causal on the same data.

Goals (issue 3): >= 70% of peak HBM bandwidth at >= 256k KV tokens per layer, paged
within 10% of contiguous. Prints a table and one JSON summary, saves JSON and a PNG
under benchmarks/results/. Takes about 2 minutes; --quick is a few seconds.

    bash scripts/bench_gpu.sh              # the full grid
    bash scripts/bench_gpu.sh --quick      # a smaller grid
    python benchmarks/kernels_gpu.py --smoke   # CPU only: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedinfer.kernels import paged_attention, torch_ops

RESULTS = Path(__file__).resolve().parent / "results"

# Peak HBM bandwidth in GB/s by device-name fragment (vendor data sheets).
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H20": 4000.0,
    "GH200": 4000.0,
    "B200": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "V100": 900.0,
    "T4": 320.0,
}


def peak_bandwidth_gbps(name: str) -> float | None:
    for fragment, gbps in PEAK_GBPS.items():  # most specific fragments come first
        if fragment in name:
            return gbps
    return None


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


class Shape:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size


def paged_batch(
    shape: Shape,
    seq_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> dict:
    """A batch whose sequences fill the cache exactly, its physical blocks permuted."""
    b = shape.block_size
    blocks_per_seq = [math.ceil(n / b) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, b, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[start : start + n].int()
        start += n
    qsl = torch.tensor([0, *query_lens]).cumsum(0).int()
    query = torch.randn(int(qsl[-1]), shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    return {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": qsl.to(device),
        "scale": shape.head_dim**-0.5,
    }


def contiguous_kv(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's K/V as [num_seqs, kv_heads, seq_len, head_dim] (all seq_lens equal)."""
    seq_len = int(batch["seq_lens"][0])
    tables = batch["block_tables"].long()
    k = batch["k_cache"][tables].flatten(1, 2)[:, :seq_len]
    v = batch["v_cache"][tables].flatten(1, 2)[:, :seq_len]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def identity_tables(batch: dict) -> dict:
    """The same batch reading its blocks in physical order (equal seq_lens fill the cache)."""
    tables = batch["block_tables"]
    order = torch.arange(tables.numel(), dtype=tables.dtype, device=tables.device)
    return {**batch, "block_tables": order.view(tables.shape)}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], object]:
    """Contiguous attention through SDPA, on the flash backend where it takes the shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run() -> object:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def flash() -> object:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return run()

    if q.is_cuda:
        try:
            flash()
            return flash
        except RuntimeError:
            pass
    return run


def run_attention(batch: dict) -> Callable[[], object]:
    out = torch.empty_like(batch["query"])
    args = {**batch, "out": out, "check_values": False}
    return lambda: paged_attention(**args)


def decode_grid(args: argparse.Namespace, shape: Shape, device: torch.device) -> list[dict]:
    rows = []
    element = torch.finfo(args.dtype).bits // 8
    for batch_size in args.batches:
        for context in args.contexts:
            kv_tokens = batch_size * context
            if kv_tokens > args.max_kv_tokens:
                continue
            batch = paged_batch(shape, [context] * batch_size, [1] * batch_size, args.dtype, device)
            kv_bytes = 2 * kv_tokens * shape.num_kv_heads * shape.head_dim * element
            paged_ms = time_ms(run_attention(batch), device)

            identity_ms = time_ms(run_attention(identity_tables(batch)), device)
            k, v = contiguous_kv(batch)
            q = batch["query"].view(batch_size, shape.num_heads, 1, shape.head_dim)
            sdpa_ms = time_ms(sdpa(q, k, v, causal=False), device)
            del k, v, batch
            rows.append(
                {
                    "batch": batch_size,
                    "context": context,
                    "kv_tokens": kv_tokens,
                    "kv_mb": kv_bytes / 1e6,
                    "paged_ms": paged_ms,
                    "paged_gbps": kv_bytes / paged_ms / 1e6,
                    "identity_table_ms": identity_ms,
                    "sdpa_contiguous_ms": sdpa_ms,
                    "sdpa_gbps": kv_bytes / sdpa_ms / 1e6,
                    "paged_over_contiguous": paged_ms / sdpa_ms,
                }
            )
            print_row(rows[-1], args.peak_gbps)
    return rows


def prefill_grid(args: argparse.Namespace, shape: Shape, device: torch.device) -> list[dict]:
    rows = []
    for seq_len in args.prefill_lens:
        num_seqs = max(1, args.prefill_tokens // seq_len)
        batch = paged_batch(shape, [seq_len] * num_seqs, [seq_len] * num_seqs, args.dtype, device)
        flops = num_seqs * 4 * shape.num_heads * shape.head_dim * seq_len * (seq_len + 1) / 2
        paged_ms = time_ms(run_attention(batch), device)
        k, v = contiguous_kv(batch)
        q = batch["query"].view(num_seqs, seq_len, shape.num_heads, shape.head_dim).transpose(1, 2)
        sdpa_ms = time_ms(sdpa(q, k, v, causal=True), device)
        del k, v, batch
        row = {
            "seq_len": seq_len,
            "num_seqs": num_seqs,
            "paged_ms": paged_ms,
            "paged_tflops": flops / paged_ms / 1e9,
            "sdpa_ms": sdpa_ms,
            "sdpa_tflops": flops / sdpa_ms / 1e9,
        }
        rows.append(row)
        print(
            f"prefill L={seq_len:6d} x{num_seqs:4d}  paged {row['paged_tflops']:7.1f} TFLOP/s"
            f"  sdpa {row['sdpa_tflops']:7.1f} TFLOP/s"
        )
    return rows


def print_row(row: dict, peak: float | None) -> None:
    of_peak = f"{100 * row['paged_gbps'] / peak:5.1f}%" if peak else "  n/a"
    print(
        f"decode B={row['batch']:4d} ctx={row['context']:6d} kv={row['kv_mb']:8.1f} MB  "
        f"paged {row['paged_ms']:7.3f} ms {row['paged_gbps']:7.0f} GB/s ({of_peak} of peak)  "
        f"identity-table {row['identity_table_ms']:7.3f} ms  "
        f"sdpa {row['sdpa_contiguous_ms']:7.3f} ms  paged/sdpa {row['paged_over_contiguous']:5.2f}"
    )


def copy_bandwidth_gbps(device: torch.device) -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / ms / 1e6  # read + write


def check_correctness(shape: Shape, dtype: torch.dtype, device: torch.device) -> float:
    """Max difference between the benchmarked backend and the torch path on a mixed batch."""
    batch = paged_batch(shape, [300, 1000, 77, 513], [1, 200, 77, 1], dtype, device)
    got = paged_attention(**batch).float().cpu()
    cpu_batch = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    cpu_batch = {
        k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in cpu_batch.items()
    }
    want = torch_ops.paged_attention(**cpu_batch)
    return float((got - want).abs().max())


def save_plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    peak = summary["setup"]["peak_gbps"]
    for batch_size in sorted({r["batch"] for r in summary["decode"]}):
        rows = [r for r in summary["decode"] if r["batch"] == batch_size]
        left.plot(
            [r["kv_tokens"] for r in rows],
            [r["paged_gbps"] for r in rows],
            "o-",
            label=f"paged B={batch_size}",
        )
    left.plot(
        [r["kv_tokens"] for r in summary["decode"]],
        [r["sdpa_gbps"] for r in summary["decode"]],
        "k.",
        label="contiguous SDPA",
    )
    if peak:
        left.axhline(peak, color="gray", linestyle="--", label="peak HBM")
        left.axhline(0.7 * peak, color="gray", linestyle=":", label="70% of peak")
    left.set_xscale("log")
    left.set_xlabel("KV tokens per layer")
    left.set_ylabel("GB/s of KV read")
    left.set_title("Decode attention bandwidth")
    left.legend(fontsize=7)
    prefill = summary["prefill"]
    right.plot(
        [r["seq_len"] for r in prefill], [r["paged_tflops"] for r in prefill], "o-", label="paged"
    )
    right.plot(
        [r["seq_len"] for r in prefill],
        [r["sdpa_tflops"] for r in prefill],
        "s--",
        label="contiguous SDPA",
    )
    right.set_xscale("log")
    right.set_xlabel("prefill length")
    right.set_ylabel("TFLOP/s")
    right.set_title("Causal prefill")
    right.legend()
    fig.suptitle(summary["setup"]["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: test the script")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override peak HBM GB/s")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--out", default=str(RESULTS / "kernels_gpu.json"), help="JSON path")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)

    shape = Shape(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    if args.smoke:
        device = torch.device("cpu")
        args.dtype = torch.float32
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
        args.batches, args.contexts, args.max_kv_tokens = [1, 4], [64, 256], 1 << 20
        args.prefill_lens, args.prefill_tokens = [64, 128], 256
        args.out = str(Path(args.out).with_name("kernels_gpu_smoke.json"))
    elif not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA device; run it on a machine with an NVIDIA GPU (or --smoke)")
        return 2
    else:
        device = torch.device("cuda")
        quick = args.quick
        args.batches = [1, 16, 64, 256] if quick else [1, 4, 16, 32, 64, 128, 256]
        args.contexts = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
        args.max_kv_tokens = 1 << 21  # 2M tokens: 8 GB of bf16 K/V per layer
        args.prefill_lens = [512, 2048] if quick else [512, 1024, 2048, 4096, 8192]
        args.prefill_tokens = 16384

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    if args.peak_gbps is None and device.type == "cuda":
        args.peak_gbps = peak_bandwidth_gbps(name)
    torch.manual_seed(0)
    started = time.time()
    max_error = check_correctness(shape, args.dtype, device)
    copy_gbps = copy_bandwidth_gbps(device)
    print(
        f"{name}: peak {args.peak_gbps} GB/s, measured copy {copy_gbps:.0f} GB/s, max |paged - torch path| {max_error:.2e}"
    )
    decode = decode_grid(args, shape, device)
    prefill = prefill_grid(args, shape, device)

    big = [r for r in decode if r["kv_tokens"] >= 256 * 1024]
    summary = {
        "setup": {
            "device": name,
            "dtype": str(args.dtype).removeprefix("torch."),
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "block_size": shape.block_size,
            "peak_gbps": args.peak_gbps,
            "copy_gbps": copy_gbps,
            "max_abs_error_vs_torch_path": max_error,
            "seconds": time.time() - started,
        },
        "goals": {
            "min_pct_of_peak_at_256k_tokens": (
                min(100 * r["paged_gbps"] / args.peak_gbps for r in big)
                if big and args.peak_gbps
                else None
            ),
            "max_paged_over_contiguous_at_256k_tokens": (
                max(r["paged_over_contiguous"] for r in big) if big else None
            ),
        },
        "decode": decode,
        "prefill": prefill,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(summary, indent=2)
    out.write_text(text + "\n")
    save_plot(summary, out.with_suffix(".png"))
    print(json.dumps({"setup": summary["setup"], "goals": summary["goals"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
