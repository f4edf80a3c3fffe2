"""Engine configuration: one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

AllocationPolicy = Literal["paged", "contiguous"]
# A draft this long is verified in one pass; longer ones mostly waste compute on the
# tokens after the first mismatch.
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    The KV cache is sized either by `num_gpu_blocks` (exact) or by `kv_cache_memory`
    (bytes; the model runner divides it by the size of one block). When both are unset,
    CUDA uses `gpu_memory_utilization` of the free device memory, and the CPU what the
    container's memory limit leaves once the model is loaded (`service/memory.py`).
    """

    model: str | None = None  # None = the embedded default model
    dtype: str = "auto"  # auto: the checkpoint's where the hardware multiplies it (dtypes.py)
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # None = sized from the memory limit
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    allocation_policy: AllocationPolicy = "paged"
    num_threads: int | None = None  # CPU threads; None = OMP_NUM_THREADS, else the CPU quota
    # How the CPU backend multiplies a quantised model's (a GGUF file's) weights: "int8"
    # quantises each GEMM's input rows to int8 per block of 32 (of 256 for a K-quant's
    # weight) and multiplies the file's codes in integers, as llama.cpp does
    # (kernels/cpu/int8_gemm.py, where the CPU has AVX2 or AVX-512 VNNI); "fp32" multiplies the dequantised weights in fp32, the exact
    # products of the model's fp32 forward (the default: int8 rounding can flip a small
    # model's near ties, as it flips the embedded model's first answer to a README example).
    gguf_activations: str = "fp32"
    # N-gram speculative decoding (see spec_decode.py): up to this many draft tokens per
    # decode, looked up in the sequence's own tokens; 0 turns it off.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1  # the shortest n-gram a draft may follow
    prompt_lookup_max: int = 3  # the longest, tried first
    # Drafts only while at most this many requests are running. A pass of a full batch
    # carries enough rows already: there a draft's rejected tokens cost a row each and
    # its kept ones save a pass only for the longest requests (see spec_decode.py).
    speculative_max_running: int = 64
    # A forward pass's cost beyond its rows, in rows (a row costs 1): what a pass saved by
    # kept drafts is worth against the draft rows rejected (spec_decode.draft_length).
    # 5 fits a small model on a few CPU threads; a GPU's passes are worth far more rows.
    speculative_pass_rows: int = 5
    # The CPU backend (kernels/cpu) compiles its kernels in a background thread while the
    # model's torch forward serves, instead of before the engine starts (a server that
    # should report ready quickly sets it).
    compile_in_background: bool = False
    # KV-cache events for prefix-aware routers: vLLM's --kv-events-config, as JSON text,
    # a mapping or a kv_events.KVEventsConfig (None = off).
    kv_events_config: Any = None

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            from pagedinfer.service.kv_events import parse_kv_events_config

            self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        spec = self.num_speculative_tokens
        if (
            not isinstance(spec, int)
            or isinstance(spec, bool)
            or not 0 <= spec <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}"
            )
        _positive("speculative_max_running", self.speculative_max_running)
        _positive("speculative_pass_rows", self.speculative_pass_rows)
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.max_model_len < self.block_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be at least block_size ({self.block_size})"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.allocation_policy not in ("paged", "contiguous"):
            raise ValueError(
                f"allocation_policy must be 'paged' or 'contiguous', got {self.allocation_policy!r}"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16, got {self.dtype!r}"
            )
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(
                f"gguf_activations must be int8 or fp32, got {self.gguf_activations!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


GGUF_ACTIVATIONS = ("int8", "fp32")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G' or a plain byte count -> bytes."""
    units = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    s = text.strip().lower().removesuffix("b")
    number = s.rstrip("kmgi")
    unit = s[len(number) :]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"not a byte size: {text!r} (try 2GiB, 512MiB or a number)") from None
    return int(value)


def _byte_size_flag(text: str) -> int:
    import argparse

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(parser) -> None:
    """The flags of every EngineConfig field, shared by `serve` and `generate`."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                   help="the dtype the model computes in; auto: the checkpoint's where the "
                   "hardware multiplies it natively, else float32")  # fmt: skip
    g.add_argument("--device", default=d.device,
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")  # fmt: skip
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="exact number of KV blocks (overrides the memory budget)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=_byte_size_flag,
        default=d.kv_cache_memory,
        help="KV cache budget on CPU, e.g. 2GiB (default: what the container's memory "
        "limit leaves after the model, with 10%% headroom)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="share of free GPU memory for the KV cache",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="requests running at once; more wait in the queue")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per engine step; longer prompts are prefilled in chunks")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="the longest context (prompt + output) a request may have, at most "
                   "the model's max_position_embeddings")  # fmt: skip
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off prefix caching (reuse of cached KV blocks across requests)")  # fmt: skip
    g.add_argument(
        "--kv-events-config",
        default=None,
        help="publish prefix-cache events for routers, vLLM's JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (default: off)',
    )
    g.add_argument("--allocation-policy", default=d.allocation_policy,
                   choices=["paged", "contiguous"],
                   help="paged: KV blocks on demand; contiguous: max-model-len slots reserved "
                   "per request at admission (the naive layout, for comparison)")  # fmt: skip
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of the forward pass (default: OMP_NUM_THREADS if set, else the "
        "CPUs visible, capped at the container's CPU quota)",
    )
    g.add_argument(
        "--gguf-activations",
        default=d.gguf_activations,
        choices=list(GGUF_ACTIVATIONS),
        help="CPU: how a quantised model's GEMMs multiply; fp32: the dequantised weights in "
        "fp32, exact; int8: its input rows quantised to int8 per block of 32 (256 for "
        "K-quants), times the "
        "file's codes in integers (as llama.cpp; faster, the logits differ slightly)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="n-gram speculative decoding: draft up to this many tokens per decode from "
        "the sequence's own earlier tokens, verified in one pass (0 = off)",
    )
    g.add_argument(
        "--speculative-max-running",
        type=int,
        default=d.speculative_max_running,
        help="draft only while at most this many requests are running",
    )
    g.add_argument(
        "--speculative-pass-rows",
        type=int,
        default=d.speculative_pass_rows,
        help="a forward pass's cost beyond its rows, in rows: drafts pay where it is "
        "large against the batch",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=d.prompt_lookup_min,
        help="shortest n-gram a draft may follow",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=d.prompt_lookup_max,
        help="longest n-gram a draft may follow (tried first)",
    )


def config_from_args(args) -> EngineConfig:
    # Settings without a flag (compile_in_background) keep their defaults.
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**given)
