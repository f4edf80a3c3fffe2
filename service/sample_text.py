"""One sample's output as it streams: its tokens turned into text, and what ends it.

The engine feeds each step's new tokens here before the scheduler sees them, so the
tokens after a stop never reach the request, and the scheduler is told once, with the
right reason, that the sample ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.service.detokenizer import IncrementalDetokenizer
from pagedinfer.service.sampler import SampleResult
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.stop_checker import StopChecker


@dataclass
class NewTokens:
    """What a sample keeps of one step's picks."""

    token_ids: list[int]  # up to and including the token that ends it, if one does
    logprobs: list[dict] | None  # one entry per kept token, when logprobs were asked for
    finish_reason: str | None  # "stop", "length", or None while the sample goes on


class SampleText:
    """The text of one sample: detokenized token by token and checked for stops."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.stop = StopChecker(params, eos_token_ids)
        self.with_logprobs = params.logprobs is not None
        self.text = ""  # everything detokenized so far, cut at a stop
        self.emitted = 0  # characters of `text` already streamed

    def add(self, picks: Sequence[SampleResult], num_output_tokens: int) -> NewTokens:
        """The step's picks, in order, after the sample's num_output_tokens earlier
        tokens: each is detokenized and checked, and those after the one that ends the
        sample are dropped."""
        tokens: list[int] = []
        logprobs: list[dict] | None = [] if self.with_logprobs else None
        reason = None
        for pick in picks:
            num_output_tokens += 1
            new_text = self.detokenizer.add_token(pick.token_id)
            if self.stop.is_last(num_output_tokens):  # release any held partial character
                new_text += self.detokenizer.flush()
            self.text += new_text
            reason, self.text = self.stop.check(
                pick.token_id, self.text, len(new_text), num_output_tokens
            )
            tokens.append(pick.token_id)
            if logprobs is not None:
                logprobs.append(
                    {
                        "token_id": pick.token_id,
                        "logprob": pick.logprob,
                        "top": pick.top_logprobs or [],
                    }
                )
            if reason is not None:
                break
        return NewTokens(tokens, logprobs, reason)

    def take(self, finished: bool) -> str:
        """The text not streamed yet; while the sample goes on, less a tail that may
        still grow into a stop string."""
        end = len(self.text)
        if not finished:
            end = max(end - self.stop.hold_back, self.emitted)
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece
