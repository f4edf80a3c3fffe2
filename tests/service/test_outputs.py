"""Output records: a request's deltas add up to its outputs."""

from __future__ import annotations

from pagedinfer.service.outputs import CompletionDelta, CompletionOutput, RequestOutput


def delta(index: int, tokens: list[int], text: str, reason: str | None = None, **kw):
    fields = dict(logprobs=None, prompt_tokens=3, completion_tokens=len(tokens), cached_tokens=0)
    return CompletionDelta("r", index, tokens, text, finish_reason=reason, **{**fields, **kw})


def test_deltas_add_up_per_sample_and_the_request_finishes_with_its_last_sample() -> None:
    out = RequestOutput("r", [1, 2, 3], [CompletionOutput(0), CompletionOutput(1)])
    out.add(delta(0, [5], "a", logprobs=[{"token_id": 5}]))
    out.add(delta(1, [6, 7], "bc", "stop", cached_tokens=16))
    assert not out.finished
    out.add(delta(0, [8], "d", "length", logprobs=[{"token_id": 8}]))
    assert out.finished and out.cached_tokens == 16
    first, second = out.outputs
    assert (first.token_ids, first.text, first.finish_reason) == ([5, 8], "ad", "length")
    assert first.logprobs == [{"token_id": 5}, {"token_id": 8}]
    assert (second.token_ids, second.text, second.finish_reason) == ([6, 7], "bc", "stop")
    assert second.logprobs is None


def test_an_aborted_delta_carries_nothing_but_its_reason() -> None:
    aborted = CompletionDelta.aborted("r", 2, prompt_tokens=4)
    assert (aborted.index, aborted.token_ids, aborted.text) == (2, [], "")
    assert (aborted.finish_reason, aborted.prompt_tokens, aborted.completion_tokens) == (
        "abort",
        4,
        0,
    )
