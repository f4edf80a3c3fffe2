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

from pagedinfer.service import prompts
from pagedinfer.service.openai.chat import chat_options
from pagedinfer.service.openai.errors import bad_request
from pagedinfer.service.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedinfer.service.openai.serving import (
    ServingState,
    chat_messages,
    check_token_ids,
    encode,
)
from pagedinfer.service.openai.tools import prepare_tools


def render_completion(state: ServingState, request: CompletionRequest) -> list[dict[str, Any]]:
    """One `{"token_ids"}` per prompt of a completions request."""
    engine = state.ready_engine()
    state.check_model(request.model)
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # one prompt of token ids
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = encode(engine, param, prompt=item)
        else:
            check_token_ids(item, engine.vocab_size, param)
            ids = encode(engine, param, prompt_token_ids=list(item))
        out.append({"token_ids": ids})
    return out


def render_chat(state: ServingState, request: ChatCompletionRequest) -> dict[str, Any]:
    """The prompt token ids of a chat request: its messages and tools through the chat
    template, as `chat.start_chat` renders them."""
    engine = state.ready_engine()
    state.check_model(request.model)
    options = chat_options(request)
    _, messages, options = prepare_tools(
        request, chat_messages(request), options, engine, state.tool_call_parser
    )
    try:
        prompts.check_chat_options(options, messages)
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, message.split(":", 1)[0]) from None
    return {"token_ids": encode(engine, "messages", messages=messages, chat_options=options)}
