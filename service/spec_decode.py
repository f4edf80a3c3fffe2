"""N-gram speculative decoding (prompt lookup): drafts from a sequence's own tokens.

When the last n tokens of a sequence occurred earlier in it, in the prompt or the
output, the tokens that followed that occurrence are a cheap guess at what comes next.
The engine feeds the guess (the draft) to the model behind the sequence's last token,
in the same pass, and keeps the draft's tokens for as long as they agree with what the
sampler picks from the logits at each position, plus the sampler's pick at the first
disagreement (or after the whole draft). A decode step then yields 1 to k+1 tokens for
one pass; the pass carries more tokens, which costs little where decoding is bound by
reading the weights, as on a CPU at a few dozen tokens per pass.

The output is exactly what decoding one token at a time would give: every kept token
is the sampler's own pick from logits computed over the same tokens. For random
sampling too, since a draft is fixed in advance, keeping draft token d at a position
exactly when the draw there gives d leaves each position's distribution as it was.

The lookup is vLLM's prompt-lookup rule: the longest n-gram first (prompt_lookup_max
down to prompt_lookup_min), its latest earlier occurrence. Each sequence keeps an index
of its n-grams, extended by the tokens appended since the last lookup, so a lookup
costs a few dict reads however long the sequence is.

How long a draft is, and when there is one at all. A draft token the model rejects
costs a row of the pass and gains nothing, and on a CPU a row costs about as much
whatever the pass (SmolLM2 on an AMD EPYC, 2 threads: each more row of a decode step
took 1.5-1.9 ms from 1 row to 64). A kept token saves the sequence a pass, which shortens
the run only for the requests that take the most passes. So:

- each sequence's drafts follow how well its drafts did: after a rejection the next
  draft is at most one longer than what was kept, after a draft kept whole one longer
  again, up to the configured length (sequences that repeat themselves draft long,
  the others short);
- the scheduler drafts only while at most `EngineConfig.speculative_max_running`
  requests are running: in a full batch each pass carries many rows anyway, and the few
  longest requests are yet to become the whole batch.

On the benchmark's mixed workload (SmolLM2, 4-token drafts, an AMD EPYC, 2 threads),
in one engine taking turns: 6.56-6.58 s with both, 6.71-6.75 s with a 4-token draft
for every decode that has one (1,643 draft tokens, 410 rejected, against 544 and 71),
7.12-7.13 s with no drafts. Drafting from 8, 16, 24 or any number of running requests
was within 1% (7.52-7.71 s in a slower turn of the machine).

On an Intel Xeon (2 threads) a row costs less against a pass: the 30 layers' GEMMs took
13 ms at 1 row and 0.6 ms more a row from 16 rows to 64. There drafting from more running
requests pays (engines taking turns in one process, fastest and median turn):

- the mixed workload, 32 requests: drafting from up to 16 running 4.61 and 4.78 s, up
  to 32 (every step) 4.24 and 4.41 s; in another process 4.70 and 4.81 against 4.23 and
  4.47 s;
- 64 requests (512 MiB of KV cache): up to 16 running 9.13 and 9.25 s, up to 32 8.78
  and 8.97 s, up to 64 8.39 and 8.67 s;
- 128 requests (1 GiB): up to 16 running 16.98 and 17.10 s, up to 64 16.09 and 16.25 s;
- two more seeds of 32 requests, up to 16 against up to 64 running, fastest turns: 3.80
  against 3.73 s, and 3.50 against 3.39 s.

So the default is 64. On the AMD EPYC the limit moved the time by under 1%; on the Intel
Xeon drafting from up to 32 or 64 took 2-8% less than from up to 16, at 32 to 128
requests.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from pagedinfer.service.request import Request


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
