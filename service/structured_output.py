"""Structured outputs: grammars that constrain sampling, on llguidance.

A request names what its output must match (`StructuredOutput`: a JSON schema, a regex,
a list of choices or a Lark/GBNF grammar). `GrammarCompiler`, one per tokenizer, turns
it into an llguidance grammar, checks it once (cached per spec) and gives each sample
its own `GrammarMatcher`. Before sampling, the engine fills each constrained row's
bitmask of allowed next tokens (on a worker thread while the model's forward runs:
llguidance releases the GIL) and the disallowed logits become -inf, so every sampling
path (greedy, top-k/top-p/min-p, seeds, n > 1) picks only tokens the grammar allows,
and logprobs are those of the masked distribution. Draft rows of speculative decoding
are masked at the state after the draft tokens before them, so a draft token the
grammar forbids is never kept. A sample's matcher consumes exactly the tokens the
sample keeps; preemption keeps a request's output tokens, so the matcher stays right.

JSON grammars are compact (no free whitespace beyond one space after `:` and `,`), so
a model cannot wander into a flood of newlines. Compiling is bounded by llguidance's
fuel limits (deterministic counts, not timings), the spec's size and its nesting.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")
# What a spec may weigh: larger ones are refused before compiling.
MAX_SPEC_CHARS = 128 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024
# Compact JSON, with the separators json.dumps uses by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Whitespace the grammar lets through between a thinking block and the answer.
THINKING_GAP = r"/[ \t\r\n]{0,8}/"


@dataclass(frozen=True)
class Thinking:
    """A thinking block the grammar lets through before the constrained answer, so that
    a thinking model may think first (`pagedinfer.service.reasoning`): any text up to the
    first `end` tag, then the answer. open: the prompt opened the block, so the output
    starts inside it; otherwise the output may start with `start` (or go straight to
    the answer)."""

    start: str
    end: str
    open: bool


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. kind "json": `spec` is a JSON schema as JSON
    text; "regex": a regular expression (Rust syntax); "choice": a JSON list of the
    allowed strings; "grammar": a Lark grammar (llguidance's dialect) or GBNF. With
    `thinking`, it is what the answer after the thinking must match."""

    kind: Kind
    spec: str
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"structured_output kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise ValueError("structured_output spec must be a string")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        # Key order kept: properties are generated in the schema's order.
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls.json_schema({"type": "object"})

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message says why."""


class GrammarMatcher:
    """One sample's position in its grammar."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.words = words  # int32 words of a bitmask row
        self._eos = list(eos_token_ids)

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 [words], bit t of the row's
        bits is token t). A matcher in an error state allows only EOS, which ends the
        sample."""
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if not self._matcher.is_error() and row.any():
                return
        row[:] = 0
        words = row.view(np.uint32)
        for token in self._eos:
            words[token // 32] |= np.uint32(1 << (token % 32))

    def fill_with_draft(self, rows: np.ndarray, draft: Sequence[int]) -> None:
        """rows [1 + len(draft), words]: row j is the mask after draft[:j]. Rows after a
        draft token the grammar forbids are left all-allowed: the sampler cannot pick
        that token, so they are never kept."""
        self.fill(rows[0])
        valid = self._matcher.validate_tokens(list(draft)) if draft else 0
        for j in range(valid):
            self._matcher.consume_token(draft[j])
            self.fill(rows[j + 1])
        rows[valid + 1 :] = -1
        if valid:
            self._matcher.rollback(valid)

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over tokens the sample keeps; False if the grammar refused one."""
        for token in token_ids:
            if token in self._eos and self._matcher.is_accepting():
                return True  # the sample ends here
            if self._matcher.is_error() or not self._matcher.consume_token(token):
                return False
        return True

    @property
    def is_stopped(self) -> bool:
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Compiles specs for one tokenizer and makes their matchers.

    tokenizer: the engine's tokenizer (pagedinfer's own, with `.backend`, or a fast
    transformers one). vocab_size: the logits' width, at least the tokenizer's.
    llguidance's view of the tokenizer takes about a second to build: it is built on
    first use, once.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.words = (vocab_size + 31) // 32
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def ll_tokenizer(self) -> Any:
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                backend = getattr(self._tokenizer, "backend", None)
                if backend is None:
                    backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise GrammarError("structured outputs need a fast (tokenizer.json) tokenizer")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def check(self, output: StructuredOutput) -> None:
        """GrammarError naming the problem if `output` cannot be enforced; cached."""
        self._compile(output)

    def matcher(self, output: StructuredOutput) -> GrammarMatcher:
        import llguidance

        grammar = self._compile(output)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher, self.words, self.eos_token_ids)

    def _compile_uncached(self, output: StructuredOutput) -> str:
        import llguidance

        grammar = to_grammar(output)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer(), limits=_limits()
        )
        if is_error:
            message = _first_line(messages[0]) if messages else "invalid grammar"
            if message.startswith("Unimplemented keys"):
                message = "the schema uses keywords the grammar engine cannot enforce: " + message
            raise GrammarError(message)
        return grammar


