"""The request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict, as OpenAI's are: a field of the wrong type (`"n": "2"`,
`"max_tokens": 16.0`, `"echo": 1`) or a field nobody knows is refused, not coerced or
ignored. Besides OpenAI's own fields they take the sampling fields vLLM accepts
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`) and a few
that clients of vLLM send with their default values. Bodies are parsed with
`model_validate_json`, so the JSON itself is checked too (invalid UTF-8, lone
surrogates, NaN).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from pagedinfer.service.sampling_params import MAX_LOGPROBS, MAX_N

MAX_STOP_STRINGS = 64  # OpenAI allows 4; vLLM and some lm-eval tasks send more
MAX_STOP_LENGTH = 256  # characters; a stop string's length is held back while streaming
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each bias: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


Stop = str | list[str]


class SamplingFields(Strict):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[int, float] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    min_tokens: int = Field(0, ge=0)
    # vLLM's: the logprobs of the prompt's tokens, with this many likeliest tokens at each.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Sent by vLLM's clients; fast tokenizers join special tokens as they are.
    spaces_between_special_tokens: bool = True
    # vLLM's beam search: the n best of best_of beams (pagedinfer.service.beam_search).
    use_beam_search: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: Stop | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("a stop string must not be empty")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"a stop string must be at most {MAX_STOP_LENGTH} characters")
        return stops

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _check_logit_bias(cls, bias: Any) -> dict[int, float] | None:
        """OpenAI's form: token ids as strings, each to a bias in [-100, 100]."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError("must be an object mapping token ids to biases")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        checked = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"the bias of token {key} must be a number")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {value}"
                )
            checked[int(key)] = float(value)
        return checked

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and min(ids) < 0:
            raise ValueError("token ids must not be negative")
        return ids


class GuidedFields(Strict):
    """Structured outputs on both endpoints: vLLM's structured_outputs and its older
    guided_* names (response_format is OpenAI's, on chat; vLLM takes it on completions
    too)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields, GuidedFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)  # an alias some clients send
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> str | list[str] | list[int] | list[list[int]]:
        """One message for every malformed prompt, instead of one per union member."""
        shape = (
            "must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids"
        )
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(shape if not isinstance(prompt, list) else "must not be empty")
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_int(t) for t in prompt):
            return prompt
        if all(isinstance(p, list) for p in prompt):
            for i, ids in enumerate(prompt):
                if not ids:
                    raise ValueError(f"item {i} must not be empty")
                if not all(_is_int(t) for t in ids):
                    raise ValueError(f"item {i} must be a list of integer token ids")
            return prompt
        raise ValueError(shape)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # An assistant turn's thinking, which templates may render or drop.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, content: Any) -> str | list[TextPart] | None:
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is {kind!r}: only text parts are served")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"part {i} must be {{'type': 'text', 'text': <string>}}")
            parts.append(TextPart(type="text", text=part["text"]))
        return parts

    def text(self) -> str:
        """The content as one string: text parts joined by newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class JsonSchemaFormat(Strict):
    """response_format's json_schema: the schema the output must match."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: exactly one of its constraints."""

    json_schema: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: Any = None  # a JSON schema; checked when the request is served
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    """A tool call of an assistant message, in a request's history or in a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionRequest(SamplingFields, GuidedFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # How the chat template renders the prompt (vLLM's fields).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(Strict):
    """POST /tokenize: exactly one of prompt and messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: one entry per token in each list."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token (or of one of the likeliest tokens there)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: None for the first token (nothing predicts it), then per token
# its own entry and those of the likeliest tokens, keyed by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    # The thinking, when the server runs a reasoning parser (`reasoning` is vLLM's newer name).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's tool call deltas: {"index", "id", "type", "function": {"name", "arguments"}}
    # on a call's first chunk, then {"index", "function": {"arguments"}} fragments.
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer
    def _present_fields_only(self) -> dict[str, Any]:
        """A delta carries only what changed: the role once, then content or thinking."""
        fields = dict(self)
        return {k: v for k, v in fields.items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: the first chunk's
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedinfer"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
