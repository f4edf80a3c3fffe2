"""The GPU path proven in one prepared run (scripts/gpu_check.sh), at most 8 minutes on an H200.

    bash scripts/gpu_check.sh OUTDIR             # on a machine with an NVIDIA GPU
    bash scripts/gpu_check.sh --dry-run OUTDIR   # the same steps on CPU at toy sizes (CI)

Writes OUTDIR/gpu_check.json (every section's figures and checks), OUTDIR/gpu_check.log
(what each section printed, its tail) and kernels_gpu's JSON and PNG. Sections, in order:

- kernel_tests: tests/kernels' Triton tests through pytest, compiled for the GPU
  (TRITON_INTERPRET unset; the dry run takes two of them in the interpreter).
- kernel_cases: paged attention at serving shapes against `kernels/reference.py`: 32k-token
  contexts (split-KV decode, and a prefill chunk after a 32k prefix-cache hit), GQA ratios
  1-8, head dims 64 and 128, block sizes 16 and 32, bf16 and fp32.
- engine: the engine on CUDA in fp32 and bf16, on random-weight models built on the spot
  with transformers' own classes in SmolLM2-135M's shape and a Llama-3.2-1B-like shape;
  greedy tokens against transformers' `generate` on the same weights, batched, under
  forced preemption (a tiny KV budget) and with prefix caching. fp32 must be identical
  (a divergence is excused only at a near tie in transformers' own logits); bf16 reports
  its agreement.
- bandwidth: benchmarks/kernels_gpu.py --quick: decode attention bandwidth as a share of
  the card's peak HBM bandwidth, paged against contiguous attention time, prefill TFLOP/s.
- throughput: a mixed workload of 256 requests through the engine and through
  transformers' continuous batching (benchmarks/throughput.py drives both), same model,
  dtype and KV budget.

Each section runs in a process of its own under its own time box: a CUDA fault, a hang or
a missing package in one is recorded in the JSON and the next one runs. A section writes
its results as it goes, so one stopped at the end of its box keeps what it finished.

The GPU host needs nothing installed and nothing from a network: Python >= 3.11 with
torch, triton, numpy, transformers, tokenizers, safetensors, tqdm and pytest (the usual
PyTorch image has them all; matplotlib, if there, draws kernels_gpu's plot). The rest of
pyproject's dependencies are never imported (`NOT_NEEDED`, which the dry run makes
unimportable): numba (the CPU kernels), kopf, kubernetes_asyncio, the OpenTelemetry
packages and prometheus_client (control plane and metrics), grpcio and protobuf (the
server), gguf and accelerate (the embedded model's conversion).
pagedinfer is imported from this checkout through a folder of links that maps the import
names to the folders as pyproject's package-dir does, so no pip install is needed either.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULT_NAME = "gpu_check.json"
LOG_NAME = "gpu_check.log"
# The whole run's limit on the GPU host, with room for the processes' start and the copy back.
GPU_TOTAL_S = 470.0
DRY_TOTAL_S = 600.0
# What the run imports on the GPU host (module names); `host_packages` reports them.
REQUIRED_MODULES = (
    "torch",
    "triton",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "tqdm",
    "pytest",
)
OPTIONAL_MODULES = ("matplotlib",)
# Dependencies (distribution: module) that the run never imports; the dry run makes them
# unimportable, as they may be on a GPU host.
NOT_NEEDED = {
    "numba": "numba",
    "kopf": "kopf",
    "kubernetes_asyncio": "kubernetes_asyncio",
    "opentelemetry-sdk": "opentelemetry",
    "prometheus-client": "prometheus_client",
    "grpcio": "grpc",
    "protobuf": "google.protobuf",
    "gguf": "gguf",
    "accelerate": "accelerate",
}
# Relative tolerance of the kernels against the float64 reference, per dtype: bf16 rounds
# the attention weights to 8 bits before they multiply V.
KERNEL_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
# A fp32 token that differs from transformers' is excused only where transformers' own
# logits of the two tokens are closer than this: a tie that summation order decides.
NEAR_TIE = 1e-3
# bf16 differs from transformers' bf16 in rounding, so a continuation may part ways early;
# a broken path disagrees from the first token on.
BF16_MIN_FIRST_TOKEN_AGREEMENT = 0.5


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape: LlamaConfig's arguments."""

    name: str
    config: dict[str, Any]


