"""NgramProposer: prompt lookup drafts from a sequence's own earlier tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedinfer.service.request import Request
from pagedinfer.service.spec_decode import NgramProposer


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
