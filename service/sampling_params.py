"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedinfer.service.structured_output import StructuredOutput

MAX_N = 64
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
)
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to pick tokens for one request (mirrors vLLM's offline API).

    temperature 0 means greedy. top_k -1 (or 0) disables top-k. logprobs None returns
    none; an integer k returns the chosen token's logprob and the k most likely ones.
    prompt_logprobs k does the same for every prompt token after the first (what the
    model predicted there; `echo` of the HTTP API's completions); such a prompt is
    computed in full, not read from the prefix cache.

    logit_bias adds a bias in [-100, 100] to the logit of each token id it names (OpenAI's
    semantics: -100 bans a token, +100 all but forces it). min_tokens: until that many
    tokens are out, EOS and the stop token ids cannot be sampled and stop strings do not
    end the output (max_tokens still does). skip_special_tokens drops special tokens from the text;
    include_stop_str_in_output keeps the stop string (or stop token's text) that ended it.

    use_beam_search runs a beam search of width best_of (default n) and returns the n
    best finished hypotheses (beam_search.py). It is deterministic: temperature must be 0,
    and top-k/top-p/min-p, penalties, stop strings and structured outputs are refused.
    A hypothesis scores sum(logprobs) / len**length_penalty; early_stopping is
    transformers': True stops once best_of hypotheses are finished, False once none can
    beat them by the heuristic of the current length, "never" by the longest possible.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # What the output must match (a JSON schema, regex, choice or grammar); None: free.
    structured_output: StructuredOutput | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    best_of: int | None = None  # beam width, with use_beam_search (at least n)
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must contain only non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must contain only non-negative integers")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )

        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not (isinstance(bias, int | float) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias of token {token} must be in [-100, 100], got {bias!r}"
                )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ValueError("structured_output must be a StructuredOutput")
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        if self.best_of is not None and (
            not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N
        ):
            raise ValueError(f"best_of must be an integer in [n, {MAX_N}], got {self.best_of!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        if not self.use_beam_search:
            if self.best_of is not None and self.best_of != self.n:
                raise ValueError("best_of is only supported with use_beam_search")
            return
        # Beam search is deterministic and scores the model's own log-probabilities.
        refused = [
            ("temperature", self.temperature != 0.0, "must be 0"),
            ("top_p", self.top_p != 1.0, "must be 1"),
            ("top_k", self.top_k not in (-1, 0), "must be -1"),
            ("min_p", self.min_p != 0.0, "must be 0"),
            ("repetition_penalty", self.repetition_penalty != 1.0, "must be 1"),
            ("presence_penalty", self.presence_penalty != 0.0, "must be 0"),
            ("frequency_penalty", self.frequency_penalty != 0.0, "must be 0"),
            ("stop", bool(self.stop), "strings are not supported (use stop_token_ids)"),
            ("structured_output", self.structured_output is not None, "is not supported"),
        ]
        for name, bad, why in refused:
            if bad:
                raise ValueError(f"{name} {why} with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def beam_width(self) -> int:
        """How many beams a beam search keeps (best_of, or n)."""
        return self.best_of or self.n


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
