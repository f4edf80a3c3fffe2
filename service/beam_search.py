"""Beam search's decisions, apart from blocks and requests (docs/architecture.md,
section 2).

The engine runs every live beam as a scheduler request; beams fork from each other with
copy-on-write, so they share their prefix blocks. This module decides what they do:
each beam proposes its best continuations from its logits row (`propose`), and once
every live beam has proposed, the search advances (`advance`): the best `width`
continuations that do not end go on, a beam chosen by several forks into the extra
slots, a beam chosen by none is pruned, and continuations that end become finished
hypotheses.

The rules are transformers' (`generate(num_beams=...)`), so the outputs equal its own:
the top max(2, 1 + number of stop tokens) * width continuations by cumulative logprob;
only those ranked within the first `width` that end (a stop token, or max_tokens) are
kept as hypotheses, scored sum(logprobs) / len(tokens) ** length_penalty; at most
`width` hypotheses are kept. early_stopping True ends the search once `width`
hypotheses are kept; False and "never" end it once the best live beam, scored at the
current length (at max_tokens for "never" with a positive length_penalty), cannot beat
the worst kept hypothesis. Scores are float32, as transformers' are, so that near ties
break the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pagedinfer.service.sampler import SamplingRow, apply_logits_processors, has_logits_processors
from pagedinfer.service.sampling_params import SamplingParams


@dataclass
class Candidate:
    """One continuation a beam proposes: its token and the beam's score with it."""

    score: float  # cumulative logprob (after logit_bias and the min_tokens mask)
    slot: int  # the beam it extends
    token_id: int
    logprob: dict | None  # the token's logprob entry, when logprobs are asked for


@dataclass
class Beam:
    """A live beam: the tokens it generated and their cumulative logprob."""

    score: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


@dataclass
class Hypothesis:
    """A finished sequence of the search, with its length-penalised score."""

    score: float
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str  # "stop" (a stop token ends it) or "length"


@dataclass
class Advance:
    """What one advance of the search does to the live beams, by slot.

    continued: beams that go on with one more token, in place. forks: (parent, child,
    token): a new beam in a free slot that shares the parent's tokens, then its own.
    pruned: beams that end here, whose blocks go back at once. done: the search is
    over; every live beam ends and the hypotheses are the answer.
    """

    continued: dict[int, int] = field(default_factory=dict)
    forks: list[tuple[int, int, int]] = field(default_factory=list)
    pruned: list[int] = field(default_factory=list)
    done: bool = False


def _f32(value: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32)


