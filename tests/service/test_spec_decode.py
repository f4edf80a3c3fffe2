"""Speculative decoding's pieces: prompt-lookup drafts, which decodes draft and how long
(the rule that a draft row must pay for itself), which draft tokens are kept, and how a
seeded generator forgets the draws of the rest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.spec_decode import (
    DraftHistory,
    GeneratorCheckpoint,
    NgramProposer,
    Speculator,
    StepRows,
    accepted_length,
    draft_length,
    kept_draft_length,
    saving_rows,
)


def make_request(tokens: list[int]) -> Request:
    return Request("r", tokens)


def reference_draft(tokens: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """The rule by brute force: longest n-gram first, its latest occurrence that ends
    before the last token, and the (up to) k tokens that followed it."""
    if k <= 0:
        return []
    end = len(tokens)
    for n in range(lookup_max, lookup_min - 1, -1):
        if n >= end:
            continue
        tail = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_the_tokens_that_followed_the_tail_earlier() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    request = make_request([10, 11, 12, 13, 14, 20, 10, 11, 12])
    assert proposer.propose(request, 2) == [13, 14]


def test_the_longest_matching_ngram_wins_over_a_later_shorter_one() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    # The 3-gram [1, 2, 3] occurred at the start (then 7); the 1-gram [3] occurred later
    # too (then 8), but a longer match is tried first.
    request = make_request([1, 2, 3, 7, 9, 3, 8, 1, 2, 3])
    assert proposer.propose(request, 1) == [7]


def test_among_occurrences_of_the_same_ngram_the_latest_wins() -> None:
    proposer = NgramProposer(lookup_min=2, lookup_max=2)
    request = make_request([5, 6, 1, 9, 5, 6, 2, 9, 5, 6])
    assert proposer.propose(request, 2) == [2, 9]


def test_falls_back_to_shorter_ngrams_down_to_lookup_min() -> None:
    tokens = [4, 8, 1, 2, 9, 8]  # only the 1-gram [8] occurred before
    assert NgramProposer(lookup_min=1, lookup_max=3).propose(make_request(tokens), 3) == [1, 2, 9]
    assert NgramProposer(lookup_min=2, lookup_max=3).propose(make_request(tokens), 3) == []


def test_the_tail_never_matches_itself() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    assert proposer.propose(make_request([5, 6, 7]), 4) == []
    assert proposer.propose(make_request([42]), 4) == []


def test_no_draft_when_nothing_matches_or_no_tokens_are_wanted() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    assert proposer.propose(make_request([1, 2, 3, 4, 5]), 4) == []
    repeating = make_request([1, 2, 1, 2, 1, 2])
    assert proposer.propose(repeating, 0) == []
    assert proposer.propose(repeating, -3) == []
    assert proposer.propose(repeating, 2) == [1, 2]


def test_an_occurrence_near_the_end_gives_a_shorter_draft() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=2)
    # [3, 4] occurred just before the tail: only two tokens followed it.
    assert proposer.propose(make_request([1, 2, 3, 4, 5, 6, 3, 4]), 8) == [5, 6, 3, 4]
    # A run of one token: the latest earlier [7, 7] is followed by a single token.
    assert proposer.propose(make_request([7, 7, 7, 7]), 5) == [7]


def test_drafts_follow_the_tokens_appended_since_the_last_call() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    request = make_request([1, 2, 3, 4])
    assert proposer.propose(request, 3) == []
    for token in (9, 1, 2):
        request.append_output_token(token)
    assert proposer.propose(request, 3) == [3, 4, 9]
    for token in (3, 5):
        request.append_output_token(token)
    assert proposer.propose(request, 3) == []
    request.append_output_token(9)
    assert proposer.propose(request, 3) == [1, 2, 3]


def test_each_request_has_its_own_index() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=2)
    a = make_request([1, 2, 1])
    b = make_request([1, 3, 1])
    assert proposer.propose(a, 2) == [2, 1]
    assert proposer.propose(b, 2) == [3, 1]


@pytest.mark.parametrize(("lookup_min", "lookup_max"), [(3, 2), (0, 2), (-1, 3), (0, 0)])
def test_invalid_lookup_bounds_are_rejected(lookup_min: int, lookup_max: int) -> None:
    with pytest.raises(ValueError, match="lookup_min"):
        NgramProposer(lookup_min=lookup_min, lookup_max=lookup_max)


@settings(max_examples=300, deadline=None)
@given(
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    appends=st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=5), st.integers(-1, 6)), max_size=12
    ),
)
def test_incremental_lookups_agree_with_the_brute_force_rule(
    bounds: tuple[int, int], prompt: list[int], appends: list[tuple[list[int], int]]
) -> None:
    """Calls interleaved with appends of any size (none, one, several tokens) keep the
    index exact: every draft equals the rule applied to the whole sequence."""
    lookup_min, lookup_max = bounds[0], bounds[0] + bounds[1]
    proposer = NgramProposer(lookup_min=lookup_min, lookup_max=lookup_max)
    request = make_request(prompt)
    assert proposer.propose(request, 4) == reference_draft(prompt, lookup_min, lookup_max, 4)
    for tokens, max_tokens in appends:
        for token in tokens:
            request.append_output_token(token)
        expected = reference_draft(request.all_token_ids, lookup_min, lookup_max, max_tokens)
        assert proposer.propose(request, max_tokens) == expected


@pytest.mark.parametrize(
    ("draft", "picks", "accepted"),
    [
        ([], [9], 0),
        ([1, 2, 3], [9, 9, 9, 9], 0),
        ([1, 2, 3], [1, 2, 9, 9], 2),
        ([1, 2], [1, 2, 5], 2),
    ],
)
def test_the_draft_tokens_kept_are_those_the_sampler_picked_too(
    draft: list[int], picks: list[int], accepted: int
) -> None:
    assert accepted_length(draft, picks) == accepted


def test_tokens_handed_back_must_be_a_draft_prefix_and_one_more() -> None:
    assert kept_draft_length("r", [1, 2, 3], [1, 2, 9]) == 2
    assert kept_draft_length("r", [1, 2, 3], [1]) == 0  # a stop came with the first token
    assert kept_draft_length("r", [], [4]) == 0
    for tokens in ([], [2, 9], [1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match="not a prefix of its draft"):
            kept_draft_length("r", [1, 2, 3], tokens)


def test_a_rewound_generator_draws_as_if_only_the_kept_rows_had_drawn() -> None:
    import torch

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(11)

    plain = generator()
    expected = [torch.rand(1, generator=plain).item() for _ in range(3)]
    drafted = generator()
    checkpoint = GeneratorCheckpoint(drafted)
    for _ in range(4):  # the rows of a draft of three tokens
        torch.rand(1, generator=drafted)
    checkpoint.rewind(2)  # one draft token kept, then the sampler's own pick
    assert torch.rand(1, generator=drafted).item() == expected[2]


# The rule --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acceptance", "batch_rows", "pass_rows", "longest", "length"),
    [
        # A lone decode (bar 1/6): a fair guess pays for two rows, 0.5 and 0.25 > 1/6.
        (0.5, 1, 5, 4, 2),
        (0.9, 1, 5, 4, 4),  # a good one for all it may have
        (0.9, 1, 5, 2, 2),  # never past `longest`
        (0.1, 1, 5, 4, 0),  # a poor guess pays for nothing
        # 49 rows (bar 49/54 = 0.907): only guesses that almost never miss pay.
        (0.5, 49, 5, 4, 0),
        (0.9, 49, 5, 4, 0),
        (0.97, 49, 5, 4, 3),  # 0.97 ** 3 = 0.913 > 0.907 > 0.97 ** 4
        (1.0, 49, 5, 4, 4),
        # A prompt chunk fills the pass (512 rows): nearly nothing pays.
        (0.99, 512, 5, 4, 0),
        # A pass that costs little beyond its rows (a GPU's would cost far more).
        (0.5, 4, 1, 4, 0),
        (0.5, 4, 100, 4, 4),
        (0.0, 1, 100, 4, 0),
        (1.0, 0, 5, 4, 0),  # a pass nobody shares is never saved: nothing pays
    ],
)
def test_a_draft_row_is_kept_only_while_it_pays_for_itself(
    acceptance: float, batch_rows: int, pass_rows: int, longest: int, length: int
) -> None:
    assert draft_length(acceptance, batch_rows, pass_rows, longest) == length


@pytest.mark.parametrize(
    ("step", "remaining", "rows"),
    [
        # Requests wait: every row of the step shares the pass a kept token saves.
        (StepRows(rows=40, queued=True, longest=100, num_longest=1), 5, 40),
        (StepRows(rows=40, queued=True, longest=100, num_longest=1), 100, 40),
        # None wait: only the requests with the most tokens left, within a draft of 4.
        (StepRows(rows=40, queued=False, longest=100, num_longest=1), 100, 1),
        (StepRows(rows=40, queued=False, longest=100, num_longest=3), 96, 3),
        (StepRows(rows=40, queued=False, longest=100, num_longest=3), 95, 0),
        (StepRows(rows=40, queued=False, longest=100, num_longest=3), 5, 0),
    ],
)
def test_a_kept_token_saves_a_pass_shared_by_the_step_or_by_the_longest_requests(
    step: StepRows, remaining: int, rows: int
) -> None:
    assert saving_rows(step, remaining, reach=4) == rows


@settings(max_examples=200, deadline=None)
@given(
    acceptance=st.floats(0, 1),
    rows=st.integers(1, 512),
    pass_rows=st.integers(1, 1000),
    longest=st.integers(0, 16),
)
def test_drafts_shorten_as_the_batch_grows_and_lengthen_as_guesses_improve(
    acceptance: float, rows: int, pass_rows: int, longest: int
) -> None:
    length = draft_length(acceptance, rows, pass_rows, longest)
    assert 0 <= length <= longest
    assert draft_length(acceptance, rows + 1, pass_rows, longest) <= length
    assert draft_length(min(1.0, acceptance + 0.05), rows, pass_rows, longest) >= length


@pytest.mark.parametrize(
    ("guess", "came", "hits", "misses"),
    [
        ([7, 8, 9], [7], 1, 0),  # one step, no draft: the first token was foretold
        ([7, 8, 9], [6], 0, 1),
        ([7, 8, 9], [7, 8, 5], 2, 1),  # a draft of two kept, then the model's own pick
        ([7, 8, 9], [7, 8, 9], 3, 0),
        ([7, 8], [7, 8, 9, 10], 2, 0),  # only the guessed positions count
        ([], [1, 2], 0, 0),  # no n-gram matched: nothing to learn
        ([7, 8], [], 0, 0),  # nothing came (preempted): nothing to learn yet
    ],
)
def test_a_guess_is_scored_by_the_tokens_that_came(
    guess: list[int], came: list[int], hits: int, misses: int
) -> None:
    history = DraftHistory(guess=guess, guess_at=3)
    history.settle([1, 2, 3, *came])
    assert (history.hits, history.misses) == (hits, misses)


def test_acceptance_starts_at_one_in_three_and_follows_recent_steps_most() -> None:
    history = DraftHistory()
    assert history.acceptance == pytest.approx(1 / 3)
    for _ in range(20):
        history.guess, history.guess_at = [1], 0
        history.settle([1])
    assert history.acceptance > 0.8
    for _ in range(10):
        history.guess, history.guess_at = [1], 0
        history.settle([2])
    # Ten misses outweigh twenty older hits.
    assert history.acceptance < 0.5


# The scheduler's side ---------------------------------------------------------------


def speculator(**config) -> Speculator:
    """Passes that cost far more than their rows, unless told: every guess pays."""
    config = {"num_speculative_tokens": 4, "speculative_pass_rows": 10**6, **config}
    return Speculator(EngineConfig(**config))


def decoding_request(tokens: list[int], outputs: list[int], max_tokens: int = 16) -> Request:
    request = Request("r", tokens, SamplingParams(max_tokens=max_tokens))
    for token in outputs:
        request.append_output_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def alone(spec: Speculator, request: Request) -> StepRows:
    return spec.step_rows([request], queued=False, rows=1)


def test_the_step_knows_its_longest_requests() -> None:
    spec = speculator()  # 4 draft tokens: within 4 of the longest counts
    running = [decoding_request([1, 2], [3] * n, max_tokens=20) for n in (10, 6, 12, 17)]
    assert spec.step_rows(running, queued=False, rows=9) == StepRows(9, False, 14, 2)


def test_only_a_decode_drafts_within_its_budget_and_the_tokens_left() -> None:
    spec = speculator()
    request = decoding_request([1, 2, 3, 4, 5, 6, 1], [2])
    assert spec.draft(request, spare=8, step=alone(spec, request)) == [3, 4, 5, 6]
    assert spec.draft(request, spare=2, step=alone(spec, request)) == [3, 4]
    short = decoding_request([1, 2, 3, 4, 5, 6, 1], [2], max_tokens=3)
    assert spec.draft(short, spare=8, step=alone(spec, short)) == [3]
    prefill = decoding_request([1, 2, 3, 4, 5, 6, 1, 2], [])
    assert spec.draft(prefill, spare=8, step=alone(spec, prefill)) == []  # no output yet


def test_a_request_that_finishes_well_before_the_longest_does_not_draft() -> None:
    spec = speculator()
    short = decoding_request([1, 2, 3, 4, 5, 6, 1], [2], max_tokens=8)
    long = decoding_request([1, 2, 3, 4, 5, 6, 1], [2], max_tokens=16)
    step = spec.step_rows([short, long], queued=False, rows=2)
    assert spec.draft(short, spare=8, step=step) == []
    assert spec.draft(long, spare=8, step=step) == [3, 4, 5, 6]
    # With requests waiting, a request that finishes sooner lets the next one in.
    step = spec.step_rows([short, long], queued=True, rows=2)
    assert spec.draft(short, spare=8, step=step) == [3, 4, 5, 6]


def test_drafts_stop_above_speculative_max_running_and_results_are_counted() -> None:
    spec = speculator(speculative_max_running=2)
    assert spec.drafts_with(2) and not spec.drafts_with(3)
    spec.record(drafted=4, kept=1)
    spec.record(drafted=2, kept=2)
    assert (spec.draft_tokens, spec.accepted_draft_tokens) == (6, 3)


def test_a_request_learns_from_its_guesses_even_while_it_does_not_draft() -> None:
    """Beside 11 other rows a fresh request does not draft, but each step checks its
    guess; once its guesses keep coming true, a draft pays even there."""
    spec = speculator(speculative_pass_rows=5)
    request = decoding_request([1, 2, 1, 2, 1], [2], max_tokens=64)
    full = StepRows(rows=12, queued=True, longest=64, num_longest=1)
    drafts = []
    for _ in range(16):
        drafts.append(spec.draft(request, spare=8, step=full))
        request.append_output_token(request.all_token_ids[-2])  # the period-2 guess comes
        request.num_computed_tokens += 1
    assert drafts[0] == []
    assert len(drafts[-1]) >= 1 and set(drafts[-1]) <= {1, 2}
    # A request whose guesses never come true stops drafting, even alone.
    request = decoding_request([1, 2, 1, 2, 1], [2], max_tokens=64)
    lengths = []
    for _ in range(12):
        lengths.append(len(spec.draft(request, spare=8, step=alone(spec, request))))
        guess = spec.proposer.propose(request, 1)
        request.append_output_token(3 - guess[0])  # the other of 1 and 2
        request.num_computed_tokens += 1
    assert lengths[0] == 1 and lengths[-1] == 0
