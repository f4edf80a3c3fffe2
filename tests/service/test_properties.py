"""Property tests: random add / step / finish / abort / fork / preempt sequences keep the
block manager and scheduler consistent under both policies and several block sizes.

A shadow KV cache plays the model runner: every step it applies the copy-on-write
copies, writes each computed position, then checks that every context a request
attends to holds exactly that request's tokens and salt. A wrong prefix-cache hit, a
missed copy or a block reused while in use all show up there.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kv_invariants import (
    assert_all_free,
    assert_cached_blocks_match,
    assert_context,
    assert_finished_hold_nothing,
    assert_pool_consistent,
)

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler

MAX_MODEL_LEN = 48
VOCAB = 4  # a tiny vocabulary, so that prompts and outputs share prefixes often
PREFIXES = [[0] * 32, [i % 3 for i in range(32)], [(i * 7) % VOCAB for i in range(32)]]


def prefix_keys(request: Request) -> list[int]:
    """key[p] identifies (salt, tokens[0..p]): what the KV at position p depends on."""
    key, keys = hash(("salt", request.cache_salt)), []
    for token in request.all_token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


class Harness:
    def __init__(self, policy: str, block_size: int, num_blocks: int, seqs: int, budget: int):
        config = EngineConfig(
            block_size=block_size,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            allocation_policy=policy,
        )
        self.scheduler = Scheduler(config, num_blocks)
        self.kv = self.scheduler.kv_cache
        self.size = block_size
        self.content: dict[int, list[int | None]] = {}  # shadow KV: block -> key per slot
        self.requests: list[Request] = []  # every request ever added, finished ones too
        self.copies = 0

    # Operations -------------------------------------------------------------------

    def add(self, prefix: int, prefix_len: int, tail: list[int], salt: str | None, max_tokens: int):
        prompt = PREFIXES[prefix][:prefix_len] + tail
        request = Request(
            str(len(self.requests)), prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt
        )
        self.requests.append(request)
        self.scheduler.add_request(request)

    def step(self) -> None:
        output = self.scheduler.schedule()
        config = self.scheduler.config
        assert output.num_batched_tokens == sum(s.num_tokens for s in output.scheduled)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        ids = [s.request.request_id for s in output.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & {r.request_id for r in output.preempted}
        self.copies += len(output.copy_blocks)
        for src, dst in output.copy_blocks:
            self.content[dst] = list(self.content.get(src, [None] * self.size))
        sampled = {}
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            assert item.num_tokens >= 1 and start + item.num_tokens <= request.num_tokens
            keys = prefix_keys(request)
            for p in range(start, start + item.num_tokens):
                slots = self.content.setdefault(
                    request.block_table[p // self.size], [None] * self.size
                )
                slots[p % self.size] = keys[p]
            if start + item.num_tokens == request.num_tokens:
                sampled[request.request_id] = keys[-1] % VOCAB
        # All of the step's KV is written before attention reads any of it.
        for item in output.scheduled:
            self.assert_context(item.request, item.request.num_computed_tokens + item.num_tokens)
        self.scheduler.update_from_output(output, sampled)
        self.finish_at_max_tokens()

    def finish(self, index: int, status: RequestStatus) -> None:
        if self.requests:  # any request: finished and unknown ones must be harmless
            self.scheduler.finish_request(
                self.requests[index % len(self.requests)].request_id, status
            )

    def fork(self, index: int) -> None:
        parents = [r for r in self.scheduler.running if r.num_computed_tokens > 0]
        if not parents:
            return
        parent = parents[index % len(parents)]
        computed = parent.num_computed_tokens
        child = Request(
            f"{parent.request_id}.{len(self.requests)}",
            parent.prompt_token_ids,
            parent.sampling_params,
            cache_salt=parent.cache_salt,
        )
        for token in parent.all_token_ids[parent.num_prompt_tokens : computed]:
            child.append_output_token(token)
        if computed >= parent.num_prompt_tokens:  # its own sampled token
            child.append_output_token((parent.all_token_ids[computed] + 1) % VOCAB)
        self.requests.append(child)
        self.scheduler.fork_request(parent, child)
        self.finish_at_max_tokens()

    def finish_at_max_tokens(self) -> None:
        """What the engine does after an update or a fork: end what reached max_tokens."""
        for request in list(self.scheduler.running):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    def preempt(self) -> None:
        if self.scheduler.running:
            self.scheduler._preempt_last()

    # Invariants -------------------------------------------------------------------

    def assert_context(self, request: Request, length: int) -> None:
        assert_context(self.content, self.size, prefix_keys(request), request, length)

    def check(self) -> None:
        assert_pool_consistent(self.scheduler)
        live = list(self.scheduler.requests.values())
        assert len(live) == self.scheduler.num_running + self.scheduler.num_waiting
        for request in self.scheduler.waiting:
            assert request.status is RequestStatus.WAITING
            assert request.block_table == [] and request.num_computed_tokens == 0
        for request in self.scheduler.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens < request.num_tokens
            if self.kv.policy == "paged":
                assert len(request.block_table) == -(-request.num_computed_tokens // self.size)
            else:
                assert len(request.block_table) == self.kv.reserved_blocks
            self.assert_context(request, request.num_computed_tokens)
            assert_cached_blocks_match(self.scheduler, request)
        assert_finished_hold_nothing(self.requests)

    def assert_all_free(self) -> None:
        assert_all_free(self.scheduler)


add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),
    st.integers(0, 28),
    st.lists(st.integers(0, VOCAB - 1), max_size=8),
    st.sampled_from([None, "tenant"]),
    st.integers(1, 10),
)
step_op = st.just(("step",))
operation = st.one_of(
    add_op,
    add_op,
    step_op,
    step_op,
    step_op,
    step_op,
    st.tuples(st.sampled_from(["finish", "abort"]), st.integers(0, 50)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.just(("preempt",)),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Harness, list[tuple], bool]:
    policy = draw(st.sampled_from(["paged", "contiguous"]))
    block_size = draw(st.sampled_from([1, 16, 7]))
    per_request = -(-MAX_MODEL_LEN // block_size)  # the largest request always fits
    num_blocks = draw(st.integers(per_request, 3 * per_request))
    harness = Harness(
        policy, block_size, num_blocks, draw(st.integers(1, 6)), draw(st.integers(1, 40))
    )
    return harness, draw(st.lists(operation, min_size=20, max_size=80)), draw(st.booleans())


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_operations_keep_blocks_consistent(scenario) -> None:
    harness, operations, drain = scenario
    for name, *args in operations:
        if name == "add":
            prefix, prefix_len, tail, salt, max_tokens = args
            if prefix_len + len(tail) == 0:
                tail = [1]
            harness.add(prefix, prefix_len, tail, salt, max_tokens)
        elif name == "step":
            harness.step()
        elif name in ("finish", "abort"):
            status = (
                RequestStatus.FINISHED_STOPPED
                if name == "finish"
                else RequestStatus.FINISHED_ABORTED
            )
            harness.finish(args[0], status)
        elif name == "fork":
            harness.fork(args[0])
        else:
            harness.preempt()
        harness.check()

    if drain:  # nothing is queued forever: the oldest request always makes progress
        for _ in range(5000):
            if not harness.scheduler.has_unfinished():
                break
            harness.step()
            harness.check()
        assert not harness.scheduler.has_unfinished()
    for request in harness.requests:
        harness.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
    harness.scheduler.schedule()
    harness.check()
    harness.assert_all_free()
    stats = harness.scheduler.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"forked: {any('.' in r.request_id for r in harness.requests)}")
    event(f"copied: {harness.copies > 0}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 16, 7]),
    requests=st.lists(add_op, min_size=2, max_size=12),
    tightness=st.integers(0, 8),
    budgets=st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
def test_outputs_do_not_depend_on_memory_pressure(
    block_size: int, requests: list[tuple], tightness: int, budgets: tuple[int, int]
) -> None:
    """Preemption by recompute, chunking and prefix hits never change what is generated."""
    per_request = -(-MAX_MODEL_LEN // block_size)
    roomy = Harness("paged", block_size, 12 * per_request, 12, budgets[0])
    tight_blocks = per_request + per_request * tightness // 16  # one request, plus up to 50%
    tight = Harness("paged", block_size, tight_blocks, 8, budgets[1])
    for harness in (roomy, tight):
        for _, prefix, prefix_len, tail, salt, max_tokens in requests:
            harness.add(prefix, prefix_len, tail or [1], salt, max_tokens)
        while harness.scheduler.has_unfinished():
            harness.step()
        harness.check()
        harness.assert_all_free()
    assert [r.output_token_ids for r in tight.requests] == [
        r.output_token_ids for r in roomy.requests
    ]
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in tight.requests)
    event(f"preempted: {tight.scheduler.num_preemptions > 0}")
