"""Speculative decoding's pieces: prompt-lookup drafts, which decodes draft, which draft
tokens are kept, and how a seeded generator forgets the draws of the rest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.spec_decode import (
    GeneratorCheckpoint,
    NgramProposer,
    Speculator,
    accepted_length,
    kept_draft_length,
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


def test_observed_drafts_limit_the_next_one() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    request = make_request([1, 2, 3, 4, 5, 6, 1, 2])
    assert proposer.propose(request, 4) == [3, 4, 5, 6]
    proposer.observe(request, drafted=4, kept=0, longest=4)
    assert proposer.propose(request, 4) == [3]
    proposer.observe(request, drafted=1, kept=1, longest=4)
    assert proposer.propose(request, 4) == [3, 4]
    proposer.observe(request, drafted=2, kept=2, longest=2)
    assert proposer.propose(request, 4) == [3, 4]  # never past `longest`
    assert proposer.propose(request, 1) == [3]  # nor past the caller's limit


@pytest.mark.parametrize(("drafted", "kept"), [(0, 0), (2, 3), (2, -1)])
def test_an_impossible_observation_is_refused(drafted: int, kept: int) -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    with pytest.raises(ValueError, match="kept"):
        proposer.observe(make_request([1, 2, 1]), drafted, kept, longest=4)


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


def speculator(**config) -> Speculator:
    return Speculator(EngineConfig(num_speculative_tokens=4, **config))


def decoding_request(tokens: list[int], outputs: list[int], max_tokens: int = 16) -> Request:
    request = Request("r", tokens, SamplingParams(max_tokens=max_tokens))
    for token in outputs:
        request.append_output_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_only_a_decode_drafts_within_its_budget_and_the_tokens_left() -> None:
    spec = speculator()
    request = decoding_request([1, 2, 3, 4, 5, 6, 1], [2])
    assert spec.draft(request, spare=8) == [3, 4, 5, 6]
    assert spec.draft(request, spare=2) == [3, 4]
    assert spec.draft(decoding_request([1, 2, 3, 4, 5, 6, 1], [2], max_tokens=3), 8) == [3]
    prefill = decoding_request([1, 2, 3, 4, 5, 6, 1, 2], [])
    assert spec.draft(prefill, spare=8) == []  # before the first output: no draft


def test_drafts_stop_above_speculative_max_running_and_results_are_counted() -> None:
    spec = speculator(speculative_max_running=2)
    assert spec.drafts_with(2) and not spec.drafts_with(3)
    request = decoding_request([1, 2, 3, 4, 5, 6, 1], [2])
    spec.record(request, drafted=4, kept=1)
    assert (spec.draft_tokens, spec.accepted_draft_tokens) == (4, 1)
    assert spec.draft(request, spare=8) == [3, 4]  # kept + 1
