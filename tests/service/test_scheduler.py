"""Scheduler: continuous batching, chunked prefill, preemption, admission, forks."""

from __future__ import annotations

import pytest

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request, RequestStatus
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import Scheduler, SchedulerOutput


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    config = {"block_size": 4, "max_model_len": 64, **config}
    return Scheduler(EngineConfig(**config), num_blocks)


def make_request(
    rid: str, num_prompt: int, max_tokens: int = 4, first: int = 0, salt: str | None = None
) -> Request:
    prompt = list(range(first, first + num_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def model(tokens: list[int]) -> int:
    """A stand-in model: the next token depends on the whole context."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % 1000


def finish_at_max_tokens(scheduler: Scheduler) -> None:
    """What the engine does after each update: end the requests that reached max_tokens."""
    for request in list(scheduler.running):
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {
        s.request.request_id: model(s.request.all_token_ids)
        for s in output.scheduled
        if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens
    }
    scheduler.update_from_output(output, sampled)
    finish_at_max_tokens(scheduler)
    return output


def planned(output: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_tokens for s in output.scheduled}


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    for steps in range(1, max_steps + 1):
        step(scheduler)
        if not scheduler.has_unfinished():
            return steps
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (Request("e", []), "prompt_token_ids is empty"),
        (make_request("long", 60, max_tokens=5), "exceeds max_model_len"),
        (make_request("big", 30, max_tokens=20), "needs 13 KV blocks"),
    ],
)
def test_requests_that_can_never_fit_are_rejected_before_admission(
    request_: Request, reason: str
) -> None:
    scheduler = make_scheduler(num_blocks=12)
    with pytest.raises(ValueError, match=reason):
        scheduler.check_fits(request_)


def test_a_request_that_fits_passes_the_check_and_it_changes_nothing() -> None:
    scheduler = make_scheduler(num_blocks=12)
    scheduler.check_fits(make_request("a", 30, max_tokens=18))  # 47 slots: 12 blocks
    assert not scheduler.has_unfinished() and scheduler.stats().kv.free == 12


def test_invalid_kv_budget_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        make_scheduler(num_blocks=0)
    with pytest.raises(ValueError, match="num_blocks"):
        make_scheduler(num_blocks=15, allocation_policy="contiguous")


def test_prefill_then_one_decode_token_per_step_until_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 5, max_tokens=3)
    scheduler.add_request(request)
    assert planned(step(scheduler)) == {"a": 5}
    assert request.status is RequestStatus.RUNNING
    assert planned(step(scheduler)) == {"a": 1}
    assert planned(step(scheduler)) == {"a": 1}
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason == "length"
    assert request.num_output_tokens == 3
    assert request.block_table == []
    output = scheduler.schedule()
    assert output.finished == [request]
    assert scheduler.schedule().finished == []
    assert scheduler.stats().kv.free == 64


def test_token_budget_chunks_long_prompts_and_running_requests_go_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 13, first=100))
    assert planned(step(scheduler)) == {"a": 3, "b": 5}
    b = scheduler.get_request("b")
    assert b.num_computed_tokens == 5 and b.num_output_tokens == 0  # no sample mid-prompt
    assert planned(step(scheduler)) == {"a": 1, "b": 7}
    assert planned(step(scheduler)) == {"a": 1, "b": 1}
    assert b.num_output_tokens == 1


def test_waiting_requests_are_admitted_in_arrival_order_up_to_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 2, first=ord(rid)))
    assert planned(step(scheduler)) == {"a": 2, "b": 2}
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert planned(step(scheduler)) == {"b": 1, "c": 2}


def test_head_of_queue_that_does_not_fit_blocks_later_requests() -> None:
    scheduler = make_scheduler(num_blocks=8, max_model_len=32)
    scheduler.add_request(make_request("a", 20, max_tokens=4))  # 5 blocks
    scheduler.add_request(make_request("b", 16, max_tokens=4, first=50))  # 4 blocks
    scheduler.add_request(make_request("c", 2, max_tokens=1, first=90))  # would fit
    assert planned(step(scheduler)) == {"a": 20}
    assert scheduler.num_waiting == 2


def test_preemption_evicts_the_most_recently_admitted_and_requeues_it_at_the_head() -> None:
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=8))
    scheduler.add_request(make_request("b", 4, max_tokens=8, first=10))
    scheduler.add_request(make_request("c", 1, max_tokens=2, first=20))
    step(scheduler)  # a, b and c admitted: 3 blocks
    b = scheduler.get_request("b")
    step(scheduler)  # a and b each need a second block: c is preempted
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert planned(output := step(scheduler)) == {"a": 1, "b": 1}
    assert output.preempted == []
    for _ in range(2):
        step(scheduler)
    output = step(scheduler)  # a needs a third block: b goes
    assert [r.request_id for r in output.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.stats().num_preemptions == 2


def test_output_is_identical_with_and_without_preemption() -> None:
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
        requests = [make_request(str(i), 3 + 5 * i % 11, 9 + i % 5, first=i * 7) for i in range(8)]
        for request in requests:
            scheduler.add_request(request)
        run_to_completion(scheduler)
        return {r.request_id: r.output_token_ids for r in requests}, scheduler.num_preemptions

    roomy, roomy_preemptions = outputs(num_blocks=64)
    tight, tight_preemptions = outputs(num_blocks=7)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_prefix_cache_hits_skip_computation_and_are_counted() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    b = scheduler.get_request("b")
    assert planned(step(scheduler)) == {"b": 2}  # 8 tokens come from the cache
    assert b.num_cached_tokens == 8
    assert scheduler.get_request("b") is None
    stats = scheduler.stats()
    assert stats.prefix_cache_queries == 20
    assert stats.prefix_cache_hits == 8


def test_other_salt_gets_no_prefix_hit() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=1, salt="x"))
    step(scheduler)
    scheduler.add_request(make_request("b", 10, max_tokens=1, salt="y"))
    assert planned(step(scheduler)) == {"b": 10}


def test_abort_frees_blocks_for_waiting_and_running_and_is_idempotent() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6, first=40))
    step(scheduler)
    for rid in ("a", "b", "a", "missing"):
        scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    finished = scheduler.schedule().finished
    assert [(r.request_id, r.status.finish_reason) for r in finished] == [
        ("a", "abort"),
        ("b", "abort"),
    ]
    assert scheduler.stats().kv.used == 0


def test_request_finished_between_schedule_and_update_is_left_alone() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    output = scheduler.schedule()
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, {"a": 1})
    request = output.scheduled[0].request
    assert request.output_token_ids == [] and request.status is RequestStatus.FINISHED_ABORTED


def test_a_missing_sample_is_an_error_not_a_hang() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="no token"):
        scheduler.update_from_output(scheduler.schedule(), {})


def test_fork_shares_blocks_and_schedules_a_copy_of_the_shared_last_block() -> None:
    scheduler = make_scheduler()
    parent = make_request("p", 6, max_tokens=4)
    scheduler.add_request(parent)
    step(scheduler)
    child = Request("p-1", parent.prompt_token_ids, parent.sampling_params, index=1)
    child.append_output_token(999)
    scheduler.fork_request(parent, child)
    assert child.status is RequestStatus.RUNNING and child.parent_id == "p"
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == 6
    shared_last = parent.block_table[-1]
    output = step(scheduler)
    assert planned(output) == {"p": 1, "p-1": 1}
    assert output.copy_blocks == [(shared_last, parent.block_table[-1])]
    assert child.block_table[-1] == shared_last
    run_to_completion(scheduler)
    assert child.num_output_tokens == 4 and parent.num_output_tokens == 4
    assert scheduler.stats().kv.used == 0


def test_a_fork_whose_parent_and_child_both_end_at_once_returns_every_block() -> None:
    scheduler = make_scheduler()
    parent = make_request("p", 6, max_tokens=1)
    scheduler.add_request(parent)
    scheduler.update_from_output(scheduler.schedule(), {"p": 5})  # its only token
    assert parent.status is RequestStatus.RUNNING  # the caller ends it, after the fork
    child = Request("p-1", parent.prompt_token_ids, parent.sampling_params, index=1)
    child.append_output_token(6)
    scheduler.fork_request(parent, child)
    assert child.block_table == parent.block_table
    for rid in ("p-1", "p"):
        scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
    assert [r.request_id for r in scheduler.schedule().finished] == ["p-1", "p"]
    assert not scheduler.has_unfinished()
    assert scheduler.stats().kv.used == 0


def test_tokens_past_max_tokens_are_refused() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=1)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"a": 7})
    with pytest.raises(ValueError, match="exceed its max_tokens"):
        scheduler.update_from_output(scheduler.schedule(), {"a": 8})  # nobody finished it
    assert request.output_token_ids == [7]


def test_fork_child_must_extend_the_parents_computed_tokens() -> None:
    scheduler = make_scheduler()
    parent = make_request("p", 6)
    scheduler.add_request(parent)
    step(scheduler)
    with pytest.raises(ValueError, match="must extend"):
        scheduler.fork_request(parent, make_request("c", 6, first=1))
    with pytest.raises(ValueError, match="must extend"):
        scheduler.fork_request(parent, make_request("c", 6))  # nothing left to compute
    with pytest.raises(ValueError, match="not running"):
        scheduler.fork_request(make_request("q", 6), make_request("c", 6))


def test_stats_demand_counts_the_waiting_queue() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 9, first=20))
    scheduler.add_request(make_request("c", 25, first=40))
    step(scheduler)
    stats = scheduler.stats()
    assert (stats.running, stats.waiting) == (1, 2)
    assert stats.kv.used == 2
    assert stats.kv.demand == 2 + 3 + 7  # more than the cache: real demand


def test_admission_leaves_the_watermark_free_for_running_requests() -> None:
    # 300 blocks of 4 tokens: a watermark of 3 blocks.
    scheduler = make_scheduler(num_blocks=300, max_model_len=1200, max_num_batched_tokens=2048)
    assert scheduler.watermark_blocks == 3
    scheduler.add_request(make_request("a", 4 * 290))  # 290 blocks, admitted alone
    step(scheduler)
    assert scheduler.num_running == 1
    # b's 8 blocks fit in the 9 left after a's first decode, but would leave fewer than 3.
    scheduler.add_request(make_request("b", 4 * 8, first=5000))
    step(scheduler)
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0


def test_contiguous_policy_has_no_watermark() -> None:
    scheduler = make_scheduler(num_blocks=300, allocation_policy="contiguous")
    assert scheduler.watermark_blocks == 0
