"""Turns a stream of token ids into a stream of text, one delta per token.

Decoding tokens one at a time is wrong in two ways: a character of several UTF-8
bytes can be split over tokens (each piece alone decodes to U+FFFD), and tokenizers
that mark spaces inside tokens (sentencepiece's leading "▁") drop or add spaces at
the start of a decode. So, as vLLM does, each step decodes a short window of tokens
already emitted (the prefix) with and without the new tokens and emits the difference;
while the result ends in U+FFFD the new bytes are held until the character completes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# How many prompt tokens give the first output token its context (vLLM's value).
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes the output of one sequence incrementally.

    tokenizer: a transformers tokenizer (anything with `decode(ids,
    skip_special_tokens=...)`). prompt_token_ids: the prompt, whose last tokens give the
    first output token its context; it is never part of the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - INITIAL_PREFIX_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def add_token(self, token_id: int) -> str:
        """Appends one token; returns the text it completes ("" while a character is partial)."""
        return self.add_tokens((token_id,))

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held, even if it is not valid UTF-8."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
        )