class BeamSearch:
    """The state of one request's beam search; slot 0 holds the prompt's beam."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Iterable[int],
    ) -> None:
        self.params = params
        self.width = params.beam_width
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(self.eos_token_ids)
        # Enough continuations that `width` of them go on even if the best all end.
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * self.width
        with_logprobs = params.logprobs is not None
        self.beams: dict[int, Beam] = {0: Beam(0.0, [], [] if with_logprobs else None)}
        self.proposals: dict[int, list[Candidate]] = {}
        self.hypotheses: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True  # whether a live beam may still beat the worst hypothesis

    @property
    def num_generated(self) -> int:
        """Tokens every live beam has generated (they advance together)."""
        return len(next(iter(self.beams.values())).token_ids)

    def ready(self) -> bool:
        """Whether every live beam has proposed, so that the search can advance."""
        return self.proposals.keys() == self.beams.keys()

    def propose(self, slot: int, logits: torch.Tensor) -> None:
        """Record the best continuations of beam `slot` from its logits row [vocab]. A
        beam recomputed while it waits for the others keeps its first proposal."""
        if slot in self.proposals or slot not in self.beams:
            return
        beam, params = self.beams[slot], self.params
        raw = torch.log_softmax(logits.float(), dim=-1)
        scores = raw
        if has_logits_processors(params, len(beam.token_ids)):
            # On the log-probabilities, as transformers applies its processors.
            scores = raw.clone().unsqueeze(0)
            row = SamplingRow(params, self.prompt_token_ids, beam.token_ids, None)
            apply_logits_processors(scores, [row], [0], self.eos_token_ids)
            scores = scores.squeeze(0)
        scores = scores + _f32(beam.score)
        k = min(self.num_candidates, scores.shape[0])
        values, ids = torch.topk(scores, k)
        top: list[tuple[int, float]] = []
        chosen: list[float] = []
        if params.logprobs is not None:
            chosen = raw[ids].tolist()
            if params.logprobs:
                top_values, top_ids = raw.topk(params.logprobs)
                top = list(zip(top_ids.tolist(), top_values.tolist(), strict=True))
        candidates = []
        for i, (score, token) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            entry = None
            if params.logprobs is not None:
                entry = {"token_id": token, "logprob": chosen[i], "top": top}
            candidates.append(Candidate(score, slot, token, entry))
        self.proposals[slot] = candidates

    def advance(self) -> Advance:
        """Advance the search by one token; every live beam must have proposed."""
        if not self.ready():
            raise ValueError("beam search: a live beam has not proposed yet")
        order = sorted(self.beams)
        ranked = sorted(
            (c for slot in order for c in self.proposals[slot]), key=lambda c: -c.score
        )[: self.num_candidates]
        self.proposals.clear()
        length = self.num_generated + 1
        last = length >= self.params.max_tokens
        ends = [last or c.token_id in self.stop_token_ids for c in ranked]
        going = [c for c, end in zip(ranked, ends, strict=True) if not end][: self.width]
        self._keep_hypotheses(ranked[: self.width], ends, length)

        step = Advance()
        if going and self.improvable:
            self._update_improvable(going[0].score, length)
        step.done = (
            not going
            or not self.improvable
            or (self.params.early_stopping is True and len(self.hypotheses) == self.width)
        )
        if step.done:
            step.pruned = order
            self.beams.clear()
            return step
        self._assign_slots(going, step)
        return step

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses, best first (fewer only if the search found fewer)."""
        return self.hypotheses[:n]

    def _keep_hypotheses(self, top: list[Candidate], ends: list[bool], length: int) -> None:
        """The continuations within the first `width` that end become hypotheses, unless
        the search can no longer take any (transformers' `_update_finished_beams`)."""
        full = len(self.hypotheses) == self.width
        if (self.params.early_stopping is True and full) or not self.improvable:
            return
        penalty = length**self.params.length_penalty
        added = False
        for candidate, end in zip(top, ends, strict=False):
            if not end:
                continue
            beam = self.beams[candidate.slot]
            logprobs = None
            if beam.logprobs is not None:
                logprobs = [*beam.logprobs, candidate.logprob]
            reason = "stop" if candidate.token_id in self.stop_token_ids else "length"
            score = (_f32(candidate.score) / penalty).item()
            tokens = [*beam.token_ids, candidate.token_id]
            self.hypotheses.append(Hypothesis(score, tokens, logprobs, reason))
            added = True
        if added:
            # Stable: of equal scores, the hypothesis kept earlier stays first.
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[self.width :]

    def _update_improvable(self, best_running: float, length: int) -> None:
        """Whether the best live beam may still beat the worst hypothesis, by
        transformers' heuristic (`_check_early_stop_heuristic`)."""
        if len(self.hypotheses) < self.width:
            return
        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = params.max_tokens
        best_possible = (_f32(best_running) / (length**params.length_penalty)).item()
        self.improvable = best_possible > min(h.score for h in self.hypotheses)

    def _assign_slots(self, going: list[Candidate], step: Advance) -> None:
        """The beams going on take slots: a beam's first continuation keeps its slot, the
        others fork into the slots of pruned beams (lowest first)."""
        children: dict[int, list[Candidate]] = {}
        for candidate in going:
            children.setdefault(candidate.slot, []).append(candidate)
        step.pruned = [slot for slot in sorted(self.beams) if slot not in children]
        used = set(children)
        free = (slot for slot in range(self.width) if slot not in used)
        beams: dict[int, Beam] = {}
        for slot, picks in children.items():
            parent = self.beams[slot]
            for i, pick in enumerate(picks):
                child_slot = slot if i == 0 else next(free)
                logprobs = None
                if parent.logprobs is not None:
                    logprobs = [*parent.logprobs, pick.logprob]
                beams[child_slot] = Beam(pick.score, [*parent.token_ids, pick.token_id], logprobs)
                if i == 0:
                    step.continued[slot] = pick.token_id
                else:
                    step.forks.append((slot, child_slot, pick.token_id))
        self.beams = beams
