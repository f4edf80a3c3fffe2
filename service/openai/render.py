"""vLLM's render endpoints: a request's prompt token ids, as generation would make them.

A prefix-aware router that indexes the pods' KV-cache events (service/kv_events.py)
needs each prompt's token ids to find the pods holding its blocks; llm-d's endpoint
picker asks `POST /v1/completions/render` (the completions body; one `{"token_ids"}`
per prompt) and `POST /v1/chat/completions/render` (the chat body; `{"token_ids"}`).
The ids come from the same tokenizer, chat template and tool rendering as a
generation's, so that the router's keys match the blocks the pods store.
"""

from __future__ import annotations

from typing import Any

from pagedinfer.service.openai.chat import chat_prompt
from pagedinfer.service.openai.completions import parse_prompts
from pagedinfer.service.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedinfer.service.openai.serving import ServingState


def render_completion(state: ServingState, request: CompletionRequest) -> list[dict[str, Any]]:
    """One `{"token_ids"}` per prompt of a completions request, as generation reads them."""
    engine = state.ready_engine()
    state.check_model(request.model)
    return [{"token_ids": p.token_ids} for p in parse_prompts(engine, request.prompt)]


def render_chat(state: ServingState, request: ChatCompletionRequest) -> dict[str, Any]:
    """The prompt token ids of a chat request: its messages and tools through the chat
    template, as `chat.start_chat` renders them."""
    state.ready_engine()
    state.check_model(request.model)
    return {"token_ids": chat_prompt(state, request)[1]}
