"""The CPU executor: a Llama-family forward pass over the CPU backend's kernels.

It runs the same equations as the model's own torch forward (`pagedinfer.service.models`)
with faster parts, picked from the configuration and the CPU alone:
- fp32 with no bias past q/k/v's: the compiled GEMMs of `grid_gemm`, from the weights'
  quantisation grid at each GEMM position where every layer's weight lies on one of one
  kind (a model that came as a GGUF file: "grid"), else from the fp32 weights in the
  same tile layout ("rebuilt"); steps of up
  to `grid_gemm.GRID_MAX_ROWS` tokens run as one compiled call (`fused_step`), and on
  any LM head greedy rows' tokens are picked without most of their logits
  (`greedy_argmax`, where the CPU has AVX2 or AVX-512 VNNI);
- with bf16 products, bf16 weights in the kind `bf16_layer_kind` picks (on AMX tiles
  where the CPU has them);
- otherwise the matmul library's packed layout ("mkl" for fp32, "onednn" for bf16 on
  CPUs with native bf16), or the weights as they are ("dense");
- with fp32 weights, the ops between the GEMMs in compiled kernels (`layer_ops`) and
  attention on the compiled paged kernels (`paged_decode`, `paged_verify`).

It serves only configurations whose every feature it implements (`SUPPORTED_FEATURES`);
anything else runs on the model's torch forward. Once active it owns the weights: the
model's dense copies of the GEMM weights are released.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer import kernels
from pagedinfer.kernels import torch_ops
from pagedinfer.kernels.cpu.gemms import (
    DenseGemm,
    Gemm,
    GridGemm,
    MklGemm,
    OneDnnGemm,
    amx_bf16,
    mkl_fp32_available,
    onednn_bf16_available,
)
from pagedinfer.kernels.metadata import AttentionMetadata
from pagedinfer.kernels.validation import check_paged_attention, check_write_kv

log = logging.getLogger(__name__)

WARM_UP_THREAD = "cpu-executor-warm-up"
# How long a child process may take to compile the kernels before the server gives up
# on it (the model's torch forward then keeps serving).
CHILD_COMPILE_TIMEOUT_S = 1800.0

# The architecture features (a model config's `features()`) this executor implements.
# Rotary scalings only change the cos/sin tables, which it reads from the model; which
# dims of a layer rotate by which table is data of the kernels (`_Layer.rope`), and so
# are each layer's window, its norms' scales (Gemma's 1 + weight folded in) and the norms
# of its blocks' outputs (Gemma 3's sandwich); the GLU's activation is a switch of the
# one gate/up kernel.
SUPPORTED_FEATURES = frozenset(
    {
        "rms_norm",
        "gemma_rms_norm",
        "silu_glu",
        "gelu_tanh_glu",
        "scaled_embeddings",
        "sandwich_norms",
        "sliding_window",
        "rope_neox",
        "rope_scaling_linear",
        "rope_scaling_dynamic",
        "rope_scaling_llama3",
        "rope_scaling_yarn",
        "rope_scaling_longrope",
        "partial_rotary",
        "no_rope_layers",
        "local_layer_rope",
        "grouped_query_attention",
        "qkv_bias",
        "qk_norm",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "o_proj_bias",
        "mlp_bias",
        "tied_embeddings",
        "untied_lm_head",
    }
)


def zero_pages(array: np.ndarray, smallest: int = 2**20) -> None:
    """Return the memory pages that lie wholly inside a C-contiguous array of at least
    `smallest` bytes to the kernel (madvise MADV_DONTNEED): in a private mapping they then
    read as zeros and hold no memory, and a page shared copy-on-write with another process
    stays as it is there. Only for arrays whose contents are no longer needed."""
    if array.nbytes < smallest or not array.flags.c_contiguous:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-array.ctypes.data // page) * page
    end = (array.ctypes.data + array.nbytes) // page * page
    if end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, 4) != 0:  # MADV_DONTNEED
        log.debug("madvise: %s", os.strerror(ctypes.get_errno()))


def unsupported_features(config: Any) -> list[str]:
    """The features of `config` (a model config with `features()`) this executor lacks."""
    return sorted(set(config.features()) - SUPPORTED_FEATURES)


@dataclass
class _Layer:
    """One decoder layer as the executor runs it. Every norm is given by its scale
    (`RMSNorm.scale`: Gemma's 1 + weight already added)."""

    norms: tuple[torch.Tensor, torch.Tensor]  # the attention's and the MLP's input norms
    # The norms of the attention's and the MLP's outputs before they join the residual
    # (Gemma 3's); None: added as they are.
    post_norms: tuple[torch.Tensor, torch.Tensor] | None
    # [2, head_dim]: the query and key heads' RMSNorm scales (Qwen3's); None: no q/k norms.
    qk_norm: torch.Tensor | None
    # How many leading dims of each q and k head rotate (0: none, a NoPE layer), and by
    # which cos/sin table (`CpuExecutor._rope_tables`: 0 the model's rope, 1 its local one).
    rope: tuple[int, int]
    window: int | None  # the layer's sliding window (None: it attends fully)
    qkv: Gemm
    o: Gemm
    gate_up: Gemm
    down: Gemm

    def gemms(self) -> tuple[Gemm, Gemm, Gemm, Gemm]:
        return self.qkv, self.o, self.gate_up, self.down


class CpuExecutor:
    """Runs a model's forward pass on the CPU backend (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        compiled: bool,
        store: Path | None = None,
        bf16_products: bool = False,
        int8_products: bool = False,
    ) -> None:
        self.model = model
        self.store = store  # where the built grids are kept between starts (`weight_store`)
        # The layers' GEMMs multiply bf16 weights (`bf16_layer_kind`): the model is served
        # with --dtype bfloat16, its weights rounded to bf16 values in fp32.
        self.bf16_products = bf16_products
        # The layers' GEMMs over a quantisation grid multiply its codes by their input rows
        # quantised to int8 (`int8_layers`), where this CPU has the instructions for it.
        self.int8_products = int8_products
        self.config = model.config
        # The MLP's activation is GELU's tanh approximation (Gemma 3's), not SiLU.
        self.gelu = "gelu_tanh_glu" in self.config.features()
        self.mode = mode  # "grid", "rebuilt", "mkl", "onednn" or "dense"
        self.compiled = compiled  # the ops between the GEMMs and attention in numba kernels
        self.layers: list[_Layer] = []
        self.lm_head: Gemm | None = None
        self.fused: Any = None  # fused_step.FusedWeights
        self.argmax: Any = None  # greedy_argmax.ArgmaxWeights
        # int64 [threads, phases, 2], or None: each fused step adds the cycles its workers
        # spend per phase (`fused_step.fused_forward`), for profiling.
        self.step_profile: np.ndarray | None = None
        self._cache_arrays: Any = None  # fused_step.CacheArrays of the caches served
        self._step_scratch: Any = None  # fused_step.StepScratch
        self._step_shapes: dict[int, Any] = {}  # block size -> fused_step.StepShape
        self._ready = threading.Event()
        # The block size of a build left for `activate`: the kernels compiled in a child
        # that stored the built weights, so they are read back once the dense ones are gone.
        self._build_at_activation: int | None = None
        self.active = False
        self.error: BaseException | None = None

    # -- building ---------------------------------------------------------------------

    def _build(self) -> None:
        """Turn the model's weights into the executor's GEMMs (no dense copy released yet):
        where the kernels are compiled, each GEMM position's grids or rebuilt fp32 tiles
        (`choose_grids`), else the library's packed layout."""
        from pagedinfer.kernels.cpu import grid_gemm

        model = self.model
        grids = self._grids() if self.mode == "grid" else None
        if grids is not None:
            layer_grids, lm_head = grids
            if self.int8_products:
                layer_grids = int8_layers(layer_grids)
            kinds = {g.kind for g in (*layer_grids[0], lm_head)}
            self.mode = "rebuilt" if kinds <= set(grid_gemm.DENSE) else "grid"
            self._build_grids(layer_grids, lm_head)
            return
        if self.mode == "grid":
            self.mode = "mkl" if mkl_fp32_available(self.config_dtype()) else "dense"
        make = {"mkl": MklGemm.of, "onednn": OneDnnGemm.of, "dense": DenseGemm.of}[self.mode]
        for i, layer in enumerate(model.layers):
            gemms = [make(lin.weight, lin.bias) for lin in layer.linears()]
            self.layers.append(self._layer_of(i, gemms))
        self.lm_head = make(model.lm_head_weight(), None)

    def _layer_of(self, i: int, gemms: Sequence[Gemm]) -> _Layer:
        """Layer i with these GEMMs (q/k/v, o, gate/up, down)."""
        layer = self.model.layers[i]
        norms, post_norms = _norms(layer)
        window = self.config.layer_window(i)
        return _Layer(norms, post_norms, _qk_norm(layer), self._rope(i), window, *gemms)

    def _grids(self) -> tuple[list[list[Any]], Any] | None:
        """`choose_grids`, or its result as an earlier start stored it (`weight_store`);
        a first build stores what it chose."""
        from pagedinfer.kernels.cpu import weight_store

        if self.store is None:
            return choose_grids(self.model, self.bf16_products)
        shapes = gemm_shapes(self.model)
        grids = weight_store.load(self.store, shapes)
        if grids is not None:
            log.info("GEMM grids read from the store of an earlier start (%s)", self.store.name)
            return grids
        if any(w.is_meta for ws in _gemm_weights(self.model) for w in ws):
            raise ValueError(f"{self.store} does not load, and the dense weights were not read")
        grids = choose_grids(self.model, self.bf16_products)
        if grids is not None:
            weight_store.save(self.store, grids)
        return grids

    def _build_grids(self, layer_grids: list[list[Any]], lm_head: Any) -> None:
        from pagedinfer.kernels.cpu import fused_step, greedy_argmax, grid_gemm

        model = self.model
        orders = [grid_gemm.fixed_order(g.in_features) for g in (*layer_grids[0], lm_head)]
        argmax = (
            greedy_argmax.ArgmaxWeights.of(lm_head, orders[4]) if greedy_argmax.fast() else None
        )
        norms = torch.stack([torch.stack(_norms(layer)[0]) for layer in model.layers])
        post_norms = [_norms(layer)[1] for layer in model.layers]
        sandwich = post_norms[0] is not None
        qkv_biases = [layer.linears()[0].bias for layer in model.layers]
        biased = qkv_biases[0] is not None
        qk_norms = [_qk_norm(layer) for layer in model.layers]
        qk_normed = qk_norms[0] is not None
        self.fused = fused_step.FusedWeights.stack(
            layer_grids,
            lm_head,
            orders,
            grid_gemm.GRID_MAX_ROWS,
            norms.numpy(),
            model.norm.scale().numpy(),
            self.config.rms_norm_eps,
            np.array([self._rope(i) for i in range(len(model.layers))], np.int64),
            argmax,
            torch.stack(qkv_biases).detach().float().numpy() if biased else None,
            torch.stack(qk_norms).float().numpy() if qk_normed else None,
            torch.stack([torch.stack(p) for p in post_norms]).numpy() if sandwich else None,
            np.array([self.config.layer_window(i) or 0 for i in range(len(model.layers))]),
        )
        if self.fused is None:
            raise ValueError(
                "the layers' grids differ in shape, or a position's come in more than two kinds"
            )
        for i in range(len(model.layers)):
            gemms = []
            for position in range(len(layer_grids[i])):
                # A view of the stacked arrays: the fused step and this path share them.
                view = self.fused.layer_grid(position, i)
                bias = qkv_biases[i].detach().float() if biased and position == 0 else None
                gemms.append(GridGemm(view, orders[position], bias))
            self.layers.append(self._layer_of(i, gemms))
        self.lm_head = GridGemm(lm_head, orders[4])
        self.argmax = argmax

    def _rope(self, layer: int) -> tuple[int, int]:
        """Layer `layer`'s rotated dims and cos/sin table (`_Layer.rope`), as the model's
        attention rotates: its own count (0 in a NoPE layer), and the local layers' rope
        where the model has one."""
        model = self.model
        local = model.local_rotary is not None and layer in self.config.local_layers
        return model.layers[layer].self_attn.rotary_dim, int(local)

    def _rope_tables(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions' rows of the model's cos/sin tables, [T, 2 * tables, half]: its
        rope, then its local layers' where it has one."""
        model = self.model
        rope = model.rotary(positions)
        if model.local_rotary is None:
            return rope
        return torch.cat((rope, model.local_rotary(positions)), dim=1)

    def build_and_warm_up(
        self,
        block_size: int,
        cached: bool = False,
        compile_elsewhere: bool = False,
        release_dense: bool = False,
    ) -> None:
        """Build the GEMMs, then compile (or load from numba's disk cache) every kernel
        serving will call, by running small batches through each path on a scratch cache
        (only the fused step where one serves and the kernels are `cached`). Marks the
        executor ready; an error is kept in `error` and the executor never becomes ready
        (the model's torch forward keeps serving).

        compile_elsewhere (a serving process): kernels not known to be cached compile in
        a forked child first (`compile_in_child`), and this process then only loads them.
        release_dense: this process does not serve on the model's forward meanwhile, so it
        releases the dense weights as soon as the child holds them (`compile_in_child`)."""
        try:
            if self.compiled and compile_elsewhere and not cached:
                cached = self.compile_in_child(block_size, release_dense)
                if cached and self.store is not None and self.store.is_file():
                    # The child stored the weights it built: `activate` reads them back
                    # once the dense weights are released, so the two forms never
                    # coexist beside a serving torch forward.
                    self._build_at_activation = block_size
                    self._ready.set()
                    return
            self._build_and_load(block_size, cached)
        except Exception as exc:  # kept and reported: the torch forward serves instead
            self.error = exc
            log.exception("CPU executor: warm-up failed; the model's torch forward serves")
            return
        self._ready.set()

    def _build_and_load(self, block_size: int, cached: bool) -> None:
        """`_build`, then the warm-up batches that compile or load the kernels."""
        self._build()
        log.info(
            "CPU executor: %s GEMMs, %s ops between them%s",
            self.mode,
            "compiled" if self.compiled else "torch",
            f"; steps of up to {self.fused.max_tokens} tokens in one compiled call"
            if self.fused is not None
            else "",
        )
        if self.compiled:
            with torch.inference_mode():
                self._run_warm_up_batches(block_size, cached)

    def compile_in_child(self, block_size: int, release_dense: bool = False) -> bool:
        """Compile every kernel serving will call into numba's disk cache in a forked
        child: it shares the model's weights copy-on-write, builds the executor's form of
        them, runs the warm-up and exits. A process that compiles keeps about 0.5 GiB of
        LLVM's memory for life; the child's is returned when it exits (and this process
        builds its own form only then, so the two never coexist). Returns whether the
        kernels are cached now; False where there is no fork or no writable cache (the
        caller then compiles them itself). Raises RuntimeError where the child failed or
        timed out: compiling here would hold the child's memory for the server's life
        (and a child killed for memory would take the server with it), so the model's
        torch forward keeps serving instead.

        release_dense: where the built weights will be stored, release this process's
        dense weights once the child is forked: the child, which releases them after
        building, is then their last holder, and their pages go back before it compiles.
        The caller reads them again if the child fails."""
        from pagedinfer.kernels.cpu.compile_record import record_directory
        from pagedinfer.service.memory import release_free_heap

        directory = record_directory()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        if not hasattr(os, "fork") or not os.access(directory, os.W_OK):
            return False
        started = time.monotonic()
        # The child's garbage collections would write to every object's header and so
        # copy the parent's whole Python heap: the objects that exist now are left out of
        # them (the child still collects its own: compiling makes much cyclic garbage).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self._warm_up_and_exit(block_size)
        gc.unfreeze()
        if release_dense and self.store is not None:
            self._release_dense_weights()
            release_free_heap()
        log.info("CPU executor: compiling the kernels in a child process (pid %d)", pid)
        deadline = started + CHILD_COMPILE_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
                raise RuntimeError(
                    f"the compiling child took over {CHILD_COMPILE_TIMEOUT_S:.0f} s and was stopped"
                )
            time.sleep(0.5)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            cause = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            hint = " (SIGKILL: often the memory limit)" if code == -signal.SIGKILL else ""
            raise RuntimeError(f"the compiling child failed: {cause}{hint}")
        log.info("CPU executor: kernels compiled in %.0f s", time.monotonic() - started)
        return True

    def _warm_up_and_exit(self, block_size: int) -> None:
        """The forked child of `compile_in_child`: build, run the warm-up (which compiles
        every kernel into the disk cache), then leave without running any of the parent's
        clean-up. It dies with the thread that forked it, and runs torch on one thread
        (the parent's OpenMP pool does not exist in a fork)."""
        from pagedinfer.service.memory import release_free_heap

        code = 1
        try:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            # Under a memory limit, the kernel's OOM killer takes this child, not the
            # server (which then reports it and serves on the torch forward).
            with contextlib.suppress(OSError):
                Path("/proc/self/oom_score_adj").write_text("1000\n")
            torch.set_num_threads(1)
            self._build()
            self._release_built_weights()
            self._release_dense_weights()  # shared with the server, or held only here
            release_free_heap()  # the build's scratch, before compiling adds LLVM's
            with torch.inference_mode():
                self._run_warm_up_batches(block_size)
            code = 0
        except BaseException:  # reported by the exit code: nothing may escape a fork
            log.exception("CPU executor: compiling in the child failed")
        finally:
            logging.shutdown()
            os._exit(code)

    def _release_built_weights(self) -> None:
        """In the compiling child, after the build (which stored what it built): hand the
        built weights' pages back to the kernel, so that they read as zeros. Compiling
        depends only on the arrays' types and shapes, and the child's results are thrown
        away, so its warm-up compiles the same kernels without holding a second copy of
        the weights beside the server's."""
        arrays: list[np.ndarray] = []
        if self.fused is not None:
            fused = self.fused
            arrays += [*fused.codes, *fused.scales, *fused.second_codes, *fused.second_scales]
        if self.argmax is not None:
            argmax = self.argmax
            arrays += [argmax.codes, argmax.offsets, argmax.scales, argmax.bounds]
        for array in arrays:
            zero_pages(array)

    def _run_warm_up_batches(self, block_size: int, cached: bool = False) -> None:
        config = self.config
        num_blocks = max(8, 2 * -(-16 // block_size))  # room for the steps below at any size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        dtype = self.config_dtype()
        caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_layers)
        ]
        # Two sequences: a prompt, then decodes with greedy and sampled rows, then a draft
        # of a few tokens (the verify kernel); each through the fused step and layer by
        # layer where there is one. Last, one token alone: its query view is contiguous,
        # which numba compiles as a kernel variant of its own.
        prompt = min(2 * block_size + 3, num_blocks // 2 * block_size - 8)
        steps = [[(0, prompt), (1, 5)], [(0, 1), (1, 1)], [(0, 4), (1, 1)], [(0, 1)]]
        if cached and self.fused is not None:
            # Loading the fused step's variants needs only their argument types: no long
            # prompt (the slowest step to run).
            steps = steps[1:]
        fused_paths = (False,) if self.fused is None else (True,) if cached else (True, False)
        from pagedinfer.kernels.cpu.compile_progress import compile_progress

        # Each kernel compiled is logged; the steps only where they compile (a first start).
        level = logging.DEBUG if cached else logging.INFO
        with compile_progress(len(fused_paths) * len(steps), level) as progress:
            for use_fused in fused_paths:
                lengths = [0, 0]
                for step in steps:
                    progress.begin_step()
                    self._warm_up_step(caches, block_size, lengths, step, use_fused)

    def _warm_up_step(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lengths: list[int],
        step: list[tuple[int, int]],
        use_fused: bool,
    ) -> None:
        half = caches[0][0].shape[0] // 2  # blocks per sequence
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, count in step:
            pos = np.arange(lengths[seq], lengths[seq] + count)
            blocks = seq * half + pos // block_size
            ids.append(pos % self.config.vocab_size)
            positions.append(pos)
            slots.append(blocks * block_size + pos % block_size)
            lengths[seq] += count
            seq_lens.append(lengths[seq])
            starts.append(starts[-1] + count)
        tables = np.stack([np.arange(s * half, (s + 1) * half) for s, _ in step])
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).long(),
            block_tables=torch.from_numpy(tables).int(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
        )
        last = torch.tensor(starts[1:], dtype=torch.int64) - 1
        greedy = torch.tensor([True, False][: len(step)])
        saved = self.fused
        if not use_fused:
            self.fused = None
        try:
            self._forward(
                torch.from_numpy(np.concatenate(ids)).long(),
                torch.from_numpy(np.concatenate(positions)).long(),
                caches,
                attn,
                last,
                greedy,
            )
        finally:
            self.fused = saved

    def config_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- serving ----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether warm-up finished and the executor can serve (it then serves every step)."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def activate(self, released: Callable[[], None] | None = None) -> None:
        """Start serving: release the model's dense GEMM weights, which the executor holds
        in its own form. Call between steps, from the thread that runs them. After a
        child compiled the kernels, the executor's form is read from the store here,
        once the dense weights are released (a pause of a second or two); if that fails
        it raises with the dense weights released, and the caller reads them again.
        released: called between the two, e.g. to hand the freed heap back to the kernel
        before the store's arrays are allocated (in another thread's arena, they would
        not reuse it)."""
        if self.active:
            return
        if not self.ready:
            raise RuntimeError("CPU executor: activate before warm-up finished")
        self._release_dense_weights()
        if released is not None:
            released()
        if self._build_at_activation is not None:
            self._build_and_load(self._build_at_activation, cached=True)
            self._build_at_activation = None
        self.active = True

    def _release_dense_weights(self) -> None:
        model = self.model
        for layer in model.layers:
            for linear in layer.linears():
                linear.weight = nn.Parameter(linear.weight.to("meta"), requires_grad=False)
        if model.lm_head is not None:
            model.lm_head.weight = nn.Parameter(
                model.lm_head.weight.to("meta"), requires_grad=False
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward (same arguments), plus greedy: bool [S], the rows whose only
        use is their argmax. Returns fp32 logits [S, vocab] and, where it picked greedy
        rows' tokens without their logits, int64 [S] tokens (-1 for the other rows, whose
        logits are written; a picked row's logits are not)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries for {len(self.layers)} layers"
            )
        if greedy is not None and greedy.shape != logits_indices.shape:
            raise ValueError(
                f"greedy has shape {tuple(greedy.shape)}, logits_indices "
                f"{tuple(logits_indices.shape)}"
            )
        cap = self.config.final_logit_softcapping
        if cap is None:
            return self._forward(input_ids, positions, kv_caches, attn, logits_indices, greedy)
        # Capped, distinct logits may round to one value, whose first index the sampler's
        # argmax takes: every row's logits are computed and capped as the model caps them.
        logits, _ = self._forward(input_ids, positions, kv_caches, attn, logits_indices, None)
        return torch.tanh(logits / cap) * cap, None

    @property
    def attention_scale(self) -> float:
        """What attention scales the scores by, as the model's attention does."""
        return (self.config.query_pre_attn_scalar or self.config.head_dim) ** -0.5

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model.embed(input_ids)  # the model's own (Gemma 3 scales it)
        rope = self._rope_tables(positions)
        attn.compiled = self.compiled
        if self.fused is not None:
            out = self._fused_step(hidden, rope, kv_caches, attn, logits_indices, greedy)
            if out is not None:
                return out
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            self._layer(layer, hidden, rope, kv_cache, attn)
        normed = self._norm(hidden[logits_indices], self.model.norm.scale())
        if greedy is None or self.argmax is None or not bool(greedy.any()):
            return self._logits(normed), None
        from pagedinfer.kernels.cpu import greedy_argmax

        tokens = torch.full(logits_indices.shape, -1, dtype=torch.int64)
        tokens[greedy] = greedy_argmax.lm_head_argmax(normed[greedy], self.argmax)
        logits = torch.empty(normed.shape[0], self.config.vocab_size)  # picked rows' unwritten
        needed = tokens < 0
        if bool(needed.any()):
            logits[needed] = self._logits(normed[needed])
        return logits, tokens

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return self.lm_head(normed).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if self.compiled:
            from pagedinfer.kernels.cpu import layer_ops

            return layer_ops.rms_norm(x, weight, eps)
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (xf * scale * weight.float()).to(x.dtype)

    def _layer(
        self,
        layer: _Layer,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> None:
        """hidden += the layer's attention and MLP, in place (the model's DecoderLayer)."""
        config = self.config
        num_tokens, nh, nkv, d = (
            hidden.shape[0],
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        q_size, kv_size = nh * d, nkv * d
        scale = self.attention_scale
        qkv = layer.qkv(self._norm(hidden, layer.norms[0]))
        query = qkv[:, :q_size].view(num_tokens, nh, d)
        k_cache, v_cache = kv_cache
        validate = not attn.validated
        if self.compiled:  # rotation and cache write in one kernel, reading qkv's rows once
            from pagedinfer.kernels.cpu import layer_ops

            if validate:
                key = qkv[:, q_size : q_size + kv_size].view(num_tokens, nkv, d)
                value = qkv[:, q_size + kv_size :].view(num_tokens, nkv, d)
                check_write_kv(key, value, k_cache, v_cache, attn.slot_mapping, False)
            layer_ops.rope_write_kv(
                qkv,
                rope,
                attn.slot_mapping,
                k_cache,
                v_cache,
                nh,
                layer.qk_norm,
                config.rms_norm_eps,
                *layer.rope,
            )
        else:
            qk = qkv[:, : q_size + kv_size].view(num_tokens, nh + nkv, d)
            if layer.qk_norm is not None:  # each q and k head, before the rotation
                qk[:, :nh] = self._norm(qk[:, :nh], layer.qk_norm[0])
                qk[:, nh:] = self._norm(qk[:, nh:], layer.qk_norm[1])
            dims, table = layer.rope
            if dims:
                self.model.rotary.rotate(qk[..., :dims], rope[:, 2 * table : 2 * table + 2])
            value = qkv[:, q_size + kv_size :].view(num_tokens, nkv, d)
            kernels.write_kv(
                qk[:, nh:],
                value,
                k_cache,
                v_cache,
                attn.slot_mapping,
                check_values=False,
                validate=validate,
            )
        args = (query, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc)
        window = layer.window
        if validate:
            check_paged_attention(*args, scale, None, check_values=False, sliding_window=window)
        plan = attn.plan_for(query, k_cache, v_cache, window)
        out = kernels.paged_attention(
            *args, scale, validate=False, plan=plan, sliding_window=window
        ).view(num_tokens, q_size)
        attn.validated = True
        post = layer.post_norms
        if post is None:
            layer.o.add_into(hidden, out)
        else:  # Gemma 3: the attention's output normed before the residual add
            hidden += self._norm(layer.o(out), post[0])
        gate_up = layer.gate_up(self._norm(hidden, layer.norms[1]))
        gelu = self.gelu
        if self.compiled:
            from pagedinfer.kernels.cpu import layer_ops

            act = layer_ops.silu_mul(gate_up, gelu)
        else:
            gate, up = gate_up.split(config.intermediate_size, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)).mul_(up)
        if post is None:
            layer.down.add_into(hidden, act)
        else:
            hidden += self._norm(layer.down(act), post[1])

    def _fused_step(
        self,
        hidden: torch.Tensor,
        rope: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step as one compiled call (`fused_step`), where it serves the batch: up to
        `FusedWeights.max_tokens` new tokens, every sequence on the compiled attention
        kernels. None: the step runs layer by layer."""
        from pagedinfer.kernels.cpu import fused_step

        config = self.config
        tokens = hidden.shape[0]
        if tokens > self.fused.max_tokens:
            return None
        arrays = self._fused_caches(hidden, kv_caches)
        if arrays is None:
            return None
        k_cache, v_cache = kv_caches[0]
        query = hidden.new_empty(tokens, config.num_heads, config.head_dim)
        qsl = attn.query_start_loc
        args = (query, k_cache, v_cache, attn.block_tables, attn.seq_lens, qsl)
        scale = self.attention_scale
        if not attn.validated:  # the checks the first layer's calls make
            key = hidden.new_empty(tokens, config.num_kv_heads, config.head_dim)
            check_write_kv(key, key, k_cache, v_cache, attn.slot_mapping, False)
            # Columns behind the window hold freed blocks only where every layer has it.
            check_paged_attention(
                *args, scale, None, check_values=False, sliding_window=config.kv_window
            )
        plan = decode_plan(attn, k_cache.shape[1]) or attn.plan_for(query, k_cache, v_cache)
        if plan.groups:
            return None
        attn.validated = True
        if self._step_scratch is None:
            self._step_scratch = fused_step.StepScratch()
        return fused_step.fused_forward(
            self.fused,
            self._step_shape(k_cache.shape[1]),
            hidden,
            rope,
            attn.slot_mapping,
            kv_caches,
            plan,
            logits_indices,
            scale,
            None if greedy is None else greedy.numpy(),
            self.step_profile,
            arrays,
            self._step_scratch,
        )

    def _fused_caches(
        self, hidden: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Any:
        """The fused step's views of these caches (`fused_step.CacheArrays`), kept from
        step to step, or None where the compiled attention kernels do not take them."""
        from pagedinfer.kernels.cpu import fused_step, paged_decode

        known = self._cache_arrays
        if known is not None and fused_step.views_of(known, kv_caches):
            return known
        config = self.config
        k_cache, v_cache = kv_caches[0]
        query = hidden.new_empty(1, config.num_heads, config.head_dim)
        if not paged_decode.supports(query, k_cache, v_cache):
            return None
        self._cache_arrays = fused_step.cache_arrays(kv_caches)
        return self._cache_arrays

    def _step_shape(self, block_size: int) -> Any:
        shape = self._step_shapes.get(block_size)
        if shape is None:
            from pagedinfer.kernels.cpu import fused_step

            config = self.config
            shape = fused_step.StepShape(
                hidden=config.hidden_size,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                intermediate=config.intermediate_size,
                vocab=config.vocab_size,
                block_size=block_size,
                gelu=self.gelu,
            )
            self._step_shapes[block_size] = shape
        return shape


def decode_plan(attn: AttentionMetadata, block_size: int) -> torch_ops.AttentionPlan | None:
    """The plan `attn.plan_for` makes on the compiled kernels for a batch in which every
    sequence has one new token (a step that only decodes), made without its general
    bookkeeping; None for any other batch. Longest context first, as there."""
    qsl = attn.query_start_loc.numpy()
    num_seqs = qsl.shape[0] - 1
    if num_seqs < 1 or qsl[0] != 0 or qsl[-1] != num_seqs:
        return None
    if num_seqs > 1 and not bool((qsl[1:] - qsl[:-1] == 1).all()):
        return None
    lens = attn.seq_lens.numpy()
    tables = attn.block_tables.numpy()
    if num_seqs == 1:
        order = np.zeros(1, np.int64)
        ordered_tables = np.ascontiguousarray(tables, dtype=np.int32)
    else:
        order = np.argsort(-lens.astype(np.int64), kind="stable")
        ordered_tables = tables[order].astype(np.int32, copy=False)
    decodes = torch_ops._Decodes(order, ordered_tables, lens[order].astype(np.int32))
    return torch_ops.AttentionPlan([], block_size, decodes)


def _norms(
    layer: nn.Module,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """The scales of the layer's input norms (attention, MLP) and of its output norms, or
    None where it has none (`DecoderLayer.block_norms`)."""
    attention_in, mlp_in, attention_out, mlp_out = layer.block_norms()
    post = None
    if attention_out is not None and mlp_out is not None:
        post = (attention_out.scale(), mlp_out.scale())
    return (attention_in.scale(), mlp_in.scale()), post


def _qk_norm(layer: nn.Module) -> torch.Tensor | None:
    """The layer's query and key head norm scales stacked [2, head_dim], or None."""
    attn = layer.self_attn
    if attn.q_norm is None or attn.k_norm is None:
        return None
    return torch.stack((attn.q_norm.scale(), attn.k_norm.scale()))


POSITIONS = ("qkv", "o", "gate_up", "down", "lm_head")


def bf16_layer_kind() -> str:
    """The kind of the layers' weights with bf16 products: pairs of inputs
    (`grid_gemm.BF16_DOT`), multiplied on AMX tiles where the process may use them
    (`amx_gemm`: a decode step of 24 rows about 4x the fp32 rate), else by `vdpbf16ps`,
    twice the fp32 rate on AMD's Zen 4. On CPUs whose AMX tiles this process may not use,
    where that instruction ran at about half the fp32 rate (Emerald Rapids), the same
    bf16 values widened in registers and multiplied with the fp32 rows
    (`grid_gemm.BF16`): the same bytes, at the fp32 rate."""
    from pagedinfer.kernels.cpu import grid_gemm

    if grid_gemm.amx_tiles():
        return grid_gemm.BF16_DOT
    return grid_gemm.BF16 if amx_bf16() else grid_gemm.BF16_DOT


def choose_grids(
    model: nn.Module, bf16_products: bool = False
) -> tuple[list[list[Any]], Any] | None:
    """Each GEMM position's weights (the four of every layer, in `linears()` order, and
    the LM head) as `grid_gemm.GridWeight`s: where every layer's weight at a position lies
    on a grid, those grids (`weight_grid`), as they are where they come in at most two
    kinds (the fused step runs each layer in its own, `fused_step.FusedWeights`), else
    made one kind (`grid_gemm.one_kind`); otherwise
    that position's weights in tile layout (`grid_gemm.rebuilt`), in 16 bits where every
    value of the position is a bf16 (or every one an fp16: a checkpoint stored in that
    type), else in fp32. bf16_products: every layer's weights as bf16 values in the kind
    `bf16_layer_kind` picks, and the LM head's in `grid_gemm.BF16`, multiplied in fp32
    (`greedy_argmax` proves its tokens for fp32 products). None where a GEMM past q/k/v
    has a bias (`unfused_biases`) or a shape does not tile."""
    from pagedinfer.kernels.cpu import grid_gemm

    if unfused_biases(model.config):
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    file_grids = getattr(model, "gguf_grids", None) or {}
    layer_weights = _gemm_weights(model)
    positions = [[ws[i] for ws in layer_weights[:-1]] for i in range(4)]
    positions.append(layer_weights[-1])
    chosen, described = [], []
    for position, weights in zip(POSITIONS, positions, strict=True):
        grids, sources = [], set()
        if bf16_products:
            kind = grid_gemm.BF16 if position == "lm_head" else bf16_layer_kind()
            grids = [grid_gemm.rebuilt(w, kind) for w in weights]
            if any(g is None for g in grids):
                return None
            chosen.append(grids)
            described.append(f"{position} {kind}")
            continue
        for weight in weights:
            grid, source = weight_grid(weight, names.get(id(weight), ""), file_grids)
            if grid is None:
                grids = None
                break
            grids.append(grid)
            sources.add(source)
        if grids is not None and len({g.variant for g in grids}) > 2:
            grids = grid_gemm.one_kind(grids)
        if grids is None:
            narrowest = {grid_gemm.narrowest(w) for w in weights}
            kind = narrowest.pop() if len(narrowest) == 1 else grid_gemm.REBUILT
            grids, sources = [grid_gemm.rebuilt(w, kind) for w in weights], set()
            if any(g is None for g in grids):
                return None
        chosen.append(grids)
        kinds = "/".join(dict.fromkeys(g.kind for g in grids))
        described.append(f"{position} {kinds}" + "".join(f" {s}" for s in sorted(sources)))
    log.info("GEMM grids per position: %s", ", ".join(described))
    layers = [list(layer) for layer in zip(*chosen[:4], strict=True)]
    return layers, chosen[4][0]


def int8_layers(layer_grids: list[list[Any]]) -> list[list[Any]]:
    """Each layer's grids in the layout of integer products with int8 rows where their
    kind takes it (`int8_gemm.to_int8`: a GGUF file's 4-bit, 5-bit, 6-bit and 8-bit
    codes), the others as they are; all as they are on a CPU without AVX2 or AVX-512 VNNI.
    The LM head keeps its grid: `greedy_argmax` picks greedy tokens from its fp32
    products, with integer products of its own."""
    from pagedinfer.kernels.cpu import grid_gemm, int8_gemm

    if not int8_gemm.fast():
        return layer_grids
    # A position keeps 6-bit (5-bit) codes only where every layer's fit (at most two
    # kinds a position in the fused step).
    positions = list(zip(*layer_grids, strict=True))
    six_bits = [
        all(int8_gemm.six_bits_fit(g) for g in grids if g.kind in grid_gemm.FINE)
        for grids in positions
    ]
    five_bits = [
        all(int8_gemm.five_bits_fit(g) for g in grids if g.kind == grid_gemm.SCALED8)
        for grids in positions
    ]
    converted = [
        [
            int8_gemm.to_int8(g, six, five) or g
            for g, six, five in zip(layer, six_bits, five_bits, strict=True)
        ]
        for layer in layer_grids
    ]
    described = [
        f"{position} " + "/".join(dict.fromkeys(layer[i].kind for layer in converted))
        for i, position in enumerate(POSITIONS[:4])
    ]
    log.info("GEMM layers with int8 rows: %s", ", ".join(described))
    return converted


def gemm_shapes(model: nn.Module) -> list[list[tuple[int, int]]]:
    """Each layer's GEMM weight shapes (out, in) by position, the LM head's last: what a
    weight store must hold (`weight_store.load`)."""
    return [[tuple(w.shape) for w in ws] for ws in _gemm_weights(model)]


def _gemm_weights(model: nn.Module) -> list[list[torch.Tensor]]:
    """Each layer's four GEMM weights in `linears()` order, then [the LM head's]."""
    layers = [[linear.weight for linear in layer.linears()] for layer in model.layers]
    return [*layers, [model.lm_head_weight()]]


def weight_grid(weight: torch.Tensor, name: str, file_grids: Any) -> tuple[Any, str]:
    """The quantisation grid of one fp32 GEMM weight and where it came from: the model
    file's blocks (`file_grids[name]`, a GGUF file's grid as codes, d, m, low, high)
    where they give exactly the weight the model holds; else the grid found in its
    values (`grid_gemm.to_grid`); (None, "") where neither."""
    from pagedinfer.kernels.cpu import grid_gemm

    if name in file_grids:
        block = file_grids[name]
        supers = getattr(block, "supers", None)
        grid = grid_gemm.from_codes(block.codes, block.d, block.m, block.low, block.high, supers)
        if grid is not None and grid_gemm.holds(grid, weight.detach()):
            return grid, "(from the file's blocks)"
        log.warning(
            "CPU executor: %s: the file's blocks do not give the model's weight; "
            "finding its grid in the fp32 values",
            name,
        )
    grid = grid_gemm.to_grid(weight)
    return grid, "" if grid is None else "(found in the fp32 values)"


def find_grids(model: nn.Module) -> tuple[list[list[Any]], Any] | None:
    """Every GEMM weight's quantisation grid (`choose_grids` with no position rebuilt), or
    None where one has none, or a GEMM has a bias."""
    from pagedinfer.kernels.cpu import grid_gemm

    grids = choose_grids(model)
    if grids is None or any(g.kind in grid_gemm.DENSE for g in (*grids[0][0], grids[1])):
        return None
    return grids


def warm_up_running() -> bool:
    """Whether a background warm-up is still compiling: a process must not run its
    interpreter shutdown under it (LLVM aborts when its state is torn down mid-compile)."""
    return any(t.name == WARM_UP_THREAD and t.is_alive() for t in threading.enumerate())


def unfused_biases(config: Any) -> bool:
    """Whether a model config's GEMMs add biases that the fused step does not: o_proj's or
    the MLP's. It adds q/k/v biases (Qwen2's) to the product before the rotation."""
    return bool(config.o_proj_bias or config.mlp_bias)


def choose_mode(model: nn.Module) -> tuple[str, bool] | None:
    """Which GEMMs and whether compiled kernels serve this model on this CPU: decided by
    the weights' dtype and the CPU's features, never by timing anything. "grid" becomes
    "rebuilt" when building finds no position on a grid (`choose_grids`), and "mkl"
    where a shape does not tile."""
    dtype = model.embed_tokens.weight.dtype
    compiled = dtype == torch.float32 and torch_ops.compiled_kernels()
    config = model.config
    if compiled and not unfused_biases(config):
        return "grid", True
    if mkl_fp32_available(dtype):
        return "mkl", compiled
    if onednn_bf16_available(dtype):
        return "onednn", False
    return None


def prepare(
    model: nn.Module,
    block_size: int,
    background: bool = False,
    cached: bool = False,
    store: Path | None = None,
    compile_first: bool = False,
    bf16_products: bool = False,
    int8_products: bool = False,
) -> CpuExecutor | None:
    """The executor for `model` on this CPU, or None where the model's own torch forward
    must serve it: a feature the executor lacks, weights off the CPU, or no faster GEMMs
    for its dtype here.

    Compiles the kernels serving will call (numba's disk cache makes this fast after the
    first start) before returning, or with background=True in a thread (compiling in a
    child process, `compile_in_child`) while the caller keeps serving on the torch
    forward: `ready` then turns true, and the caller calls `activate` between steps.
    cached: the kernels are known to be in the disk cache (`compile_record`); then only
    the fused step is warmed up, and the layer-by-layer path (steps past the fused
    step's size) loads its kernels on first use. store: a file that keeps the built
    grids between starts (`weight_store`), named by everything they depend on.
    compile_first (without background): compile in a child process all the same, and
    release the model's dense weights meanwhile, for a memory limit that cannot hold
    them, a compiling child and the KV cache at once; the executor serves on return,
    or the caller reads the dense weights again (`error` says why).
    bf16_products: the layers' GEMMs multiply in bf16 (the model served with --dtype
    bfloat16 on a CPU with AVX512-BF16, its fp32 weights rounded to bf16 values;
    `bf16_products_serve` says where this applies).
    int8_products: the layers' GEMMs over a quantised model's codes multiply them by
    their input rows quantised to int8 per block of 32 (`int8_layers`), as llama.cpp
    does; without it, the exact fp32 products of the dequantised weights.
    """
    missing = unsupported_features(model.config)
    if missing:
        log.info("CPU executor: not used, the model has features it lacks: %s", missing)
        return None
    if model.embed_tokens.weight.device.type != "cpu":
        return None
    choice = choose_mode(model)
    if choice is None:
        return None
    if bf16_products and choice != ("grid", True):
        raise ValueError("bf16 products need the compiled kernels and no bias past q/k/v's")
    executor = CpuExecutor(
        model, *choice, store=store, bf16_products=bf16_products, int8_products=int8_products
    )
    if background:
        threading.Thread(
            target=executor.build_and_warm_up,
            args=(block_size, cached, True),
            name=WARM_UP_THREAD,
            daemon=True,
        ).start()
    else:
        executor.build_and_warm_up(block_size, cached, compile_first, compile_first)
        if executor.ready:
            executor.activate()
    return executor


__all__: Sequence[str] = ("SUPPORTED_FEATURES", "CpuExecutor", "prepare", "unsupported_features")
