"""The engine: scheduler -> model runner -> sampler -> stop checks -> streamed deltas.

`LLMEngine` is synchronous: `add_request`, `step`, `abort`. A step schedules, runs the
model and samples; keeps what each draft got right (spec_decode.py); checks every
sample's new tokens for stops and max_tokens (sample_text.py); and only then hands the
scheduler the tokens each request keeps, forks the samples of n > 1, and ends the
samples that ended. The asyncio front is async_engine.py, the offline `LLM` llm.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import torch

from pagedinfer.service import dtypes, prompts, spec_decode
from pagedinfer.service.beam_search import BeamSearch
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.kv_events import create_publisher
from pagedinfer.service.loader import load_model, stored_dtype
from pagedinfer.service.model_runner import ModelOutput, ModelRunner, served_from_store
from pagedinfer.service.outputs import CompletionDelta
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sample_text import NewTokens, SampleText
from pagedinfer.service.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    is_greedy,
    make_generator,
)
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedinfer.service.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    MaskJob,
    MaskPipeline,
    RowMask,
    apply_row_masks,
)
from pagedinfer.service.threads import configure_cpu_threads

log = logging.getLogger(__name__)

EngineStats = SchedulerStats
FINISHED_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


def sample_request_id(request_id: str, index: int) -> str:
    """The scheduler's id for sample `index` of a request: the request's own for the first."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class _Sample:
    """What the engine keeps per sample beside its scheduler request."""

    request: Request
    generator: torch.Generator | None
    text: SampleText
    grammar: GrammarMatcher | None = None  # with a structured output: where it stands


@dataclass
class _Group:
    """One user request: its n samples share the prompt (and its blocks, after forking)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    cache_salt: str | None
    samples: dict[int, _Sample] = field(default_factory=dict)  # forked so far
    finished: set[int] = field(default_factory=set)
    prompt_logprobs: list[dict] | None = None  # with params.prompt_logprobs: so far
    prompt_logprobs_sent: bool = False
    # With use_beam_search: the search, and each live beam's request by slot (the first
    # request is kept for its queue time and cache hit).
    beams: BeamSearch | None = None
    beam_requests: dict[int, Request] = field(default_factory=dict)
    first: Request | None = None

    @property
    def num_slots(self) -> int:
        """Scheduler ids the group may use: one per sample, or per beam."""
        return self.params.beam_width if self.params.use_beam_search else self.params.n


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            )
            raise ValueError(f"--device {config.device}: {why}; use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {config.device}: this machine has {torch.cuda.device_count()} "
                "CUDA device(s), numbered from 0"
            )
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The dtype the model computes in (`dtypes.choose_dtype`: for auto, the checkpoint's
    where the hardware multiplies it natively), logged with the reason."""
    checkpoint = stored_dtype(config.model) if config.dtype == "auto" else None
    flags = dtypes.cpu_flags() if device.type == "cpu" else frozenset()
    choice = dtypes.choose_dtype(config.dtype, checkpoint, device.type, flags)
    log.info(choice.reason)
    native = flags & dtypes.NATIVE_BF16_FLAGS
    if device.type == "cpu" and choice.dtype == "bfloat16" and not native:
        log.warning("this CPU has no native bf16 matmul: bfloat16 runs far slower than float32")
    return getattr(torch, choice.dtype)


def _fork_of(parent: Request, group: _Group, index: int) -> Request:
    """The request of the group's sample (or beam slot) `index`, forked from `parent`: it
    shares the parent's blocks once the scheduler forks it."""
    child = Request(
        request_id=sample_request_id(group.request_id, index),
        prompt_token_ids=group.prompt_token_ids,
        sampling_params=group.params,
        arrival_time=parent.arrival_time,
        cache_salt=group.cache_salt,
    )
    child.parent_id, child.index = parent.request_id, index
    return child


