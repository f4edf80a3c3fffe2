"""Structured outputs: grammars that constrain sampling, on llguidance.

A request names what its output must match (`StructuredOutput`: a JSON schema, a regex,
a list of choices or a Lark/GBNF grammar). `GrammarCompiler`, one per tokenizer, turns
it into an llguidance grammar, checks it once (cached per spec) and gives each sample
its own `GrammarMatcher`. Each constrained row gets a mask of its allowed next tokens
and the disallowed logits become -inf before sampling, so every sampling path (greedy,
top-k/top-p/min-p, seeds, n > 1) picks only tokens the grammar allows, and logprobs are
those of the masked distribution. `MaskPipeline` keeps that work off the engine's
critical path: a sample's matcher advances over the tokens it kept at step t and fills
its mask for step t + 1 on a worker thread, while the engine streams step t's output and
schedules and runs step t + 1's forward (llguidance releases the GIL). Draft rows of speculative decoding
are masked at the state after the draft tokens before them, so a draft token the
grammar forbids is never kept. A sample's matcher consumes exactly the tokens the
sample keeps; preemption keeps a request's output tokens, so the matcher stays right.

JSON grammars are compact (no free whitespace beyond one space after `:` and `,`), so
a model cannot wander into a flood of newlines. Compiling is bounded by llguidance's
fuel limits (deterministic counts, not timings), the spec's size and its nesting.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

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

    def row_masks(self, draft: Sequence[int], vocab: int) -> list[RowMask]:
        """The masks of a row and of its draft's rows (`fill_with_draft`), ready to apply
        to logits `vocab` wide."""
        rows = np.empty((1 + len(draft), self.words), dtype=np.int32)
        self.fill_with_draft(rows, draft)
        return [RowMask.from_bits(row, vocab) for row in rows]

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


@dataclass(frozen=True)
class RowMask:
    """One logits row's mask as the smaller side of its bitmask: the token ids it allows
    (every other logit becomes -inf) or the ids it forbids. Applying it touches only
    those ids; a masked fill over every element costs far more, as its branches follow
    the mask's irregular pattern. Found from the bitmask's 32-bit words."""

    allowed: bool  # ids are the allowed tokens; otherwise the forbidden ones
    ids: np.ndarray  # int32
    width: int  # tokens at or past it are forbidden (the bitmask's bits)

    @classmethod
    def from_bits(cls, bits: np.ndarray, vocab: int) -> RowMask:
        """bits: int32 [words], bit t (of word t // 32, from the lowest) allows token t."""
        words = bits.view(np.uint32)
        if hasattr(np, "bitwise_count"):  # numpy 2
            count = int(np.bitwise_count(words).sum())
        else:
            count = int(np.unpackbits(words.view(np.uint8)).sum())
        width = 32 * len(words)
        if 2 * count < vocab:
            return cls(True, _tokens(words, np.flatnonzero(words), vocab), width)
        inverted = ~words
        return cls(False, _tokens(inverted, np.flatnonzero(inverted), vocab), width)

    def apply(self, row: np.ndarray) -> None:
        """Set the forbidden logits of `row` (float32 [vocab]) to -inf, in place."""
        if self.allowed:
            kept = row[self.ids]
            row.fill(-np.inf)
            row[self.ids] = kept
        else:
            row[self.width :] = -np.inf
            row[self.ids] = -np.inf


def apply_row_masks(logits: Any, masked: Sequence[tuple[int, RowMask]]) -> None:
    """Apply each (logits row, its mask) in place (logits: a contiguous float32 CPU torch
    tensor [num_rows, vocab])."""
    view = logits.detach().numpy()
    for row, mask in masked:
        mask.apply(view[row])


def apply_masks(logits: Any, rows: Sequence[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of tokens bitmask row i forbids in logits row
    rows[i] (tokens past the mask's width are forbidden)."""
    vocab = logits.shape[1]
    masks = [RowMask.from_bits(bits, vocab) for bits in bitmask]
    apply_row_masks(logits, list(zip(rows, masks, strict=True)))


# (sample id, its matcher, tokens, output tokens): see MaskPipeline.
MaskJob = tuple[str, GrammarMatcher, Sequence[int], int]


class MaskPipeline:
    """Grammar work one step ahead of sampling, on one worker thread.

    The masks of step t + 1 depend on the tokens sampled at step t, known only after
    step t's forward. As soon as the engine knows them, `advance` hands them to the
    worker, which moves each matcher over its kept tokens and prepares the mask of its
    next token (a `RowMask`, ready to apply) while the engine streams step t's deltas
    and schedules, prepares and runs step t + 1's forward. `start` then only collects
    those masks; what could not be prepared ahead (draft rows, known once a step is
    scheduled) is filled during that step's forward. The worker runs jobs in the order
    they were given, and a matcher is only ever touched there, so a mask always follows
    every token its sample kept before it.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pagedinfer-grammar")
        # sample id -> (output tokens its matcher will have consumed, the job's result)
        self._ahead: dict[str, tuple[int, Future[dict[str, RowMask]]]] = {}

    def advance(self, jobs: Sequence[MaskJob]) -> None:
        """Per (sample id, matcher, tokens it kept, its output tokens after them): on
        the worker, consume the tokens and prepare the next mask."""
        if not jobs:
            return
        vocab = self.vocab_size

        def run() -> dict[str, RowMask]:
            ready = {}
            for sample_id, matcher, tokens, _ in jobs:
                if not matcher.accept(tokens):
                    log.warning("request %s: its grammar refused a kept token", sample_id)
                (ready[sample_id],) = matcher.row_masks((), vocab)
            return ready

        future = self._worker.submit(run)
        for sample_id, _, _, position in jobs:
            self._ahead[sample_id] = (position, future)

    def start(self, jobs: Sequence[MaskJob]) -> Future[dict[str, list[RowMask]]] | None:
        """The masks of the samples sampled this step, per (sample id, matcher, draft
        tokens, its output tokens so far): sample id -> the masks of its 1 + len(draft)
        rows, row j after the draft's first j tokens. Masks prepared ahead for that many
        output tokens are taken as they are; the rest are filled now."""
        if not jobs:
            return None
        ahead: dict[str, Future[dict[str, RowMask]]] = {}
        fresh: list[tuple[str, GrammarMatcher, Sequence[int]]] = []
        for sample_id, matcher, draft, position in jobs:
            prepared = self._ahead.pop(sample_id, None)
            if prepared is not None and prepared[0] == position and not draft:
                ahead[sample_id] = prepared[1]
            else:
                fresh.append((sample_id, matcher, draft))
        vocab = self.vocab_size

        def run() -> dict[str, list[RowMask]]:
            # Jobs run in order: the ones prepared ahead are done by now.
            masks = {sample_id: [future.result()[sample_id]] for sample_id, future in ahead.items()}
            for sample_id, matcher, draft in fresh:
                masks[sample_id] = matcher.row_masks(draft, vocab)
            return masks

        return self._worker.submit(run)

    def forget(self, sample_ids: Sequence[str]) -> None:
        """Drop what was prepared for samples that will not be sampled again."""
        for sample_id in sample_ids:
            self._ahead.pop(sample_id, None)


def _tokens(words: np.ndarray, at: np.ndarray, vocab: int) -> np.ndarray:
    """The token ids of the set bits of words[at] (below vocab)."""
    bits = np.unpackbits(words[at].view(np.uint8), bitorder="little").reshape(len(at), 32)
    ids = (at[:, None] * 32 + np.arange(32))[bits.astype(bool)]
    return ids[ids < vocab].astype(np.int32)


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
