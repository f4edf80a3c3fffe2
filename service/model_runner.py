"""Turns a SchedulerOutput into flat tensors, runs the model, returns the logits to sample.

The runner owns the KV cache tensors (one k and one v tensor per layer, each
`[num_blocks, block_size, num_kv_heads, head_dim]`) and sizes them from a memory budget.
It knows nothing about scheduling or sampling.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedinfer.kernels import AttentionMetadata
from pagedinfer.service import memory
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.loader import LoadedModel, cache_dir
from pagedinfer.service.models.llama import ModelConfig
from pagedinfer.service.request import Request
from pagedinfer.service.sampler import argmax_only, prompt_logprobs
from pagedinfer.service.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    """Logits for the requests whose scheduled chunk reached their last known token:
    one row each, or, for a request with a draft, one for its last known token and one
    per draft token, in order."""

    logits: torch.Tensor  # [sum(num_rows), vocab] fp32, on the CPU
    requests: list[Request]
    num_rows: list[int]  # logits rows of each request
    # int64 [sum(num_rows)] or None: the argmax of a row that only needs it, picked
    # without its logits (whose row is then unwritten); -1 for every other row.
    tokens: torch.Tensor | None = None
    # Request id -> (t, entries): the logprobs of prompt tokens t, t + 1, ... computed
    # this step, for requests with `prompt_logprobs` (sampler.prompt_logprobs).
    prompt_logprobs: dict[str, tuple[int, list[dict]]] = field(default_factory=dict)


def kv_block_bytes(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = loaded.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return per_token * block_size


def num_kv_blocks(
    config: EngineConfig,
    block_bytes: int,
    device: torch.device,
    model: ModelConfig,
    backend_mode: str | None = None,
    compiling: bool = False,
) -> int:
    """How many blocks the KV budget buys: exact, a byte budget or what the memory limit
    leaves on CPU (`memory.plan_kv_cache`), free memory on CUDA. backend_mode: the mode
    of a CPU executor that is still building its weights beside the model's, or None;
    compiling: its kernels compile meanwhile, in a child (`memory.COMPILE_CHILD_BYTES`)."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    elif config.kv_cache_memory is None:
        footprint = _footprint(config, block_bytes, model, backend_mode)
        if compiling:
            footprint = footprint.with_compiling_child()
        plan = memory.plan_kv_cache(
            memory.read_host_memory(),
            footprint,
            block_bytes=block_bytes,
            num_layers=model.num_layers,
            min_blocks=config.max_num_seqs,
        )
        log.info(plan.reason)
        return plan.num_blocks
    else:
        budget = config.kv_cache_memory
        memory.check_kv_cache_memory(budget, memory.read_host_memory(), memory.resident_bytes())
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory ({budget} bytes) is smaller than one KV block ({block_bytes} bytes)"
        )
    return blocks


def _footprint(
    config: EngineConfig, block_bytes: int, model: ModelConfig, backend_mode: str | None
) -> memory.Footprint:
    """The process's memory now, what the CPU backend still builds (`backend_mode`, or
    None) and one step's activations, for `memory.plan_kv_cache`."""
    # The cache's element size, the model's dtype: block_bytes = 2 * layers * block
    # tokens * kv heads * head_dim of them.
    elements = 2 * model.num_layers * config.block_size * model.num_kv_heads * model.head_dim
    itemsize = block_bytes // elements
    memory.release_free_heap()
    return memory.Footprint(
        resident=memory.resident_bytes(),
        pending=0
        if backend_mode is None
        else memory.backend_pending_bytes(model, backend_mode, itemsize),
        activations=memory.activation_bytes(model, config, itemsize),
    )


def child_compile_fits(config: EngineConfig, block_bytes: int, model: ModelConfig) -> bool:
    """Whether the memory holds the torch forward serving (with the model's dense weights,
    as loaded now) while a child compiles the CPU kernels, with a KV block per sequence;
    True where the KV cache is not sized from the memory."""
    if config.num_gpu_blocks is not None or config.kv_cache_memory is not None:
        return True
    host, footprint = memory.read_host_memory(), _footprint(config, block_bytes, model, None)
    sizes = {"block_bytes": block_bytes, "num_layers": model.num_layers,
             "min_blocks": config.max_num_seqs}  # fmt: skip
    # What cannot serve even without a compile (--max-num-seqs past the memory) is
    # refused now (ValueError), not after minutes of compiling.
    memory.plan_kv_cache(host, footprint, **sizes)
    return memory.child_compile_fits(host, footprint, **sizes)


