"""Speculative decoding by n-gram lookup: every piece of it, for the scheduler and the engine.

When the last n tokens of a sequence occurred earlier in it, in the prompt or the
output, the tokens that followed that occurrence are a cheap guess at what comes next:
the draft. The scheduler gives a decode its draft (`Speculator.draft`), and the model
computes logits behind the sequence's last token and behind each draft token in one
pass. The engine keeps the draft's tokens for as long as the sampler picks them from
those logits, plus the sampler's pick at the first disagreement or after the whole
draft (`accepted_length`); a seeded generator then forgets the draws of the rows past
that (`GeneratorCheckpoint`). The scheduler counts the kept tokens' KV as computed,
releases the blocks the rest reached, and counts them (`kept_draft_length`,
`Speculator.record`).

The output is exactly what decoding one token at a time gives: every kept token is the
sampler's own pick from logits computed over the same tokens, and since a draft is
fixed in advance, keeping draft token d exactly when the draw at its position gives d
leaves each position's distribution as it was, for random sampling too.

The lookup is vLLM's prompt-lookup rule: the longest n-gram first (prompt_lookup_max
down to prompt_lookup_min), its latest earlier occurrence. Each sequence keeps an index
of its n-grams, extended by the tokens appended since the last lookup, so a lookup
costs a few dict reads however long the sequence is.

Drafts pay only where a pass costs more than its rows. A pass costs a fixed
`speculative_pass_rows` rows (reading the weights, the work that does not grow with the
batch) plus one per row; draft row j gives a token only if the model keeps the draft's
first j tokens, and that token is worth a row of a later pass plus its share of that
pass's fixed cost. Which pass, and shared by whom (`saving_rows`): while requests wait,
any request that finishes sooner lets the next one in, so every row of the step shares
it; with none waiting, the run needs a pass fewer only if every request that may still
run then keeps a token, the ones with the most tokens left, and the others' kept tokens
save nothing. Row j pays while the chance of its token beats B / (B + pass rows) for
the B rows that share the pass (`draft_length`): a lone decode drafts on a fair guess, a
full batch only on guesses that almost never miss. The chance is the request's own
record (`DraftHistory`): every step checks how far its last guess foretold the tokens
that came, drafted or not, recent steps weighing most. Decodes draft only while at most
`speculative_max_running` requests run. All of it is counted, never timed: the same
requests take the same path.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.request import Request

if TYPE_CHECKING:  # the scheduler imports this module, and never needs torch
    import torch


# A request's record starts as one guessed token kept and two missed (a chance of one in
# three), and each step's outcome counts in full while older ones fade by this factor.
PRIOR_HITS, PRIOR_MISSES = 1.0, 2.0
HISTORY_DECAY = 0.9


@dataclass
class _NgramIndex:
    """For each n, every n-gram that ends before the sequence's last token, mapped to
    the position just after its latest occurrence (the token that followed it)."""

    by_length: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending at positions below this are in the index


@dataclass
class NgramProposer:
    """Proposes drafts of up to `max_tokens` tokens per call (see the module doc)."""

    lookup_min: int
    lookup_max: int
    _indexes: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if not 1 <= self.lookup_min <= self.lookup_max:
            raise ValueError(
                f"need 1 <= lookup_min <= lookup_max, got {self.lookup_min} and {self.lookup_max}"
            )

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that may follow the request's tokens; [] if no n-gram
        of its tail occurred before."""
        if max_tokens <= 0:
            return []
        index = self._index(request)
        tokens = request.all_token_ids
        self._extend(index, tokens)
        end = len(tokens)
        for n in range(self.lookup_max, self.lookup_min - 1, -1):
            if n >= end:
                continue
            follow = index.by_length[n].get(tuple(tokens[end - n : end]))
            if follow is not None:
                return tokens[follow : follow + max_tokens]
        return []

    def _index(self, request: Request) -> _NgramIndex:
        index = self._indexes.get(request)
        if index is None:
            lengths = range(self.lookup_min, self.lookup_max + 1)
            index = self._indexes[request] = _NgramIndex({n: {} for n in lengths})
        return index

    @staticmethod
    def _extend(index: _NgramIndex, tokens: list[int]) -> None:
        # The n-gram ending at the last token is the one looked up: it is indexed only
        # once a token follows it, so a lookup never finds the tail itself.
        last = len(tokens) - 1
        for stop in range(index.indexed, last + 1):
            for n, grams in index.by_length.items():
                if stop >= n:
                    grams[tuple(tokens[stop - n : stop])] = stop
        index.indexed = max(index.indexed, last + 1)


@dataclass
class DraftHistory:
    """How well a request's n-gram guesses foretold its next tokens, recent steps first."""

    hits: float = 0.0  # guessed tokens that came, faded by HISTORY_DECAY a step
    misses: float = 0.0  # guesses that went wrong, faded likewise
    guess: list[int] = field(default_factory=list)  # the last guess, not yet checked
    guess_at: int = 0  # the position guess[0] is for

    @property
    def acceptance(self) -> float:
        """The chance that the model keeps the next guessed token."""
        return (self.hits + PRIOR_HITS) / (self.hits + self.misses + PRIOR_HITS + PRIOR_MISSES)

    def settle(self, tokens: Sequence[int]) -> None:
        """Check the last guess against the tokens that came since: its tokens kept up
        to the first that differs, and that one missed (none if every token came)."""
        came = tokens[self.guess_at : self.guess_at + len(self.guess)]
        if not came:
            return  # nothing came yet (a preempted request), or there was no guess
        hits = 0
        while hits < len(came) and came[hits] == self.guess[hits]:
            hits += 1
        self.hits = HISTORY_DECAY * self.hits + hits
        self.misses = HISTORY_DECAY * self.misses + (hits < len(came))
        self.guess = []


