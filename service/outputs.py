"""What the engine hands back: streamed deltas, and the whole outputs `LLM` collects."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionDelta:
    """One streamed piece of one sample of a request."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # On the first delta with tokens, for a request with prompt_logprobs: entry i is
    # prompt token i + 1's (sampler.prompt_logprobs); nothing predicts the first.
    prompt_logprobs: list[dict] | None = None
    queue_time: float | None = None  # seconds from arrival to first being scheduled

    @classmethod
    def aborted(cls, request_id: str, index: int, prompt_tokens: int = 0) -> CompletionDelta:
        """The last delta of a sample that ends with nothing more to say."""
        return cls(request_id, index, [], "", None, "abort", prompt_tokens, 0, 0)


@dataclass
class CompletionOutput:
    """Everything one sample generated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    """Everything one request generated: one CompletionOutput per sample."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0
    prompt_logprobs: list[dict] | None = None  # as CompletionDelta's

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def add(self, delta: CompletionDelta) -> None:
        """Append one of this request's deltas to its sample."""
        sample = self.outputs[delta.index]
        sample.token_ids.extend(delta.token_ids)
        sample.text += delta.text
        if delta.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
