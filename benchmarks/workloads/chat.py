"""The realistic workload: real chat requests, rendered with the model's chat template.

Random token ids make a small model repeat itself, which flatters n-gram drafts; these
prompts (`chat_prompts.json`: questions, summaries, code, extraction, rewriting, math,
translation, lists...) read as a user's would. Each carries the answer length it is
held to, so that every system produces the same number of tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_PROMPTS = Path(__file__).resolve().parent / "chat_prompts.json"
ROLES = ("system", "user", "assistant")


def load_chat_prompts(path: Path = CHAT_PROMPTS) -> list[dict[str, Any]]:
    """The prompts of `path`, each checked: `messages` (role and content) and `output_tokens`."""
    data = json.loads(Path(path).read_text())
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{path}: expected an object with a non-empty 'prompts' list")
    for i, prompt in enumerate(prompts):
        where = f"{path}: prompt {i}"
        messages = prompt.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        for message in messages:
            if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: each message needs a role in {ROLES} and a content")
        if messages[-1]["role"] != "user":
            raise ValueError(f"{where}: the last message must be the user's")
        length = prompt.get("output_tokens")
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"{where}: 'output_tokens' must be a positive integer")
    return prompts


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_workload(
    tokenizer: Any, n: int | None = None, max_len: int | None = None, path: Path = CHAT_PROMPTS
) -> tuple[list[list[int]], list[int]]:
    """The first `n` prompts (all when None) as (token ids, output lengths)."""
    prompts = load_chat_prompts(path)
    if n is not None:
        if not 1 <= n <= len(prompts):
            raise ValueError(f"the chat workload has {len(prompts)} prompts; asked for {n}")
        prompts = prompts[:n]
    ids = [render(tokenizer, p["messages"]) for p in prompts]
    lens = [p["output_tokens"] for p in prompts]
    if max_len is not None:
        for i, (p, o) in enumerate(zip(ids, lens, strict=True)):
            if len(p) + o > max_len:
                raise ValueError(
                    f"chat prompt {i} needs {len(p)} + {o} tokens, over max_model_len {max_len}"
                )
    return ids, lens