def to_grammar(output: StructuredOutput) -> str:
    """The llguidance grammar of a spec; GrammarError for a malformed one."""
    grammar = _answer_grammar(output)
    return grammar if output.thinking is None else after_thinking(grammar, output.thinking)


def after_thinking(grammar: str, thinking: Thinking) -> str:
    """`grammar` preceded by a thinking block: the block's text is free (a lazy lexeme
    that ends at the first end tag), a little whitespace, then `grammar`'s answer."""
    parsed = json.loads(grammar)
    grammars = parsed["grammars"]
    answer = grammars[0].get("name") or "answer"
    grammars[0]["name"] = answer
    block = f"thinking {THINKING_GAP}"
    lark = "\n".join(
        [
            f"start: {block} @{answer}"
            if thinking.open
            else f"start: ({json.dumps(thinking.start)} {block})? @{answer}",
            f"thinking[lazy]: /(.|\\n)*/ {json.dumps(thinking.end)}",
        ]
    )
    grammars.insert(0, {"name": "thinking_first", "lark_grammar": lark})
    return json.dumps(parsed)


def _answer_grammar(output: StructuredOutput) -> str:
    import llguidance

    if len(output.spec) > MAX_SPEC_CHARS:
        raise GrammarError(
            f"the {output.kind} is {len(output.spec)} characters; at most {MAX_SPEC_CHARS} "
            "are compiled"
        )
    if output.kind == "json":
        try:
            schema = json.loads(output.spec)
        except json.JSONDecodeError as err:
            raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        check_schema_shape(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if output.kind == "regex":
        if not output.spec:
            raise GrammarError("the regex must not be empty")
        return llguidance.LLMatcher.grammar_from_regex(output.spec)
    if output.kind == "choice":
        choices = json.loads(output.spec)
        if not isinstance(choices, list) or not choices:
            raise GrammarError("choice must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise GrammarError(f"choice holds {len(choices)} strings; at most {MAX_CHOICES}")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must hold only non-empty strings")
        alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    text = output.spec
    if not text.strip():
        raise GrammarError("the grammar must not be empty")
    if "::=" in text:  # GBNF, as llama.cpp writes it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as err:
            raise GrammarError(
                f"the GBNF grammar does not parse: {_first_line(str(err))}"
            ) from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def check_schema_shape(schema: Any) -> None:
    """GrammarError unless `schema` is a JSON Schema document (an object or a boolean)
    nested at most MAX_SCHEMA_DEPTH deep."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(
            f"a JSON schema must be an object (or a boolean), got {type(schema).__name__}"
        )
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")


def _depth(value: Any) -> int:
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def apply_masks(logits: Any, rows: Sequence[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of tokens bitmask row i forbids in logits row
    rows[i] (logits: a contiguous float32 CPU torch tensor [num_rows, vocab]; tokens past
    the mask's width are forbidden).

    Each row touches only the smaller side of its mask, found from the mask's 32-bit
    words: the forbidden tokens, or, where most are forbidden, the whole row filled and
    its allowed logits put back. A masked fill over every element costs far more: its
    branches follow the mask's irregular pattern."""
    view = logits.detach().numpy()
    vocab = view.shape[1]
    words = bitmask.view(np.uint32)
    if hasattr(np, "bitwise_count"):  # numpy 2
        counts = np.bitwise_count(words).sum(axis=1)
    else:
        counts = np.unpackbits(bitmask.view(np.uint8), axis=1).sum(axis=1)
    for i, row in enumerate(rows):
        view[row, words.shape[1] * 32 :] = -np.inf
        if 2 * int(counts[i]) < vocab:
            allowed = _tokens(words[i], np.flatnonzero(words[i]), vocab)
            kept = view[row, allowed]
            view[row].fill(-np.inf)
            view[row, allowed] = kept
        else:
            inverted = ~words[i]
            view[row, _tokens(inverted, np.flatnonzero(inverted), vocab)] = -np.inf


def _tokens(words: np.ndarray, at: np.ndarray, vocab: int) -> np.ndarray:
    """The token ids of the set bits of words[at] (below vocab)."""
    bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(len(at), 32)
    ids = (at[:, None] * 32 + np.arange(32))[bits.astype(bool)]
    return ids[ids < vocab]


@lru_cache(maxsize=1)
def _limits() -> Any:
    import llguidance

    # llguidance's defaults, but errors do not echo the grammar's internals.
    return llguidance.LLParserLimits(verbose_errors=False)


def _first_line(message: str) -> str:
    """An engine error in one line: its first, and the detail of a regex error."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return message
    detail = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join([lines[0], *detail[:1]])
