"""Decides, after each new token of a sequence, whether a stop condition ended it.

Stop token ids and EOS are checked first, then stop strings. max_tokens is not checked
here: the scheduler finishes a sequence with FINISHED_LENGTH when it reaches it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pagedinfer.service.sampling_params import SamplingParams


class StopDecision(NamedTuple):
    finish_reason: str | None  # "stop", or None to go on
    text: str  # the output text, cut before the stop string or stop token when stopped


class StopChecker:
    """The stop conditions of one sequence.

    EOS ends a sequence unless `ignore_eos`; `stop_token_ids` always do. Neither
    appears in the text. A stop string ends it at its first occurrence, also when it
    spans several tokens, and the text is cut just before it.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> None:
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.stop_strings = list(params.stop)
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    @property
    def hold_back(self) -> int:
        """Trailing characters not to stream yet: they may be the start of a stop string."""
        return max(self._longest - 1, 0)

    def check(self, token_id: int, text: str, new_text_len: int) -> StopDecision:
        """token_id: the token just sampled; text: the whole output text including
        what that token added; new_text_len: how many characters it added at the end.
        """
        if token_id in self.stop_token_ids:
            return StopDecision("stop", text[: len(text) - new_text_len])
        if not self.stop_strings or new_text_len == 0:
            return StopDecision(None, text)
        # Only a match that ends in the new characters is new; earlier ones were seen.
        start = max(len(text) - new_text_len - self._longest + 1, 0)
        cut = -1
        for stop in self.stop_strings:
            found = text.find(stop, start)
            if found != -1 and (cut == -1 or found < cut):
                cut = found
        if cut == -1:
            return StopDecision(None, text)
        return StopDecision("stop", text[:cut])
