"""SampleText: a sample's picks become text; a stop or max_tokens ends it, and what
comes after the end is dropped before anyone sees it."""

from __future__ import annotations

from pagedinfer.service.sample_text import SampleText
from pagedinfer.service.sampler import SampleResult
from pagedinfer.service.sampling_params import SamplingParams

EOS = 0
WORDS = {EOS: "", 1: "one ", 2: "two ", 3: "three ", 4: "END", 5: "five "}


class Tokenizer:
    """A stand-in whose ids decode to fixed words."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[i] for i in ids)


def picks(*tokens: int, logprob: float | None = None) -> list[SampleResult]:
    return [
        SampleResult(t, logprob, [(t, logprob)] if logprob is not None else None) for t in tokens
    ]


def sample(**params) -> SampleText:
    return SampleText(Tokenizer(), [5, 5], SamplingParams(**params), eos_token_ids=[EOS])


def test_tokens_stream_as_text_until_max_tokens_ends_the_sample() -> None:
    text = sample(max_tokens=3)
    first = text.add(picks(1, 2), num_output_tokens=0)
    assert (first.token_ids, first.finish_reason, first.logprobs) == ([1, 2], None, None)
    assert text.take(finished=False) == "one two "
    last = text.add(picks(3), num_output_tokens=2)
    assert (last.token_ids, last.finish_reason) == ([3], "length")
    assert text.take(finished=True) == "three "


def test_picks_after_a_stop_are_dropped_and_the_stop_is_the_reason() -> None:
    text = sample(max_tokens=3)
    new = text.add(picks(1, EOS, 2), num_output_tokens=0)
    assert (new.token_ids, new.finish_reason) == ([1, EOS], "stop")
    assert text.take(finished=True) == "one "


def test_a_stop_on_the_last_allowed_token_ends_as_a_stop() -> None:
    text = sample(max_tokens=2, stop=["END"])
    new = text.add(picks(1, 4), num_output_tokens=0)
    assert (new.token_ids, new.finish_reason) == ([1, 4], "stop")
    assert text.take(finished=True) == "one "


def test_a_tail_that_may_start_a_stop_string_is_held_back() -> None:
    text = sample(max_tokens=8, stop=["three"])
    text.add(picks(1, 2), num_output_tokens=0)
    assert text.take(finished=False) == "one "  # "two " may still begin "three"
    new = text.add(picks(3), num_output_tokens=2)
    assert new.finish_reason == "stop"
    assert text.take(finished=True) == "two "


def test_logprobs_come_one_per_kept_token() -> None:
    text = sample(max_tokens=4, logprobs=1)
    new = text.add(picks(1, EOS, 2, logprob=-0.5), num_output_tokens=0)
    assert [entry["token_id"] for entry in new.logprobs] == [1, EOS]
    assert new.logprobs[0] == {"token_id": 1, "logprob": -0.5, "top": [(1, -0.5)]}