@dataclass
class StepRows:
    """Who shares the pass that this step's kept draft tokens could save."""

    rows: int  # the step's rows: its tokens without drafts, then each draft given
    queued: bool  # requests are waiting to start
    longest: int  # the most tokens a running request may still emit
    num_longest: int  # running requests within one draft of the longest


def saving_rows(step: StepRows, remaining: int, reach: int) -> int:
    """The rows that share the pass a kept draft token of a request with `remaining`
    tokens left would save; 0 when it saves none.

    With requests waiting, all the step's rows: whoever finishes sooner lets the next one
    start sooner. With none, the run takes a pass fewer only when every request that may
    still be running then keeps a token: those within `reach` tokens (one draft) of the
    longest. The other requests finish before the last pass whatever they keep.
    """
    if step.queued:
        return step.rows
    return step.num_longest if remaining >= step.longest - reach else 0


def draft_length(acceptance: float, batch_rows: int, pass_rows: int, longest: int) -> int:
    """How many draft tokens pay when `batch_rows` rows share the pass they could save
    (at most `longest`; none when no rows do).

    Draft row j gives a token when the first j draft tokens are kept, acceptance ** j;
    that token would otherwise take a row of a later pass and its share of the pass's
    fixed cost of `pass_rows` rows. So row j pays while acceptance ** j exceeds
    batch_rows / (batch_rows + pass_rows), the share of such a pass that one row is.
    """
    if batch_rows <= 0:
        return 0
    bar = batch_rows / (batch_rows + pass_rows)
    length, chance = 0, acceptance
    while length < longest and chance > bar:
        length += 1
        chance *= acceptance
    return length


class Speculator:
    """The scheduler's side: which decodes draft, how long, and what became of them."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.max_running = config.speculative_max_running
        self.pass_rows = config.speculative_pass_rows
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._histories: weakref.WeakKeyDictionary[Request, DraftHistory] = (
            weakref.WeakKeyDictionary()
        )
        self.draft_tokens = 0  # cumulative draft tokens verified
        self.accepted_draft_tokens = 0  # cumulative draft tokens kept

    def drafts_with(self, num_running: int) -> bool:
        """Whether decodes draft in a step with this many running requests."""
        return num_running <= self.max_running

    def step_rows(self, running: Sequence[Request], queued: bool, rows: int) -> StepRows:
        """This step's `StepRows`, from its rows without drafts."""
        left = [remaining_tokens(r) for r in running]
        longest = max(left, default=0)
        near = sum(n >= longest - self.num_tokens for n in left)
        return StepRows(rows, queued, longest, near)

    def draft(self, request: Request, spare: int, step: StepRows) -> list[int]:
        """The draft of a decode: as long as pays (`saving_rows`, `draft_length`), within
        `spare` tokens of budget and the tokens the request may still emit after this
        step's own; [] for a prefill chunk."""
        # Not before the first output: the prompt's last token samples it, and a request
        # with n > 1 forks there.
        # Nor for a beam: the beam search picks its tokens, not a draft's check.
        decoding = (
            request.num_output_tokens > 0
            and request.num_tokens - request.num_computed_tokens == 1
            and not request.sampling_params.use_beam_search
        )
        if not decoding:
            return []
        history = self._histories.get(request)
        if history is None:
            history = self._histories[request] = DraftHistory()
        tokens = request.all_token_ids
        history.settle(tokens)
        # The guess is made and checked every step, drafted or not: the record follows
        # the request even while it does not pay to draft.
        history.guess = self.proposer.propose(request, self.num_tokens)
        history.guess_at = len(tokens)
        left = remaining_tokens(request)
        sharing = saving_rows(step, left, self.num_tokens)
        longest = min(len(history.guess), spare, left - 1)
        return history.guess[: draft_length(history.acceptance, sharing, self.pass_rows, longest)]

    def record(self, drafted: int, kept: int) -> None:
        """Count a verified draft."""
        self.draft_tokens += drafted
        self.accepted_draft_tokens += kept


def remaining_tokens(request: Request) -> int:
    """The most tokens the request may still emit (EOS may end it sooner)."""
    return request.sampling_params.max_tokens - request.num_output_tokens


def accepted_length(draft: Sequence[int], picks: Sequence[int]) -> int:
    """How many leading draft tokens the sampler picked too, row by row: those are kept,
    followed by the sampler's pick at the row after them (picks has len(draft) + 1)."""
    n = 0
    while n < len(draft) and picks[n] == draft[n]:
        n += 1
    return n


def kept_draft_length(request_id: str, draft: Sequence[int], tokens: Sequence[int]) -> int:
    """How many draft tokens `tokens` keeps: ValueError unless they are a prefix of the
    draft followed by one token (one token alone for a request without a draft)."""
    kept = len(tokens) - 1
    if not tokens or list(tokens[:kept]) != list(draft[:kept]):  # also when kept > len(draft)
        raise ValueError(
            f"request {request_id}: sampled {list(tokens)} is not a prefix of its draft "
            f"{list(draft)} followed by one token"
        )
    return kept


class GeneratorCheckpoint:
    """A seeded generator's state before a draft's rows drew from it.

    The sampler draws one number per row, so the rows past the first rejected draft
    token drew too; `rewind` keeps only the draws of the kept tokens, and the stream goes
    on as it would have without a draft.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.state = generator.get_state()

    def rewind(self, draws: int) -> None:
        import torch

        self.generator.set_state(self.state)
        for _ in range(draws):
            torch.rand(1, generator=self.generator, device=self.generator.device)