SMOLLM2_135M = ModelShape(
    "smollm2-135m",
    {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True,
    },
)
LLAMA_32_1B = ModelShape(
    "llama-3.2-1b",
    {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
)
# The same features at toy sizes: tied embeddings, GQA 3 and 4, llama3 rope scaling.
TOY_SMOLLM2 = ModelShape(
    "smollm2-135m-toy",
    {
        **SMOLLM2_135M.config,
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
)
TOY_LLAMA_1B = ModelShape(
    "llama-3.2-1b-toy",
    {
        **LLAMA_32_1B.config,
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rope_parameters": {
            **LLAMA_32_1B.config["rope_parameters"],
            "original_max_position_embeddings": 64,
        },
    },
)


@dataclass(frozen=True)
class KernelCase:
    """One paged_attention call: a batch of sequences, each its context and new tokens."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the real one on a GPU, or toy sizes for the dry run on CPU."""

    dry_run: bool
    device: str
    kernel_tests_filter: str
    kernel_cases: tuple[KernelCase, ...]
    models: tuple[ModelShape, ...]
    prompt_lens: tuple[int, ...]
    new_tokens: int
    shared_prefix: int
    max_model_len: int
    max_num_batched_tokens: int
    num_blocks: int
    throughput_model: ModelShape
    throughput_requests: int
    prompt_mean: int
    output_mean: int
    throughput_max_len: int
    throughput_kv_tokens: int
    budgets: dict[str, float] = field(default_factory=dict)


def kernel_cases(
    decodes: tuple[int, ...],
    long_kv_heads: int,
    mixed: tuple[tuple[int, ...], tuple[int, ...]],
    mixed_kv_heads: int,
    grid: list[tuple[int, int, int, str]],
) -> tuple[KernelCase, ...]:
    """Long contexts first: a decode batch of `decodes` contexts (few enough sequences to
    take the split-KV path), a prefill chunk after a prefix hit as long as the longest,
    and a fp32 decode; then the `mixed` batch at each (GQA group, head_dim, block, dtype)."""
    longest = max(decodes)
    k = longest // 1024
    cases = [
        KernelCase(
            f"decode {k}k split-KV",
            4 * long_kv_heads,
            long_kv_heads,
            128,
            16,
            decodes,
            (1,) * len(decodes),
        ),
        KernelCase(
            f"prefill chunk after a {k}k prefix hit",
            4 * long_kv_heads,
            long_kv_heads,
            128,
            16,
            (longest,),
            (32,),
        ),
        KernelCase(
            f"decode {k}k fp32",
            8 * long_kv_heads,
            long_kv_heads,
            64,
            32,
            (longest,),
            (1,),
            "float32",
        ),
    ]
    seq_lens, query_lens = mixed
    for group, head_dim, block_size, dtype in grid:
        cases.append(
            KernelCase(
                f"mixed gqa{group} d{head_dim} b{block_size} {dtype}",
                group * mixed_kv_heads,
                mixed_kv_heads,
                head_dim,
                block_size,
                seq_lens,
                query_lens,
                dtype,
            )
        )
    return tuple(cases)


# A decode, a full prefill, a prefill chunk after an earlier chunk (37 new after 263), a
# prefill after a block-aligned prefix-cache hit (64 after 256) and a longer decode.
GPU_MIXED = ((1025, 160, 300, 320, 4097), (1, 160, 37, 64, 1))
DRY_MIXED = ((65, 20, 40, 48), (1, 20, 9, 16))
GPU_GRID = [
    (1, 128, 16, "bfloat16"),
    (2, 128, 16, "bfloat16"),
    (4, 128, 16, "bfloat16"),
    (8, 128, 16, "bfloat16"),
    (4, 64, 16, "bfloat16"),
    (4, 64, 32, "bfloat16"),
    (4, 128, 32, "bfloat16"),
    (4, 128, 16, "float32"),
]
DRY_GRID = [(1, 64, 16, "bfloat16"), (4, 128, 32, "bfloat16"), (8, 64, 32, "float32")]

GPU_PLAN = Plan(
    dry_run=False,
    device="cuda",
    kernel_tests_filter="triton or split or public_api or test_validation",
    # Llama-3-8B's attention at 32k contexts (32 heads over 8 KV heads), 4 KV heads mixed.
    kernel_cases=kernel_cases((32768, 16387), 8, GPU_MIXED, 4, GPU_GRID),
    models=(SMOLLM2_135M, LLAMA_32_1B),
    prompt_lens=(1, 7, 16, 31, 100, 257, 600, 1000),
    new_tokens=32,
    shared_prefix=512,
    max_model_len=2048,
    max_num_batched_tokens=512,
    num_blocks=1024,
    throughput_model=LLAMA_32_1B,
    throughput_requests=256,
    prompt_mean=161,
    output_mean=128,
    throughput_max_len=1024,
    throughput_kv_tokens=256 * 1024,
    budgets={
        "kernel_tests": 90,
        "kernel_cases": 60,
        "engine": 150,
        "bandwidth": 50,
        "throughput": 110,
    },
)
DRY_PLAN = Plan(
    dry_run=True,
    device="cpu",
    kernel_tests_filter="triton and (group3 or strided_key)",
    # The interpreter counts one multiprocessor: one sequence over one KV head splits.
    kernel_cases=kernel_cases((1024,), 1, DRY_MIXED, 1, DRY_GRID),
    models=(TOY_SMOLLM2, TOY_LLAMA_1B),
    prompt_lens=(1, 5, 17, 40),
    new_tokens=8,
    shared_prefix=40,
    max_model_len=128,
    max_num_batched_tokens=32,
    num_blocks=64,
    throughput_model=TOY_LLAMA_1B,
    throughput_requests=8,
    prompt_mean=16,
    output_mean=8,
    throughput_max_len=128,
    throughput_kv_tokens=1024,
    # Hard limits for a loaded CI machine; the whole dry run takes about a minute.
    budgets={
        name: 150 for name in ("kernel_tests", "kernel_cases", "engine", "bandwidth", "throughput")
    },
)


# --------------------------------------------------------------------------- recording


class Recorder:
    """A section's results, rewritten to its file after every change, so that what a
    section finished survives its being stopped at the end of its time box."""

    def __init__(self, path: Path, deadline: float):
        self.path = path
        self.deadline = deadline
        self.data: dict[str, Any] = {"checks": [], "skipped": []}
        self.flush()

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def check(self, name: str, passed: bool, **details: Any) -> bool:
        self.data["checks"].append({"name": name, "passed": bool(passed), **details})
        self.flush()
        print(f"  {'ok  ' if passed else 'FAIL'} {name} {json.dumps(details)[:300]}", flush=True)
        return bool(passed)

    def time_left(self) -> float:
        return self.deadline - time.time()

    def has_time(self, name: str, needed: float) -> bool:
        """Whether about `needed` seconds remain for `name`; records it as skipped if not."""
        if self.time_left() >= needed:
            return True
        self.data["skipped"].append({"name": name, "reason": "time box"})
        self.flush()
        print(f"  skip {name}: time box", flush=True)
        return False

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a part of the section; an exception there fails its check and the rest runs."""
        try:
            yield
        except Exception as err:
            traceback.print_exc()
            self.check(name, False, error=f"{type(err).__name__}: {err}"[:1000], at=_where(err))

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    name = Path(last.filename)
    with contextlib.suppress(ValueError):
        name = name.resolve().relative_to(REPO)
    return f"{name}:{last.lineno} in {last.name}"


def section_status(data: dict[str, Any]) -> str:
    """failed (a check failed, or none ran), timeout (parts skipped for time) or passed."""
    if any(not c["passed"] for c in data.get("checks", [])):
        return "failed"
    if data.get("skipped"):
        return "timeout"
    return "passed" if data.get("checks") else "failed"


def device_info(plan: Plan) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            fp32_matmul_precision=torch.get_float32_matmul_precision(),
        )
    else:
        info["name"] = "cpu (dry run)"
    info["triton_interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    import pagedinfer.service

    # The folder of links (`make_import_shim`) or an installed package.
    shim = os.environ.get("GPU_CHECK_SHIM")
    linked = shim is not None and Path(pagedinfer.service.__file__).is_relative_to(shim)
    info["pagedinfer_from"] = "links" if linked else "installed"
    # The modules this process holds as not installed (the dry run's sitecustomize).
    info["made_absent"] = [
        m for m in NOT_NEEDED.values() if m in sys.modules and not sys.modules[m]
    ]
    return info


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- kernel_tests


class _TestOutcomes:
    """A pytest plugin: each test's outcome into the recorder as it happens; stops the
    session at the deadline."""

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failures: list[dict[str, str]] = []
        self.session: Any = None

    def pytest_sessionstart(self, session: Any) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.counts["failed"] += 1
            lines = report.longreprtext.strip().splitlines() or [""]
            self.failures.append(
                {"test": report.nodeid, "when": report.when, "message": lines[-1][:300]}
            )
        elif report.skipped:
            self.counts["skipped"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1
        self.rec.put("tests", {**self.counts, "failures": self.failures[:30]})
        if self.rec.time_left() < 0 and self.session is not None:
            self.session.shouldstop = "gpu_check: time box"


def run_kernel_tests(rec: Recorder, plan: Plan, outdir: Path, work: Path) -> None:
    """tests/kernels' Triton tests through pytest, on the GPU (the interpreter in the dry run)."""
    import pytest

    files = [
        "tests/kernels/test_paged_attention.py",
        "tests/kernels/test_write_kv.py",
        "tests/kernels/test_validation.py",
    ]
    args = ["-q", "-p", "no:cacheprovider", "-k", plan.kernel_tests_filter, *files]
    rec.put("pytest_args", args)
    outcomes = _TestOutcomes(rec)
    started = time.perf_counter()
    code = int(pytest.main(args, plugins=[outcomes]))
    rec.put("seconds_in_pytest", round(time.perf_counter() - started, 1))
    rec.put("pytest_exit_code", code)
    if outcomes.session is not None and outcomes.session.shouldstop:
        rec.data["skipped"].append({"name": "remaining kernel tests", "reason": "time box"})
    rec.check(
        "tests/kernels Triton tests",
        code == 0 and outcomes.counts["passed"] > 0,
        tests=outcomes.counts,
    )


# --------------------------------------------------------------------------- kernel_cases


def run_kernel_cases(rec: Recorder, plan: Plan, outdir: Path, work: Path) -> None:
    """paged_attention at the plan's serving shapes against the float64 reference."""
    import kernels_gpu
    import torch

    from pagedinfer.kernels import paged_attention
    from pagedinfer.kernels.reference import paged_attention_reference
    from pagedinfer.kernels.triton_ops import choose_num_splits

    device = torch.device(plan.device)
    rows = []
    for case in plan.kernel_cases:
        if not rec.has_time(case.name, 5):
            continue
        with rec.step(case.name):
            dtype = getattr(torch, case.dtype)
            shape = kernels_gpu.Shape(
                case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
            )
            torch.manual_seed(0)
            batch = kernels_gpu.paged_batch(
                shape, list(case.seq_lens), list(case.query_lens), dtype, device
            )
            # Peaked attention, so that reading a wrong position shows: scores of std 4.
            batch["query"] = batch["query"] * 4
            start = time.perf_counter()
            got = paged_attention(**batch).float().cpu()
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start
            host = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            want = paged_attention_reference(
                host["query"].float(),
                host["k_cache"].float(),
                host["v_cache"].float(),
                host["block_tables"],
                host["seq_lens"],
                host["query_start_loc"],
                host["scale"],
            )
            scale = float(want.abs().max())
            error = float((got - want).abs().max()) / max(scale, 1e-6)
            num_tokens = int(host["query_start_loc"][-1])
            row = {
                **asdict(case),
                "num_splits": choose_num_splits(
                    num_tokens,
                    len(case.seq_lens),
                    case.num_kv_heads,
                    batch["block_tables"].shape[1] * case.block_size,
                    device,
                ),
                "relative_error": error,
                "tolerance": KERNEL_TOLERANCE[case.dtype],
                "finite": bool(torch.isfinite(got).all()),
                "first_call_s": round(first_call_s, 2),
            }
            rows.append(row)
            rec.put("cases", rows)
            rec.check(
                case.name,
                row["finite"] and error <= row["tolerance"],
                relative_error=f"{error:.2e}",
                num_splits=row["num_splits"],
            )
            del batch, host
            free_device_memory()
    if rec.has_time("engine on the Triton kernels", 20):
        with rec.step("engine on the Triton kernels"):
            engine_on_triton(rec, plan, work)


def engine_on_triton(rec: Recorder, plan: Plan, work: Path) -> None:
    """A toy model's greedy tokens with the engine's attention and KV writes on the Triton
    kernels: the dry run covers the engine's calls of the kernels here, in the interpreter."""
    import torch

    from pagedinfer.service import LLM, SamplingParams

    path, hf = build_model(TOY_SMOLLM2, work)
    prompts = random_prompts((3, 20, 37), TOY_SMOLLM2.config["vocab_size"], seed=4)
    llm = LLM(
        str(path),
        dtype="float32",
        device=plan.device,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_gpu_blocks=32,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    reference = hf_greedy(hf.to(device=plan.device, dtype=torch.float32), prompts, 4)
    result = compare(ours, reference, "float32")
    result["triton_served"] = "pagedinfer.kernels.triton_ops" in sys.modules
    rec.put("engine_on_triton", result)
    rec.check(
        "engine greedy on the Triton kernels vs transformers",
        result["passed"] and result["triton_served"],
        identical=f"{result['identical']}/{result['sequences']}",
        triton_served=result["triton_served"],
    )


# --------------------------------------------------------------------------- models


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("<17>"): the random models need a
    tokenizer in their folder and no real one can be fetched on the GPU host."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<0>", pad_token="<0>", eos_token="<2>"
    ).save_pretrained(path)


def build_model(shape: ModelShape, work: Path) -> tuple[Path, Any]:
    """A random-weight model of `shape` through transformers' own classes (seeded), saved
    in bf16 (so fp32 and bf16 runs share exactly the same weights) once per run.

    Returns its folder and the transformers model (bf16, on the CPU).
    """
    import torch
    import transformers

    path = work / "models" / shape.name
    if (path / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return path, model.eval()
    config = transformers.LlamaConfig(**shape.config, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    staging = path.with_name(path.name + ".staging")
    model.save_pretrained(staging)
    save_tokenizer(staging, shape.config["vocab_size"])
    staging.rename(path)
    return path, model


def random_prompts(lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], Any]]:
    """transformers' greedy continuation of each prompt alone, with its logits per step."""
    import torch

    model.generation_config.eos_token_id = None  # ignore_eos: run to the length limit
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            results.append((tokens, torch.stack(out.scores)[:, 0].float().cpu()))
    return results


def compare(ours: list[list[int]], reference: list[tuple[list[int], Any]], dtype: str) -> dict:
    """Greedy tokens against transformers': identical sequences, agreement, divergences."""
    divergences = []
    agreed = total = first = 0
    for i, (tokens, (ref, scores)) in enumerate(zip(ours, reference, strict=True)):
        n = 0
        while n < min(len(tokens), len(ref)) and tokens[n] == ref[n]:
            n += 1
        agreed += n
        total += len(ref)
        first += bool(n)
        if n < len(ref):
            ours_at = tokens[n] if n < len(tokens) else None
            margin = float(scores[n, ref[n]] - scores[n, ours_at]) if ours_at is not None else None
            divergences.append({"prompt": i, "position": n, "hf_margin": margin})
    result = {
        "sequences": len(ours),
        "identical": len(ours) - len(divergences),
        "token_agreement": round(agreed / max(total, 1), 4),
        "first_token_agreement": round(first / max(len(ours), 1), 4),
        "divergences": divergences,
        "lengths_ok": all(len(t) == len(r) for t, (r, _) in zip(ours, reference, strict=True)),
    }
    if dtype == "float32":
        ties = all(d["hf_margin"] is not None and d["hf_margin"] < NEAR_TIE for d in divergences)
        result["passed"] = result["lengths_ok"] and ties
    else:
        result["passed"] = (
            result["lengths_ok"]
            and result["first_token_agreement"] >= BF16_MIN_FIRST_TOKEN_AGREEMENT
        )
    return result


# --------------------------------------------------------------------------- engine


def run_engine(rec: Recorder, plan: Plan, outdir: Path, work: Path) -> None:
    """Each model shape in fp32 and bf16: `engine_scenarios` against transformers."""
    for shape in plan.models:
        if not rec.has_time(shape.name, 20):
            continue
        with rec.step(shape.name):
            start = time.perf_counter()
            path, hf = build_model(shape, work)
            models = rec.data.setdefault("models", {})
            models[shape.name] = {
                "params": sum(p.numel() for p in hf.parameters()),
                "build_s": round(time.perf_counter() - start, 1),
            }
            for dtype in ("float32", "bfloat16"):
                if rec.has_time(f"{shape.name} {dtype}", 10):
                    with rec.step(f"{shape.name} {dtype}"):
                        start = time.perf_counter()
                        results = engine_scenarios(rec, plan, shape, path, hf, dtype)
                        models[shape.name][dtype] = results
                        results["seconds"] = round(time.perf_counter() - start, 1)
                        rec.flush()
            del hf
            free_device_memory()


def engine_scenarios(
    rec: Recorder, plan: Plan, shape: ModelShape, path: Path, hf: Any, dtype: str
) -> dict[str, Any]:
    """Batched, prefix-cached and preempted greedy runs of one model and dtype, each
    checked token for token against transformers on the same weights."""
    import torch

    from pagedinfer.service import LLM, SamplingParams

    vocab = shape.config["vocab_size"]
    prompts = random_prompts(plan.prompt_lens, vocab, seed=1)
    prefix = random_prompts((plan.shared_prefix,), vocab, seed=2)[0]
    shared = [prefix + tail for tail in random_prompts((3, 5, 7), vocab, seed=3)]
    greedy = SamplingParams(max_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    block = 16
    engine_args = {
        "block_size": block,
        "dtype": dtype,
        "device": plan.device,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
    }
    results: dict[str, Any] = {}

    start = time.perf_counter()
    llm = LLM(str(path), num_gpu_blocks=plan.num_blocks, **engine_args)
    results["engine_load_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    stats = llm.engine.stats()
    results["batched"] = {
        "seconds": round(time.perf_counter() - start, 2),
        "preemptions": stats.num_preemptions,
    }
    start = time.perf_counter()
    first = llm.generate([shared[0]], greedy)[0]
    rest = llm.generate(shared[1:], greedy)
    cached = [o.cached_tokens for o in rest]
    prefixed = [o.outputs[0].token_ids for o in [first, *rest]]
    results["prefix_caching"] = {
        "seconds": round(time.perf_counter() - start, 2),
        "cached_tokens": cached,
    }
    leaked = llm.engine.stats().kv.used
    del llm
    free_device_memory()

    # The fewest blocks that hold the longest request: the others must wait or be preempted.
    blocks = math.ceil((max(plan.prompt_lens) + plan.new_tokens) / block)
    tiny = LLM(str(path), num_gpu_blocks=blocks, **engine_args)
    start = time.perf_counter()
    preempted = [o.outputs[0].token_ids for o in tiny.generate(prompts, greedy)]
    stats = tiny.engine.stats()
    results["preemption"] = {
        "seconds": round(time.perf_counter() - start, 2),
        "blocks": blocks,
        "preemptions": stats.num_preemptions,
    }
    leaked += stats.kv.used
    del tiny
    free_device_memory()

    start = time.perf_counter()
    model = hf.to(device=plan.device, dtype=getattr(torch, dtype))
    reference = hf_greedy(model, prompts, plan.new_tokens)
    shared_reference = hf_greedy(model, shared, plan.new_tokens)
    hf.to("cpu")
    results["transformers_s"] = round(time.perf_counter() - start, 2)
    free_device_memory()

    results["batched"].update(compare(batched, reference, dtype))
    results["prefix_caching"].update(compare(prefixed, shared_reference, dtype))
    results["preemption"].update(compare(preempted, reference, dtype))
    results["preemption"]["identical_to_batched"] = sum(
        a == b for a, b in zip(preempted, batched, strict=True)
    )
    name = f"{shape.name} {dtype}"
    for scenario in ("batched", "prefix_caching", "preemption"):
        r = results[scenario]
        rec.check(
            f"{name} {scenario} vs transformers",
            r["passed"],
            identical=f"{r['identical']}/{r['sequences']}",
            token_agreement=r["token_agreement"],
        )
    rec.check(f"{name} batched without preemption", results["batched"]["preemptions"] == 0)
    rec.check(
        f"{name} preemption forced",
        results["preemption"]["preemptions"] > 0,
        preemptions=results["preemption"]["preemptions"],
    )
    rec.check(
        f"{name} prefix cache hit",
        all(c >= block * (plan.shared_prefix // block) for c in cached),
        cached_tokens=cached,
    )
    rec.check(f"{name} every block freed", leaked == 0, blocks_in_use=leaked)
    return results


# --------------------------------------------------------------------------- bandwidth


def run_bandwidth(rec: Recorder, plan: Plan, outdir: Path, work: Path) -> None:
    """kernels_gpu.py --quick (--smoke in the dry run), its figures as shares of peak."""
    import kernels_gpu

    out = outdir / "kernels_gpu.json"
    argv = ["--smoke", "--out", str(out)] if plan.dry_run else ["--quick", "--out", str(out)]
    rec.put("kernels_gpu_args", argv[:1])
    code = kernels_gpu.main(argv)
    path = out.with_name("kernels_gpu_smoke.json") if plan.dry_run else out
    summary = json.loads(path.read_text())
    setup = summary["setup"]
    peak = setup["peak_gbps"]
    decode = [
        {
            **row,
            "pct_of_peak": round(100 * row["paged_gbps"] / peak, 1) if peak else None,
        }
        for row in summary["decode"]
    ]
    rec.put("setup", setup)
    rec.put("goals", summary["goals"])
    rec.put("decode", decode)
    rec.put("prefill", summary["prefill"])
    if decode:
        best = max(decode, key=lambda r: r["paged_gbps"])
        rec.put(
            "summary",
            {
                "best_decode_gbps": round(best["paged_gbps"], 1),
                "best_pct_of_peak": best["pct_of_peak"],
                "median_paged_over_contiguous": sorted(r["paged_over_contiguous"] for r in decode)[
                    len(decode) // 2
                ],
            },
        )
    tolerance = 1e-4 if setup["dtype"] == "float32" else 2e-2
    rec.check("kernels_gpu.py ran", code == 0, exit_code=code)
    rec.check(
        "paged attention agrees with the torch path",
        setup["max_abs_error_vs_torch_path"] <= tolerance,
        max_abs_error=setup["max_abs_error_vs_torch_path"],
    )
    rec.check(
        "decode grid measured",
        bool(decode) and all(r["paged_gbps"] > 0 for r in decode),
        rows=len(decode),
    )


# --------------------------------------------------------------------------- throughput


# Tokens per step for both systems: run_hf_continuous gives transformers 512.
BATCH_TOKENS = 512


def matmul_gflops(dtype: Any, device: Any) -> float:
    """The matmul rate of this device in `dtype` right now: MFU's denominator."""
    import kernels_gpu
    import torch

    size = 4096 if device.type == "cuda" else 512
    a = torch.randn(size, size, dtype=dtype, device=device)
    return 2 * size**3 / kernels_gpu.time_ms(lambda: a @ a, device) / 1e6


def run_throughput(rec: Recorder, plan: Plan, outdir: Path, work: Path) -> None:
    """The mixed workload through pagedinfer and transformers' continuous batching."""
    import throughput
    import torch

    from pagedinfer.service.config import EngineConfig
    from pagedinfer.service.engine import LLMEngine

    shape = plan.throughput_model
    dtype = "float32" if plan.dry_run else "bfloat16"
    torch_dtype = getattr(torch, dtype)
    device = torch.device(plan.device)
    path, hf = build_model(shape, work)
    params = sum(p.numel() for p in hf.parameters())
    vocab = shape.config["vocab_size"]
    max_len = plan.throughput_max_len
    wl = throughput.mixed_workload(
        plan.throughput_requests, vocab, 0, plan.prompt_mean, plan.output_mean, max_len
    )
    warm = throughput.mixed_workload(8, vocab, 1, plan.prompt_mean, 8, max_len)
    gflops = matmul_gflops(torch_dtype, device)
    rec.put(
        "setup",
        {
            "model": shape.name,
            "dtype": dtype,
            "params": params,
            "requests": len(wl.prompts),
            "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens,
            "kv_tokens": plan.throughput_kv_tokens,
            "max_num_batched_tokens": BATCH_TOKENS,
            "matmul_gflops": round(gflops, 1),
        },
    )
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        device=plan.device,
        num_gpu_blocks=plan.throughput_kv_tokens // 16,
        max_num_seqs=256,
        max_num_batched_tokens=BATCH_TOKENS,
        max_model_len=max_len,
    )
    with rec.step("pagedinfer"):
        engine = LLMEngine(config)
        paged, _ = throughput.run_pagedinfer("paged", wl, config, params, gflops, engine, warm)
        rec.put("paged", paged)
        del engine
        free_device_memory()
    hf_result = None
    if rec.has_time("hf_continuous", 30):
        with rec.step("hf_continuous"):
            model = hf.to(device=device, dtype=torch_dtype)
            hf_result = throughput.run_hf_continuous(
                wl, model, params, gflops, plan.throughput_kv_tokens, warm
            )
            rec.put("hf_continuous", hf_result)
    paged = rec.data.get("paged")
    if paged and hf_result:
        ratio = paged["output_tokens_per_s"] / hf_result["output_tokens_per_s"]
        rec.put("paged_over_hf_continuous", round(ratio, 2))
    if paged:
        # Every request ran to its length (the serving loop ends only then), many at once.
        rec.check(
            "pagedinfer served the workload in continuous batches",
            paged["peak_running"] > 1,
            peak_running=paged["peak_running"],
            output_tokens_per_s=paged["output_tokens_per_s"],
        )
    if hf_result:
        # run_hf_continuous raises where a request comes back unfinished.
        rec.check(
            "transformers' continuous batching served the workload",
            hf_result["seconds"] > 0,
            output_tokens_per_s=hf_result["output_tokens_per_s"],
        )


# --------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Section:
    """One part of the check: `run(recorder, plan, outdir, work)` in a process of its own."""

    name: str
    run: Callable[[Recorder, Plan, Path, Path], None]
    # Dry run: the Triton kernels in Triton's interpreter (else the torch path on CPU).
    interpret: bool = False


SECTIONS = (
    Section("kernel_tests", run_kernel_tests, interpret=True),
    Section("kernel_cases", run_kernel_cases, interpret=True),
    Section("engine", run_engine),
    Section("bandwidth", run_bandwidth),
    Section("throughput", run_throughput),
)


def make_import_shim(root: Path, absent: tuple[str, ...] = ()) -> Path:
    """A folder holding `pagedinfer/<part>` links to this checkout's folders, as
    pyproject's package-dir maps them: on sys.path it imports pagedinfer uninstalled.

    absent: modules that a `sitecustomize` there makes unimportable in every process
    started with the folder on PYTHONPATH (`importlib.util.find_spec` reports them absent).
    """
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = root / "pagedinfer"  # a namespace package: no __init__.py
    package.mkdir(parents=True)
    for name, folder in setuptools["package-dir"].items():
        top, _, part = name.partition(".")
        if top != "pagedinfer" or "." in part:
            raise ValueError(f"pyproject package-dir: unexpected entry {name!r}")
        (package / part).symlink_to(REPO / folder, target_is_directory=True)
    if absent:
        (root / "sitecustomize.py").write_text(
            '"""gpu_check: these modules count as not installed."""\n\n'
            "import sys\n\n"
            f"for name in {list(absent)!r}:\n"
            "    sys.modules[name] = None\n"
        )
    return root


def host_packages() -> dict[str, Any]:
    """Versions of what the run imports, and which dependencies are absent (as they may be)."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "required": {m: version(m) for m in REQUIRED_MODULES},
        "missing": [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None],
        "optional": {m: version(m) for m in OPTIONAL_MODULES},
        "not_needed_present": {d: version(d) is not None for d in NOT_NEEDED},
    }


def run_section(
    section: Section, plan: Plan, box: float, outdir: Path, work: Path, env: dict, log: Any
) -> dict[str, Any]:
    """One section in a process of its own, stopped after `box` seconds."""
    result = work / f"{section.name}.json"
    output = work / f"{section.name}.out"
    # The section wraps up a little before its box closes, so its last results are saved.
    deadline = time.time() + max(box - max(10.0, 0.1 * box), 0.5 * box)
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        str(outdir),
        "--section",
        section.name,
        "--work",
        str(work),
        "--deadline",
        str(deadline),
    ]
    if plan.dry_run:
        argv.append("--dry-run")
    section_env = dict(env)
    section_env.pop("TRITON_INTERPRET", None)
    if plan.dry_run:
        # A GPU host runs none of the CPU's compiled kernels; the dry run skips them too.
        section_env["PAGEDINFER_CPU_KERNELS"] = "torch"
        if section.interpret:
            section_env["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=section_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=box)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = round(time.perf_counter() - start, 1)
    data: dict[str, Any] = {}
    if result.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            data = json.loads(result.read_text())
    tail = output.read_text(errors="replace").splitlines()[-40:]
    if code is None:
        status = "timeout"
        data["error"] = f"stopped after its time box of {box:.0f} s"
    elif code != 0 and "status" not in data:
        status = "error"
        data["error"] = f"exit code {code}: " + " | ".join(tail[-3:])[-800:]
    else:
        status = data.get("status") or section_status(data)
    data.update(status=status, seconds=seconds, time_box_s=round(box))
    log.write(f"===== {section.name}: {status} in {seconds} s (box {box:.0f} s)\n")
    log.write("\n".join(tail) + "\n")
    log.flush()
    return data


def drive(outdir: Path, plan: Plan, only: list[str] | None) -> int:
    outdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = started + (DRY_TOTAL_S if plan.dry_run else GPU_TOTAL_S)
    report: dict[str, Any] = {
        "mode": "dry-run" if plan.dry_run else "gpu",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "host": host_packages(),
        "sections": {},
    }
    result_path = outdir / RESULT_NAME

    def save() -> None:
        report["seconds"] = round(time.time() - started, 1)
        statuses = [s["status"] for s in report["sections"].values()]
        report["passed"] = bool(statuses) and all(s == "passed" for s in statuses)
        result_path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    if report["host"]["missing"]:
        report["error"] = f"missing on this host: {', '.join(report['host']['missing'])}"
        save()
        print(f"gpu_check: {report['error']}", file=sys.stderr)
        return 2
    if not plan.dry_run:
        import torch

        if not torch.cuda.is_available():
            report["error"] = "no CUDA device: run on a machine with an NVIDIA GPU, or --dry-run"
            save()
            print(f"gpu_check: {report['error']}", file=sys.stderr)
            return 2

    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        absent = tuple(NOT_NEEDED.values()) if plan.dry_run else ()
        report["host"]["made_absent"] = list(absent)
        shim = make_import_shim(work / "shim", absent)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p
            ),
            "GPU_CHECK_SHIM": str(shim),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        with open(outdir / LOG_NAME, "w") as log:
            for section in SECTIONS:
                if only and section.name not in only:
                    continue
                box = min(plan.budgets[section.name], deadline - time.time())
                if box < 15:
                    report["sections"][section.name] = {
                        "status": "skipped",
                        "error": "no time left in the run's 8 minutes",
                    }
                    continue
                print(f"gpu_check: {section.name} (box {box:.0f} s) ...", flush=True)
                data = run_section(section, plan, box, outdir, work, env, log)
                report["sections"][section.name] = data
                if "device" not in report and "device" in data:
                    report["device"] = data["device"]
                print(
                    f"gpu_check: {section.name}: {data['status']} in {data['seconds']} s",
                    flush=True,
                )
                save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    statuses = {name: s["status"] for name, s in report["sections"].items()}
    print(json.dumps({"passed": report["passed"], "seconds": report["seconds"], **statuses}))
    return 0 if report["passed"] else 1


def run_one(name: str, plan: Plan, outdir: Path, work: Path, deadline: float) -> int:
    """The body of one section's process: run it, record its results and its status."""
    section = next(s for s in SECTIONS if s.name == name)
    rec = Recorder(work / f"{name}.json", deadline)
    code = 0
    try:
        rec.put("device", device_info(plan))
        section.run(rec, plan, outdir, work)
        status = section_status(rec.data)
    except Exception as err:
        traceback.print_exc()
        rec.data["error"] = f"{type(err).__name__}: {err}"[:1000]
        rec.data["at"] = _where(err)
        status = "error"
        code = 1
    rec.put("status", status)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="where gpu_check.json and gpu_check.log go")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (CI)")
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {', '.join(s.name for s in SECTIONS)}",
    )
    # The parent's call of one section's process.
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    names = [s.name for s in SECTIONS]
    if args.section is not None:
        if args.section not in names or args.work is None or args.deadline is None:
            parser.error("--section needs a known section, --work and --deadline")
        return run_one(args.section, plan, args.outdir, args.work, args.deadline)
    only = None
    if args.sections:
        only = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = sorted(set(only) - set(names))
        if unknown:
            parser.error(f"unknown sections: {', '.join(unknown)} (choose from {', '.join(names)})")
    return drive(args.outdir, plan, only)


if __name__ == "__main__":
    sys.exit(main())
