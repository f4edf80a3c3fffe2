"""Speculative decoding by n-gram lookup: every piece of it, for the scheduler and the engine.

When the last n tokens of a sequence occurred earlier in it, in the prompt or the
output, the tokens that followed that occurrence are a cheap guess at what comes next:
the draft. The scheduler gives a decode its draft (`Speculator.draft`), and the model
computes logits behind the sequence's last token and behind each draft token in one
pass. The engine keeps the draft's tokens for as long as the sampler picks them from
those logits, plus the sampler's pick at the first disagreement or after the whole
draft (`accepted_length`); a seeded generator then forgets the draws of the rows past
that (`GeneratorCheckpoint`). The scheduler counts the kept tokens' KV as computed,
releases the blocks the rest reached, and lets the request's next draft follow how this
one did (`kept_draft_length`, `Speculator.record`).

The output is exactly what decoding one token at a time gives: every kept token is the
sampler's own pick from logits computed over the same tokens, and since a draft is
fixed in advance, keeping draft token d exactly when the draw at its position gives d
leaves each position's distribution as it was, for random sampling too.

The lookup is vLLM's prompt-lookup rule: the longest n-gram first (prompt_lookup_max
down to prompt_lookup_min), its latest earlier occurrence. Each sequence keeps an index
of its n-grams, extended by the tokens appended since the last lookup, so a lookup
costs a few dict reads however long the sequence is.

A rejected draft token costs a row of the pass and gains nothing; a kept one saves the
sequence a pass, which shortens the run only for the requests that take the most
passes. So a sequence's next draft is at most one token longer than what its last one
kept (one longer again after a draft kept whole, up to `num_speculative_tokens`), and
decodes draft only while at most `speculative_max_running` requests run: a full batch
carries many rows per pass anyway. `benchmarks/draft_limits.py` and the throughput
benchmark measure both choices; their figures are in benchmarks/results/.
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


@dataclass
class _NgramIndex:
    """For each n, every n-gram that ends before the sequence's last token, mapped to
    the position just after its latest occurrence (the token that followed it)."""

    by_length: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending at positions below this are in the index
    draft_limit: int | None = None  # the longest next draft (None: as long as allowed)


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
        """Up to max_tokens tokens that may follow the request's tokens, and no more than
        its drafts so far allow (`observe`); [] if no n-gram of its tail occurred before."""
        index = self._index(request)
        if index.draft_limit is not None:
            max_tokens = min(max_tokens, index.draft_limit)
        if max_tokens <= 0:
            return []
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

    def observe(self, request: Request, drafted: int, kept: int, longest: int) -> None:
        """A draft of `drafted` tokens of which the model kept the first `kept`: the
        request's next draft may have kept + 1 tokens, or one more than this one if it was
        kept whole, up to `longest`."""
        if not 0 <= kept <= drafted or drafted == 0:
            raise ValueError(f"kept {kept} of a draft of {drafted} tokens")
        index = self._index(request)
        index.draft_limit = min(longest, drafted + 1 if kept == drafted else kept + 1)

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


class Speculator:
    """The scheduler's side: which decodes draft, how long, and what became of them."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.max_running = config.speculative_max_running
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_tokens = 0  # cumulative draft tokens verified
        self.accepted_draft_tokens = 0  # cumulative draft tokens kept

    def drafts_with(self, num_running: int) -> bool:
        """Whether decodes draft in a step with this many running requests."""
        return num_running <= self.max_running

    def draft(self, request: Request, spare: int) -> list[int]:
        """The draft of a decode: at most `spare` tokens of budget, and no more than the
        request may still emit after this step's own token; [] for a prefill chunk."""
        # Not before the first output: the prompt's last token samples it, and a request
        # with n > 1 forks there.
        decoding = (
            request.num_output_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1
        )
        if not decoding:
            return []
        room = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return self.proposer.propose(request, min(self.num_tokens, spare, room))

    def record(self, request: Request, drafted: int, kept: int) -> None:
        """Count a verified draft, and let the request's next draft follow it."""
        self.draft_tokens += drafted
        self.accepted_draft_tokens += kept
        self.proposer.observe(request, drafted, kept, self.num_tokens)


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
