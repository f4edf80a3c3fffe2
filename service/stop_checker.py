"""Decides, after each new token of a sequence, whether it ended the sequence.

Stop token ids and EOS are checked first, then stop strings, then max_tokens: a stop
that comes with the last allowed token is the reason the sequence ended.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pagedinfer.service.sampling_params import SamplingParams


class StopDecision(NamedTuple):
    finish_reason: str | None  # "stop", "length", or None to go on
    text: str  # the output text, cut before the stop string or stop token when stopped


class StopChecker:
    """The stop conditions of one sequence.

    EOS ends a sequence unless `ignore_eos`; `stop_token_ids` always do. Neither
    appears in the text. A stop string ends it at its first occurrence, also when it
    spans several tokens, and the text is cut just before it (after it, with
    `include_stop_str_in_output`, which keeps a stop token's text too). Before
    `min_tokens` outputs no stop string ends it (the sampler keeps stop tokens from being
    picked until then). The max_tokens-th output token ends it too.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> None:
        self.max_tokens = params.max_tokens
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.stop_strings = list(params.stop)
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    @property
    def hold_back(self) -> int:
        """Trailing characters not to stream yet: they may be the start of a stop string."""
        return max(self._longest - 1, 0)

    def is_last(self, num_output_tokens: int) -> bool:
        """Whether the sequence may have no more tokens than these."""
        return num_output_tokens >= self.max_tokens

    def check(
        self, token_id: int, text: str, new_text_len: int, num_output_tokens: int
    ) -> StopDecision:
        """token_id: the token just sampled; text: the whole output text including
        what that token added; new_text_len: how many characters it added at the end;
        num_output_tokens: how many output tokens the sequence has with this one.
        """
        if token_id in self.stop_token_ids:
            return StopDecision(
                "stop", text if self.include_stop else text[: len(text) - new_text_len]
            )
        length = "length" if self.is_last(num_output_tokens) else None
        if not self.stop_strings or new_text_len == 0 or num_output_tokens < self.min_tokens:
            return StopDecision(length, text)
        # Only a match that ends in the new characters is new; earlier ones were seen.
        start = max(len(text) - new_text_len - self._longest + 1, 0)
        cut, end = -1, -1
        for stop in self.stop_strings:
            found = text.find(stop, start)
            if found != -1 and (cut == -1 or found < cut):
                cut, end = found, found + len(stop)
        if cut == -1:
            return StopDecision(length, text)
        return StopDecision("stop", text[:end] if self.include_stop else text[:cut])