def weights_identity(config: ModelConfig, path: Path, block_size: int, dtype: torch.dtype) -> str:
    """What the CPU executor's built weights for the model in `path` follow: its shapes and
    features (not its name or context length), the dtype, the block size, and its weights,
    by their files' names, sizes and times (not by where the directory lies, which a cache
    moves)."""
    fields = dataclasses.asdict(config)
    for unrelated in ("name", "eos_token_ids"):
        fields.pop(unrelated, None)
    weights = sorted(
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in path.glob("*.safetensors")
    )
    return repr((sorted(fields.items()), str(dtype), block_size, path.name, weights))


def kernel_set_identity(
    config: ModelConfig,
    path: Path,
    block_size: int,
    dtype: torch.dtype,
    gguf_activations: str = "fp32",
) -> str:
    """What picks the CPU kernels' variants for the model in `path`: what its built
    weights follow (`weights_identity`) and how quantised weights multiply
    (`EngineConfig.gguf_activations`)."""
    return repr((weights_identity(config, path, block_size, dtype), gguf_activations))


def weights_store(identity: str) -> Path | None:
    """The file that keeps the CPU executor's built weights of `weights_identity`: the
    grids as chosen before `gguf_activations` picks their kernels, so one copy serves
    either setting."""
    from pagedinfer.kernels import cpu

    return cpu.weights_file(identity, cache_dir() / "cpu-weights")


def served_from_store(
    config: ModelConfig,
    path: Path,
    block_size: int,
    dtype: torch.dtype,
    gguf_activations: str = "fp32",
) -> bool:
    """Whether an earlier start left this model's compiled kernels and built weights, so
    that the CPU executor serves without the model's dense GEMM weights."""
    from pagedinfer.kernels import cpu

    if not cpu.supports(config):
        return False
    kernel_set = kernel_set_identity(config, path, block_size, dtype, gguf_activations)
    store = weights_store(weights_identity(config, path, block_size, dtype))
    return store is not None and store.is_file() and cpu.compiled_before(kernel_set)


def _record_when_ready(executor: Any, kernel_set: str) -> None:
    """Record a kernel set once a background warm-up has compiled it (a failed warm-up
    never becomes ready, and records nothing)."""
    from pagedinfer.kernels import cpu

    if executor.wait_ready():
        cpu.record_compiled(kernel_set)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device):
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        cfg = loaded.config
        # bf16 on a CPU whose executor multiplies bf16 pairs (`cpu.bf16_products_serve`):
        # the weights' bf16 values in fp32, the layers' GEMMs in bf16, K and V kept in a
        # bf16 cache, and the rest in fp32. The kernel set is named by the dtype loaded.
        loaded_dtype = next(self.model.parameters()).dtype
        self.bf16_products = False
        if device.type == "cpu" and loaded_dtype == torch.bfloat16:
            from pagedinfer.kernels import cpu

            self.bf16_products = cpu.bf16_products_serve(cfg)
        if self.bf16_products:
            self.model.float()
            self.model.reset_buffers()
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = torch.bfloat16 if self.bf16_products else self.dtype
        self.block_size = config.block_size
        # The CPU backend, where it serves this model here; until its kernels are ready
        # (compiled in the background) the model's own forward serves. Prepared before
        # the KV cache is sized from the memory left, which its weights take from.
        # Where an earlier start left this model's kernels in numba's disk cache, the
        # executor is built before serving even in the server: no torch-forward phase and
        # no second copy of the weights beside the executor's. Else it compiles in the
        # background (the server) while the torch forward serves.
        # Where the loader deferred the dense GEMM weights (`served_from_store`), they are
        # read only if the executor does not serve after all.
        self.executor = None
        self._kernel_set = kernel_set_identity(
            cfg, loaded.path, config.block_size, loaded_dtype, config.gguf_activations
        )
        int8_products = config.gguf_activations == "int8"
        if device.type == "cpu":
            from pagedinfer.kernels import cpu

            cached = cpu.compiled_before(self._kernel_set)
            background = config.compile_in_background and not cached
            store = weights_store(
                weights_identity(cfg, loaded.path, config.block_size, loaded_dtype)
            )
            block_bytes = kv_block_bytes(loaded, config.block_size, self.kv_dtype)
            first = (
                background
                and store is not None
                and cpu.supports(cfg)
                and not child_compile_fits(config, block_bytes, cfg)
            )
            if first:
                log.info(
                    "CPU executor: the memory limit cannot hold the model's dense weights, "
                    "a child compiling the kernels and the KV cache at once; compiling "
                    "before serving, without the dense weights"
                )
            self.executor = cpu.prepare(
                self.model,
                config.block_size,
                background=background and not first,
                cached=cached,
                store=store,
                compile_first=first,
                bf16_products=self.bf16_products,
                int8_products=int8_products,
            )
            if first and not (self.executor is not None and self.executor.active):
                log.warning("CPU executor: compiling failed; the torch forward serves")
                self.executor = None
                self._read_released_weights()
            if loaded.deferred and not (self.executor is not None and self.executor.active):
                log.warning(
                    "CPU executor: not serving from its stored weights; reading the model's"
                )
                loaded.load_deferred()
                self.executor = cpu.prepare(
                    self.model,
                    config.block_size,
                    background=background,
                    store=store,
                    bf16_products=self.bf16_products,
                    int8_products=int8_products,
                )
            if self.executor is not None and self.executor.active:
                cpu.record_compiled(self._kernel_set)
                log.info("CPU executor: kernels ready, serving every step from the first")
            elif self.executor is not None:  # recorded once compiled, served or not
                threading.Thread(
                    target=_record_when_ready,
                    args=(self.executor, self._kernel_set),
                    name="pagedinfer-compile-record",
                    daemon=True,
                ).start()
        building = self.executor is not None and not self.executor.active
        self.num_blocks = num_kv_blocks(
            config,
            kv_block_bytes(loaded, config.block_size, self.kv_dtype),
            device,
            cfg,
            self.executor.mode if building else None,
            compiling=building and self.executor.compiled,
        )
        shape = (self.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled, though every path masks the slots past a sequence's end: no slot
        # ever holds leftover memory.
        if device.type == "cpu":
            caches = memory.zeroed_cpu_tensors(2 * cfg.num_layers, shape, self.kv_dtype)
        else:
            caches = [
                torch.zeros(shape, dtype=self.kv_dtype, device=device)
                for _ in range(2 * cfg.num_layers)
            ]
        self.kv_caches = list(zip(caches[0::2], caches[1::2], strict=True))
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * kv_block_bytes(loaded, self.block_size, self.kv_dtype) / 2**20,
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into their fresh destinations, every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    @property
    def pending_executor(self) -> Any | None:
        """The CPU executor whose background warm-up has yet to make it serve, or None."""
        executor = self.executor
        return executor if executor is not None and not executor.active else None

    def take_over(self) -> bool:
        """Switch to the CPU executor once its background warm-up made it ready; whether
        it serves now. Call between steps, from the thread that runs them. Where it fails
        to start, its dense weights are read again and the torch forward keeps serving."""
        executor = self.executor
        if executor is None or executor.active:
            return executor is not None
        if not executor.ready:
            return False
        try:
            executor.activate(released=memory.release_free_heap)
        except Exception:
            log.exception("CPU executor: failed to start serving; the torch forward serves")
            self.executor = None
            self._read_released_weights()
            return False
        log.info("CPU executor: kernels ready, the compiled path serves from this step on")
        return True

    def _read_released_weights(self) -> None:
        """Read again the dense weights an executor released, for the torch forward."""
        released = frozenset(n for n, p in self.model.named_parameters() if p.is_meta)
        self.loaded.deferred = self.loaded.deferred | released
        self.loaded.load_deferred()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.copy_blocks(out.copy_blocks)
        if not out.scheduled:
            return ModelOutput(torch.empty(0, 0), [], [])
        inputs = self._prepare(out)
        args = (inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        executor = self.executor if self.take_over() else None
        if executor is not None:
            logits, tokens = executor.forward(*args, inputs.logits_indices, inputs.greedy)
        else:
            logits, tokens = self.model(*args, inputs.logits_indices), None
        logits = logits.float().cpu()
        scored: dict[str, tuple[int, list[dict]]] = {}
        if inputs.prompt_rows:  # the rows after the sampled ones
            row = sum(inputs.num_rows)
            for req, first, count in inputs.prompt_rows:
                targets = req.prompt_token_ids[first + 1 : first + 1 + count]
                k = req.sampling_params.prompt_logprobs
                scored[req.request_id] = (
                    first + 1,
                    prompt_logprobs(logits[row : row + count], targets, k),
                )
                row += count
            logits = logits[: sum(inputs.num_rows)]
            tokens = None if tokens is None else tokens[: sum(inputs.num_rows)]
        return ModelOutput(
            logits,
            inputs.sample_requests,
            inputs.num_rows,
            None if tokens is None else tokens.cpu(),
            scored,
        )

    def _prepare(self, out: SchedulerOutput) -> _Inputs:
        B = self.block_size
        scheduled = out.scheduled
        # Per request only list work; the per-token arrays are made once for the batch
        # below, so a step of a few decodes pays a few numpy calls, not a few per request.
        ids: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_indices: list[int] = []
        sample_requests: list[Request] = []
        num_rows: list[int] = []
        greedy: list[bool] = []  # per logits row: only its argmax is used
        # (request, first position, count): prompt positions whose logits score the
        # next prompt token, for requests with prompt_logprobs.
        prompt_rows: list[tuple[Request, int, int]] = []
        prompt_indices: list[int] = []
        max_blocks = max(len(s.request.block_table) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            req, start, draft = s.request, s.request.num_computed_tokens, s.draft_token_ids
            end = start + s.num_tokens
            known_end = end - len(draft)
            if end > len(req.block_table) * B:
                raise ValueError(
                    f"request {req.request_id}: {end} tokens need more than its "
                    f"{len(req.block_table)} KV blocks"
                )
            block_tables[i, : len(req.block_table)] = req.block_table
            ids += req.all_token_ids[start:known_end]
            ids += draft
            seq_lens.append(end)
            starts.append(starts[-1] + s.num_tokens)
            if known_end == req.num_tokens:
                logits_indices.extend(range(starts[-1] - 1 - len(draft), starts[-1]))
                sample_requests.append(req)
                num_rows.append(1 + len(draft))
                # A grammar masks the logits before the pick: never the argmax alone.
                params = req.sampling_params
                only = (
                    argmax_only(params, req.num_output_tokens) and params.structured_output is None
                )
                greedy.extend([only] * (1 + len(draft)))
            if req.sampling_params.prompt_logprobs is not None:
                last = min(known_end, req.num_prompt_tokens - 1)
                if start < last:
                    prompt_rows.append((req, start, last - start))
                    prompt_indices.extend(range(starts[-2], starts[-2] + last - start))
        logits_indices += prompt_indices
        greedy += [False] * len(prompt_indices)
        lens = np.asarray(seq_lens, dtype=np.int64)
        token_starts = np.asarray(starts, dtype=np.int64)
        counts = token_starts[1:] - token_starts[:-1]
        seq_of_token = np.repeat(np.arange(len(scheduled)), counts)
        # Token t of sequence i sits at position seq_lens[i] - counts[i] + (t - starts[i]).
        positions = np.arange(starts[-1]) + (lens - counts - token_starts[:-1])[seq_of_token]
        blocks = block_tables[seq_of_token, positions // B].astype(np.int64)
        slots = blocks * B + positions % B

        def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=self.device, dtype=dtype)

        attn = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(block_tables, torch.int32),
            seq_lens=tensor(lens, torch.int32),
            query_start_loc=tensor(token_starts, torch.int32),
        )
        return _Inputs(
            input_ids=tensor(np.asarray(ids, dtype=np.int64), torch.int64),
            positions=tensor(positions, torch.int64),
            attn=attn,
            logits_indices=tensor(np.asarray(logits_indices, dtype=np.int64), torch.int64),
            sample_requests=sample_requests,
            num_rows=num_rows,
            greedy=torch.from_numpy(np.asarray(greedy, dtype=bool)),
            prompt_rows=prompt_rows,
        )


@dataclass
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    num_rows: list[int]
    greedy: torch.Tensor  # bool, per logits row (on the CPU)
    prompt_rows: list[tuple[Request, int, int]]
