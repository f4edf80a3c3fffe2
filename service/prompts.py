"""A request's prompt as token ids: from text, token ids or chat messages.

The one place that checks a prompt's shape and its token ids; the gRPC and HTTP fronts
only convert their messages into these keyword arguments, and rely on the errors here
(each names the field).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

CHAT_ROLES = ("system", "user", "assistant", "tool")
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


def encode_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[dict] | None = None,
) -> list[int]:
    """Token ids for exactly one of: text, token ids, or chat messages (not None, and
    not empty). Token ids are checked against the vocabulary when the request is made."""
    values = (prompt, prompt_token_ids, messages)
    given = [name for name, value in zip(PROMPT_FIELDS, values, strict=True) if value is not None]
    if len(given) != 1:
        got = ", ".join(given) or "none"
        raise ValueError(f"give exactly one of {', '.join(PROMPT_FIELDS)} (got {got})")
    if prompt is not None:
        if not prompt:
            raise ValueError("prompt must not be empty")
        return tokenizer.encode(prompt, add_special_tokens=False)
    if messages is not None:
        return encode_chat(tokenizer, messages)
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    return list(prompt_token_ids)


def encode_chat(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """The token ids of the model's chat template over `messages`, ready for a reply."""
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    try:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
    except jinja2.TemplateError as err:  # the template's own raise_exception, or its sandbox
        raise ValueError(f"the model's chat template refused these messages: {err}") from err
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError unless every id is an integer in [0, vocab_size)."""
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
