"""Continuous batching: which requests run this step, and with how many tokens.

Each step spends a token budget (max_num_batched_tokens) over at most max_num_seqs
requests: running requests first, oldest admission first (one decode token each, or
their next prefill chunk), then waiting requests in arrival order. When a running
request cannot get a block, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the head of the queue to be recomputed. With
speculative decoding on, a decode also carries a draft (spec_decode.py) when the budget
and its blocks allow, never at the cost of preempting anyone.

The scheduler decides what runs; it never decides when a request ends. The engine
checks stop tokens, stop strings and max_tokens, hands over the tokens a request keeps
(`update_from_output`) and then ends it (`finish_request`), as it does on an abort.
Pure Python: the model runner turns a SchedulerOutput into tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedinfer.service.block_manager import KVCacheManager, KVCacheStats
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.spec_decode import Speculator, kept_draft_length

# Share of the KV blocks that admitting a new request must leave free for the running
# ones to grow into: admitting until the pool is full means the next block boundary of
# any running request preempts one. 1% halves the preemptions on the `pagedinfer
# simulate` trace for a negligible number of extra steps.
ADMISSION_WATERMARK = 0.01


@dataclass
class ScheduledRequest:
    """Compute all_token_ids[num_computed_tokens:] up to num_tokens tokens, followed by
    the draft tokens (a decode's guess at its next tokens, counted in num_tokens)."""

    request: Request
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan. Do the copy_blocks (src, dst) before writing this step's KV."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # since the last step; blocks freed
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0


@dataclass
class SchedulerStats:
    kv: KVCacheStats
    running: int
    waiting: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative tokens looked up at admission
    prefix_cache_hits: int  # cumulative tokens found in the cache
    draft_tokens: int = 0  # cumulative draft tokens verified (speculative decoding)
    accepted_draft_tokens: int = 0  # cumulative draft tokens kept
    kv_events_dropped: int = 0  # cumulative KV event batches dropped (kv_events.py)


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_blocks: int, sliding_window: int | None = None
    ) -> None:
        self.config = config
        self.kv_cache = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.allocation_policy,
            max_model_len=config.max_model_len,
            sliding_window=sliding_window,  # every layer's window: its KV blocks are freed
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._finished: list[Request] = []
        # Contiguous requests reserve their whole length up front and never grow.
        paged = config.allocation_policy == "paged"
        self.watermark_blocks = int(ADMISSION_WATERMARK * num_blocks) if paged else 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.speculator = Speculator(config) if config.num_speculative_tokens else None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request that passed `check_fits`, under an id no unfinished request has."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """ValueError naming the reason if the request could never run here.

        Reads only what never changes (the configuration and the pool's size), so it may
        run beside a step in another thread.
        """
        rid = request.request_id
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid}: prompt_token_ids is empty")
        max_len = self.config.max_model_len
        total = request.num_prompt_tokens + request.sampling_params.max_tokens
        if total > max_len:
            raise ValueError(
                f"request {rid}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {total} exceeds max_model_len ({max_len})"
            )
        # The last sampled token is never computed, so it needs no slot.
        needed = self.kv_cache.num_blocks_for(total - 1)
        if needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"request {rid}: prompt plus max_tokens ({total} tokens) needs {needed} KV "
                f"blocks, more than the whole cache "
                f"({self.kv_cache.num_blocks} blocks of {self.config.block_size} tokens)"
            )

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        # The tokens and blocks the running requests still need: a draft gets only what
        # they leave, so that it never costs anyone a step or a preemption.
        pending = pending_blocks = 0
        speculator = self.speculator
        drafting = speculator is not None and speculator.drafts_with(len(self.running))
        if drafting:
            for r in self.running:
                pending += r.num_tokens - r.num_computed_tokens
                pending_blocks += self.kv_cache.num_new_blocks(
                    r, r.num_tokens - r.num_computed_tokens
                )
            # The step's rows without drafts, the waiting prompts' included: what a
            # draft's rows add to (spec_decode.saving_rows).
            rows = min(budget, pending + self._waiting_tokens(budget - pending))
            step = speculator.step_rows(self.running, bool(self.waiting), rows)
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            request = self.running[i]
            need = request.num_tokens - request.num_computed_tokens
            num_tokens = min(need, budget)
            draft = []
            if drafting:
                pending -= need
                pending_blocks -= self.kv_cache.num_new_blocks(request, need)
                draft = speculator.draft(request, budget - num_tokens - pending, step)
                # A guess gets only blocks nothing else needs; short of them, it is dropped.
                if draft and not self.kv_cache.allocate_slots(
                    request, num_tokens + len(draft), keep_free=pending_blocks
                ):
                    draft = []
            if draft or self._allocate_or_preempt(request, num_tokens, preempted):
                scheduled.append(ScheduledRequest(request, num_tokens + len(draft), draft))
                if draft:
                    step.rows += len(draft)
                budget -= num_tokens + len(draft)
                i += 1

        # Admit nothing in a step that had to preempt: memory is short.
        while self.waiting and not preempted and budget > 0 and len(self.running) < max_seqs:
            request = self.waiting[0]
            # A prompt whose logprobs are asked for is computed in full: blocks read from
            # the prefix cache would give no logits.
            scoring = request.sampling_params.prompt_logprobs is not None
            hits = [] if scoring else self.kv_cache.get_computed_blocks(request)
            num_cached = len(hits) * self.config.block_size
            num_tokens = min(request.num_tokens - num_cached, budget)
            # Admission leaves a few blocks free for the running requests to grow into;
            # an empty engine admits regardless, so a request that fits alone can start.
            keep_free = self.watermark_blocks if self.running else 0
            if not self.kv_cache.allocate_slots(request, num_tokens, hits, keep_free):
                break  # strict FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_cached_tokens = num_cached
            self.running.append(request)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens

        finished, self._finished = self._finished, []
        return SchedulerOutput(
            scheduled=scheduled,
            preempted=preempted,
            finished=finished,
            copy_blocks=self.kv_cache.take_pending_copies(),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _waiting_tokens(self, limit: int) -> int:
        """The tokens the waiting requests still need, counted until they reach `limit`."""
        total = 0
        for request in self.waiting:
            if total >= limit:
                break
            total += request.num_tokens - request.num_computed_tokens
        return total

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, preempted: list[Request]
    ) -> bool:
        """Preempt from the back of the running list until the request's slots fit.

        False when the request itself had to go. The oldest request always fits once
        alone, since admission rejects anything larger than the cache.
        """
        while not self.kv_cache.allocate_slots(request, num_tokens):
            victim = self._preempt_last()
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt_last(self) -> Request:
        """Preempt by recompute: free the newest running request's blocks and put it
        back at the head of the queue (its output tokens are kept)."""
        victim = self.running.pop()
        self.kv_cache.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> None:
        """Record a step's results: computed tokens, and the tokens the caller keeps for
        each request whose chunk reached the end of its tokens: one sampled token, or for
        a request with a draft, the draft tokens it kept followed by one more (fewer where
        a stop came first). Finishes nobody: a request that reaches its max_tokens here
        must be finished by the caller before the next step.

        An empty list keeps nothing yet (a beam waiting for the rest of its beam search,
        beam_search.py): the request computes its last token again next step."""
        for item in output.scheduled:
            request, draft = item.request, item.draft_token_ids
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since schedule()
            request.num_computed_tokens += item.num_tokens - len(draft)
            held = not draft and sampled.get(request.request_id) == []
            if held and request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens -= 1
            self.kv_cache.free_outside_window(request)  # blocks behind every layer's window
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            rid = request.request_id
            if rid not in sampled:
                raise ValueError(f"request {rid} completed a step with no token")
            tokens = sampled[rid]
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            kept = kept_draft_length(rid, draft, tokens)
            max_tokens = request.sampling_params.max_tokens
            if request.num_output_tokens + len(tokens) > max_tokens:
                raise ValueError(
                    f"request {rid}: {len(tokens)} more tokens exceed its max_tokens "
                    f"({max_tokens}); a request must be finished when it reaches it"
                )
            # The kept draft tokens' KV was computed in this step, over the right tokens.
            request.num_computed_tokens += kept
            for token in tokens:
                request.append_output_token(token)
            if draft:
                self.speculator.record(len(draft), kept)
                self.kv_cache.trim(request)  # blocks a rejected draft reached

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish or abort a waiting or running request and free its blocks; idempotent."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self.kv_cache.free(request)
        request.status = status
        self._finished.append(request)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start a running child that shares the parent's computed tokens and blocks.

        The child's tokens must agree with the parent's on the computed prefix and go
        at least one token past it (its own sampled token). Like a request of its own,
        a child that reaches its max_tokens or a stop must be finished by the caller.
        """
        if child.parent_id is None:
            child.parent_id = parent.request_id
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"fork parent {parent.request_id} is not running")
        num_computed = parent.num_computed_tokens
        if (
            child.num_tokens <= num_computed
            or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]
        ):
            raise ValueError(
                f"fork child {child.request_id} must extend parent {parent.request_id}'s "
                f"{num_computed} computed tokens"
            )
        child.num_computed_tokens = num_computed
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv_cache.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def stats(self) -> SchedulerStats:
        waiting_demand = sum(self.kv_cache.num_blocks_for(r.num_tokens) for r in self.waiting)
        return SchedulerStats(
            kv=self.kv_cache.stats(waiting_demand),
            running=len(self.running),
            waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            draft_tokens=self.speculator.draft_tokens if self.speculator else 0,
            accepted_draft_tokens=self.speculator.accepted_draft_tokens if self.speculator else 0,
        )
