"""A realistic workload whose answers repeat their context: extraction and editing.

Each request hands the model a passage (an article, a table, an email, a piece of code)
and asks for something built from it: the dates or names it mentions, the table with a
new column, the paragraph with its grammar fixed, the code with type hints. Answers copy
long runs of their prompt, which is where n-gram drafts find their tokens. The prompts
(`extraction_prompts.json`) are in `chat.py`'s format and rendered the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workloads.chat import chat_workload

EXTRACTION_PROMPTS = Path(__file__).resolve().parent / "extraction_prompts.json"


def extraction_workload(
    tokenizer: Any, n: int | None = None, max_len: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """The first `n` prompts (all when None) as (token ids, output lengths)."""
    return chat_workload(tokenizer, n, max_len, EXTRACTION_PROMPTS)