class LLMEngine:
    """Requests in, deltas out, one step at a time; one thread steps it."""

    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config)
        if self.device.type == "cpu":
            configure_cpu_threads(config.num_threads)
        dtype = resolve_dtype(config, self.device)
        # On the CPU, a model whose executor weights an earlier start stored is loaded
        # without its dense GEMM weights (`model_runner.served_from_store`).
        defer = None
        if self.device.type == "cpu":
            defer = partial(
                served_from_store,
                block_size=config.block_size,
                dtype=dtype,
                gguf_activations=config.gguf_activations,
            )
        loaded = load_model(
            config.model,
            self.device,
            dtype,
            max_model_len=config.max_model_len,
            defer_gemm_weights=defer,
        )
        self.config = config
        self.model_config = loaded.config
        self.model_name = loaded.config.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        self.runner = ModelRunner(config, loaded, self.device)
        # A model windowed on every layer frees the KV blocks behind its window.
        self.scheduler = Scheduler(config, self.runner.num_blocks, loaded.config.kv_window)
        # KV-cache events for prefix-aware routers; None unless --kv-events-config.
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        self.kv_events = create_publisher(config.kv_events_config, config.block_size, medium)
        if self.kv_events is not None:
            self.scheduler.kv_cache.enable_events()
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # Advances grammars and fills their masks on a worker, one step ahead.
        self._masks = MaskPipeline(self.vocab_size)
        self._groups: dict[str, _Group] = {}
        # Every sample's id, forked or not yet, -> its group's id: ids never clash.
        self._owner: dict[str, str] = {}

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    # -- input ---------------------------------------------------------------------------

    def encode_prompt(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        chat_options: prompts.ChatOptions | None = None,
    ) -> list[int]:
        """Token ids for exactly one of: text, token ids, or chat messages."""
        return prompts.encode_prompt(
            self.tokenizer,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            chat_options=chat_options,
        )

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """The one check of a request: ValueError naming the problem if it could never
        run here. Reads nothing a step changes, so it may run beside one."""
        prompts.check_token_ids(prompt_token_ids, self.vocab_size)
        biased = sorted(t for t in params.logit_bias if t >= self.vocab_size)
        if biased:
            raise ValueError(
                f"logit_bias holds ids outside the vocabulary [0, {self.vocab_size}): {biased[:5]}"
            )
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
        )
        self.scheduler.check_fits(request)
        if params.use_beam_search and params.beam_width > self.config.max_num_seqs:
            # Beams advance together: more of them than a step runs would wait forever.
            raise ValueError(
                f"best_of: a beam width of {params.beam_width} exceeds max_num_seqs "
                f"({self.config.max_num_seqs})"
            )
        if params.structured_output is not None:
            try:
                self.grammars.check(params.structured_output)
            except ValueError as err:
                raise ValueError(f"structured_output: {err}") from None
        return request

    def add_request(
        self,
        prompt_token_ids: list[int] | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (token ids and params, or one made by `make_request`)."""
        if isinstance(prompt_token_ids, Request):
            request = prompt_token_ids
        else:
            request = self.make_request(
                prompt_token_ids, params, request_id, cache_salt, arrival_time
            )
        request_id, params = request.request_id, request.sampling_params
        group = _Group(request_id, params, request.prompt_token_ids, request.cache_salt)
        sample_ids = [sample_request_id(request_id, i) for i in range(group.num_slots)]
        for sample_id in sample_ids:
            if sample_id in self._owner:
                owner = self._owner[sample_id]
                detail = "" if owner == sample_id == request_id else f" (by request {owner!r})"
                raise ValueError(f"request_id {sample_id!r} is already in use{detail}")
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = []
        self.scheduler.add_request(request)
        if params.use_beam_search:
            group.beams = BeamSearch(params, request.prompt_token_ids, self.eos_token_ids)
            group.beam_requests[0] = group.first = request
        else:
            group.samples[0] = self._new_sample(request, group, 0)
        self._groups[request_id] = group
        self._owner.update(dict.fromkeys(sample_ids, request_id))
        return request_id

    def abort(self, request_id: str) -> list[CompletionDelta]:
        """Abort every unfinished sample of a request; idempotent."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        deltas = []
        for beam in group.beam_requests.values():
            self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
        for index, sample in list(group.samples.items()):
            if index not in group.finished:
                self.scheduler.finish_request(
                    sample.request.request_id, RequestStatus.FINISHED_ABORTED
                )
                deltas.append(self._delta(group, index, [], None, "abort"))
        # Samples not forked yet never will be: report them aborted too.
        prompt_tokens = len(group.prompt_token_ids)
        for index in range(len(group.samples), group.params.n):
            deltas.append(CompletionDelta.aborted(request_id, index, prompt_tokens))
        self._forget(group)
        return deltas

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        if self.kv_events is not None:
            stats.kv_events_dropped = self.kv_events.dropped
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (routers hear `AllBlocksCleared`); False while any
        request holds blocks."""
        done = self.scheduler.kv_cache.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def close(self) -> None:
        """Flush and close the KV event publisher; the engine steps on without it."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
            self.scheduler.kv_cache.enable_events(False)

    def _publish_kv_events(self) -> None:
        """Hand this step's prefix-cache changes to the publisher thread (never blocks)."""
        if self.kv_events is None:
            return
        kv = self.scheduler.kv_cache
        events = kv.take_events()
        if events or self.kv_events.resync_pending:
            self.kv_events.publish(events, snapshot=kv.cached_block_events)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        """One step of every scheduled request; the deltas of the samples that moved."""
        out = self.scheduler.schedule()
        self._publish_kv_events()  # blocks enter and leave the cache only in schedule()
        if not out.scheduled:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_at is None:
                s.request.first_scheduled_at = now
        masks = self._start_masks(out)
        model_out = self.runner.execute(out)
        for request_id, (first, entries) in model_out.prompt_logprobs.items():
            self._add_prompt_logprobs(self._groups[self._owner[request_id]], first, entries)
        drafts = {s.request.request_id: s.draft_token_ids for s in out.scheduled}
        # Each sample's new tokens are checked for stops before the scheduler sees them.
        checked: list[tuple[_Group, int, NewTokens]] = []
        sampled: dict[str, list[int]] = {}
        forks: list[tuple[Request, Request]] = []
        moves: list[MaskJob] = []  # grammars to advance over what their samples kept
        beam_rows, first_row = [], 0
        for req, num_rows in zip(model_out.requests, model_out.num_rows, strict=True):
            group = self._groups[self._owner[req.request_id]]
            if group.beams is not None:
                beam_rows.append((group, req, model_out.logits[first_row]))
            first_row += num_rows
        for (req, index), picks in self._sample(model_out, drafts, masks).items():
            group = self._groups[self._owner[req.request_id]]
            if index == req.index:
                kept = group.samples[index].text.add(picks, req.num_output_tokens)
                sampled[req.request_id] = kept.token_ids
            else:  # the first token of a sample that forks from req
                child = self._child(req, group, index)
                kept = group.samples[index].text.add(picks, 0)
                child.append_output_token(kept.token_ids[0])
                forks.append((req, child))
            sample = group.samples[index]
            if sample.grammar is not None and kept.finish_reason is None:
                # Output tokens once these are kept (a fork's first is in already).
                done = sample.request.num_output_tokens
                done += len(kept.token_ids) if index == req.index else 0
                moves.append((sample.request.request_id, sample.grammar, kept.token_ids, done))
            checked.append((group, index, kept))
        beam_deltas = self._step_beams(beam_rows, sampled, forks)
        self._masks.advance(moves)  # on the worker, while this step's end and the next run
        self.scheduler.update_from_output(out, sampled)
        for parent, child in forks:
            if parent.status is RequestStatus.RUNNING:
                self.scheduler.fork_request(parent, child)
            else:  # a beam preempted while it waited: its child computes its tokens anew
                self.scheduler.add_request(child)
        deltas = beam_deltas
        for group, index, kept in checked:
            if kept.finish_reason is not None:
                self.scheduler.finish_request(
                    group.samples[index].request.request_id, FINISHED_STATUS[kept.finish_reason]
                )
            deltas.append(
                self._delta(group, index, kept.token_ids, kept.logprobs, kept.finish_reason)
            )
        return deltas

    def _start_masks(self, out: SchedulerOutput) -> Future | None:
        """The grammar masks of the constrained requests sampled this step, from the
        worker (`MaskPipeline.start`): request id -> a `RowMask` per row, row j after
        the draft's first j tokens."""
        jobs: list[MaskJob] = []
        for s in out.scheduled:
            req = s.request
            group = self._groups.get(self._owner.get(req.request_id, ""))
            sample = None if group is None else group.samples.get(req.index)
            reaches_end = req.num_computed_tokens + s.num_tokens == req.num_tokens + len(
                s.draft_token_ids
            )
            if sample is not None and sample.grammar is not None and reaches_end:
                draft = list(s.draft_token_ids)
                jobs.append((req.request_id, sample.grammar, draft, req.num_output_tokens))
        return self._masks.start(jobs)

    def _sample(
        self,
        model_out: ModelOutput,
        drafts: dict[str, list[int]],
        masks: Future | None = None,
    ) -> dict[tuple[Request, int], list[SampleResult]]:
        """Each sample's picks: the draft tokens the sampler picked too, then its own
        next pick. The first rows of a request with n > 1 are sampled once per sample.
        masks: from `_start_masks`; the rows of constrained requests are masked first."""
        grammar_masks = {} if masks is None else masks.result()
        if all(self._groups[self._owner[r.request_id]].beams for r in model_out.requests):
            return {}
        masked: list[tuple[int, RowMask]] = []  # (row of `rows`, its mask)
        rows: list[SamplingRow] = []
        owners: list[tuple[int, Request, int]] = []  # (logits row, request, sample index)
        checkpoints: dict[Request, spec_decode.GeneratorCheckpoint] = {}
        first_row = 0
        for req, num_rows in zip(model_out.requests, model_out.num_rows, strict=True):
            group = self._groups[self._owner[req.request_id]]
            if group.beams is not None:  # beam rows go to the search (_step_beams)
                first_row += num_rows
                continue
            forking = group.params.n > 1 and req.num_output_tokens == 0
            draft = drafts[req.request_id]
            for index in range(group.params.n) if forking else [req.index]:
                sample = group.samples.get(index)
                generator = sample.generator if sample else make_generator(group.params.seed, index)
                seeded = generator is not None and not is_greedy(group.params)
                if index == req.index and num_rows > 1 and seeded:
                    checkpoints[req] = spec_decode.GeneratorCheckpoint(generator)
                # Row j of a draft's rows follows draft[:j]: the penalties see it.
                for j in range(num_rows):
                    outputs = req.output_token_ids + draft[:j] if j else req.output_token_ids
                    rows.append(
                        SamplingRow(group.params, group.prompt_token_ids, outputs, generator)
                    )
                    owners.append((first_row + j, req, index))
                    if req.request_id in grammar_masks:  # forks share the first state
                        masked.append((len(rows) - 1, grammar_masks[req.request_id][j]))
            first_row += num_rows
        logits, tokens = model_out.logits, model_out.tokens
        if len(owners) != logits.shape[0]:  # forking rows are sampled n times
            index = [i for i, *_ in owners]
            logits = logits[index]
            tokens = None if tokens is None else tokens[index]
        apply_row_masks(logits, masked)
        results = self.sampler(logits, rows, tokens)
        for i, _ in masked:  # the tokens a grammar forbids are no likely alternative
            top = results[i].top_logprobs
            if top:
                results[i].top_logprobs = [(t, lp) for t, lp in top if lp != float("-inf")]
        picks: dict[tuple[Request, int], list[SampleResult]] = {}
        for (_, req, index), result in zip(owners, results, strict=True):
            picks.setdefault((req, index), []).append(result)
        for (req, index), results in picks.items():
            draft = drafts[req.request_id]
            del results[spec_decode.accepted_length(draft, [r.token_id for r in results]) + 1 :]
            if index == req.index and req in checkpoints:
                checkpoints[req].rewind(len(results))  # one draw per kept token
        return picks

    def _step_beams(
        self,
        rows: list[tuple[_Group, Request, torch.Tensor]],
        sampled: dict[str, list[int]],
        forks: list[tuple[Request, Request]],
    ) -> list[CompletionDelta]:
        """Hand each beam's logits row to its search and advance the searches whose live
        beams have all proposed: continued beams keep a token (in `sampled`, or at once
        for a beam that waited), new beams are added to `forks`, pruned beams free their
        blocks now. A beam whose search cannot advance yet keeps nothing (it waits).
        Returns the outputs of the searches that ended."""
        deltas: list[CompletionDelta] = []
        advancing: list[_Group] = []
        for group, req, logits in rows:
            assert group.beams is not None
            group.beams.propose(req.index, logits)
            sampled[req.request_id] = []
            if group.beams.ready() and group not in advancing:
                advancing.append(group)
        for group in advancing:
            beams, requests = group.beams, group.beam_requests
            assert beams is not None
            step = beams.advance()
            for slot in step.pruned:
                self.scheduler.finish_request(
                    requests.pop(slot).request_id, RequestStatus.FINISHED_STOPPED
                )
            if step.done:
                deltas.extend(self._beam_outputs(group))
                continue
            for parent_slot, slot, token in step.forks:
                parent = requests[parent_slot]
                child = _fork_of(parent, group, slot)
                for earlier in parent.output_token_ids:
                    child.append_output_token(earlier)
                child.append_output_token(token)
                requests[slot] = child
                forks.append((parent, child))
            for slot, token in step.continued.items():
                request = requests[slot]
                if request.request_id in sampled:  # computed this step
                    sampled[request.request_id] = [token]
                else:  # it waited (or was preempted): nothing of this step to record
                    request.append_output_token(token)
        return deltas

    def _beam_outputs(self, group: _Group) -> list[CompletionDelta]:
        """The n best hypotheses of a finished beam search, each as its sample's one and
        last delta; the group is forgotten."""
        assert group.beams is not None and group.first is not None
        first = group.first
        queued = first.first_scheduled_at
        deltas = []
        for index, hypothesis in enumerate(group.beams.best(group.params.n)):
            text = SampleText(
                self.tokenizer, group.prompt_token_ids, group.params, self.eos_token_ids
            )
            text.add([SampleResult(t, None, None) for t in hypothesis.token_ids], 0)
            prompt_logprobs = None
            if index == 0 and group.prompt_logprobs is not None:
                prompt_logprobs = group.prompt_logprobs
            deltas.append(
                CompletionDelta(
                    request_id=group.request_id,
                    index=index,
                    token_ids=hypothesis.token_ids,
                    text=text.take(finished=True),
                    logprobs=hypothesis.logprobs,
                    finish_reason=hypothesis.finish_reason,
                    prompt_tokens=len(group.prompt_token_ids),
                    completion_tokens=len(hypothesis.token_ids),
                    cached_tokens=first.num_cached_tokens,
                    prompt_logprobs=prompt_logprobs,
                    queue_time=None if queued is None else queued - first.arrival_time,
                )
            )
        prompt_tokens = len(group.prompt_token_ids)
        for index in range(len(deltas), group.params.n):  # never short of n, but never hang
            deltas.append(CompletionDelta.aborted(group.request_id, index, prompt_tokens))
        self._forget(group)
        return deltas

    @staticmethod
    def _add_prompt_logprobs(group: _Group, first: int, entries: list[dict]) -> None:
        """Keep the entries of prompt tokens first, first + 1, ... not kept yet: a
        request preempted during its prompt computes (and scores) it again."""
        assert group.prompt_logprobs is not None
        new = len(group.prompt_logprobs) - (first - 1)
        group.prompt_logprobs.extend(entries[max(new, 0) :])

    # -- samples -------------------------------------------------------------------------

    def _new_sample(self, request: Request, group: _Group, index: int) -> _Sample:
        text = SampleText(self.tokenizer, group.prompt_token_ids, group.params, self.eos_token_ids)
        spec = group.params.structured_output
        grammar = None if spec is None else self.grammars.matcher(spec)
        if grammar is not None and index == 0:  # forks start from the first one's mask
            self._masks.advance([(request.request_id, grammar, (), 0)])
        return _Sample(request, make_generator(group.params.seed, index), text, grammar)

    def _child(self, parent: Request, group: _Group, index: int) -> Request:
        """Sample `index` of the group, about to fork from its first sample."""
        child = _fork_of(parent, group, index)
        group.samples[index] = self._new_sample(child, group, index)
        return child

    def _delta(
        self,
        group: _Group,
        index: int,
        token_ids: list[int],
        logprobs: list[dict] | None,
        reason: str | None,
    ) -> CompletionDelta:
        sample = group.samples[index]
        request = sample.request
        prompt_logprobs = None
        if group.prompt_logprobs is not None and token_ids and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        queued = request.first_scheduled_at
        delta = CompletionDelta(
            request_id=group.request_id,
            index=index,
            token_ids=token_ids,
            text=sample.text.take(finished=reason is not None),
            logprobs=logprobs,
            finish_reason=reason,
            prompt_tokens=len(group.prompt_token_ids),
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            queue_time=None if queued is None else queued - request.arrival_time,
        )
        if reason is not None:
            group.finished.add(index)
            if len(group.finished) == group.params.n:
                self._forget(group)
        return delta

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        self._masks.forget([s.request.request_id for s in group.samples.values()])
        for index in range(group.num_slots):
            self._owner.pop(sample_request_id(group.request_id, index), None)
