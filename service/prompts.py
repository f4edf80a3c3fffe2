"""A request's prompt as token ids: from text, token ids or chat messages.

The one place that checks a prompt's shape and its token ids; the gRPC and HTTP fronts
only convert their messages into these keyword arguments, and rely on the errors here
(each names the field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2

CHAT_ROLES = ("system", "user", "assistant", "tool")
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
# Template variables a request's chat_template_kwargs may not set: the server sets them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "tokenize", "conversation"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered: a generation prompt for the reply (the default),
    or the last assistant message left open for the model to continue; and extra
    variables for the template (say `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # The request's tools, for templates that render them (OpenAI's form).
    tools: Sequence[Mapping[str, Any]] | None = None


def encode_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[dict] | None = None,
    chat_options: ChatOptions | None = None,
) -> list[int]:
    """Token ids for exactly one of: text, token ids, or chat messages (not None, and
    not empty), the messages rendered as `chat_options` say. Token ids are checked
    against the vocabulary when the request is made."""
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
        return encode_chat(tokenizer, messages, chat_options)
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    return list(prompt_token_ids)


def encode_chat(
    tokenizer: Any, messages: Sequence[dict], options: ChatOptions | None = None
) -> list[int]:
    """The token ids of the model's chat template over `messages`, ready for a reply
    (or, with `continue_final_message`, for more of the last assistant message)."""
    options = options or ChatOptions()
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    check_chat_options(options, messages)
    try:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=True,
            **({"tools": options.tools} if options.tools else {}),
            **options.template_kwargs,
        )
    except jinja2.TemplateError as err:  # the template's own raise_exception, or its sandbox
        raise ValueError(f"the model's chat template refused these messages: {err}") from err
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def check_chat_options(options: ChatOptions, messages: Sequence[dict]) -> None:
    """ValueError, naming the field, for options that cannot apply to `messages`."""
    if options.continue_final_message:
        if options.add_generation_prompt:
            raise ValueError(
                "continue_final_message: set add_generation_prompt to false to continue the "
                "final message"
            )
        if messages[-1].get("role") != "assistant":
            raise ValueError(
                "continue_final_message: the last message must be an assistant message, "
                f"got {messages[-1].get('role')!r}"
            )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(options.template_kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set here; the request's "
            "own fields set them"
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError unless every id is an integer in [0, vocab_size)."""
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
