"""Structured outputs in the engine: what the grammar compiler refuses, how masks cover
draft rows, and that every sampling path of the embedded model keeps to the grammar."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from pagedinfer.service import LLM, SamplingParams
from pagedinfer.service.structured_output import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    MaskPipeline,
    StructuredOutput,
    apply_masks,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPT = "Here is a person described as JSON:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, kv_cache_memory=256 * 2**20, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:
    return llm.engine.grammars


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (StructuredOutput.json_schema({"type": "foo"}), "Invalid type"),
        (StructuredOutput.json_schema({"type": "object", "properties": 5}), "properties"),
        (StructuredOutput("json", "[1, 2]"), "must be an object"),
        (StructuredOutput("json", "{"), "not valid JSON"),
        (
            StructuredOutput.json_schema({"type": "object", "dependentRequired": {"a": ["b"]}}),
            'cannot enforce: Unimplemented keys: ["dependentRequired"]',
        ),
        (StructuredOutput("regex", "[a-"), "unclosed character class"),
        (StructuredOutput("grammar", "start: missing_rule"), "unknown name"),
        (StructuredOutput("choice", "[]"), "non-empty list"),
    ],
)
def test_compiler_refuses_what_it_cannot_enforce(compiler, output, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        compiler.check(output)


def test_deep_and_huge_specs_are_refused_before_compiling(compiler):
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nests deeper than"):
        compiler.check(StructuredOutput.json_schema(deep))
    with pytest.raises(GrammarError, match="characters; at most"):
        compiler.check(StructuredOutput("regex", "a" * 200_000))


def test_masks_follow_the_draft_and_stop_at_a_forbidden_token(llm, compiler):
    tok = llm.engine.tokenizer
    matcher = compiler.matcher(StructuredOutput.choice(["yes", "no"]))
    no = tok.encode("no", add_special_tokens=False)
    draft = [*no, 5]  # "no", then a token after the grammar's end
    rows = np.empty((1 + len(draft), compiler.words), dtype=np.int32)
    matcher.fill_with_draft(rows, draft)
    logits = torch.zeros(len(rows), compiler.vocab_size)
    apply_masks(logits, list(range(len(rows))), rows)
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert no[0] in allowed[0] and len(allowed[0]) < 10
    assert allowed[len(no)] == set(compiler.eos_token_ids)  # after "no": only the end
    assert len(allowed[-1]) == compiler.vocab_size  # past the forbidden token: never kept
    assert matcher.accept(no)  # the draft was rolled back: the matcher starts over


def allowed_tokens(masks, vocab: int) -> list[set[int]]:
    logits = torch.zeros(len(masks), vocab)
    for row, mask in enumerate(masks):
        mask.apply(logits[row].numpy())
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def test_the_next_mask_is_prepared_ahead_on_the_worker(llm, compiler, monkeypatch):
    tok = llm.engine.tokenizer
    no = tok.encode("no", add_special_tokens=False)
    pipeline = MaskPipeline(compiler.vocab_size)
    matcher = compiler.matcher(StructuredOutput.choice(["yes", "no"]))
    threads: list[str] = []
    fill = GrammarMatcher.fill
    monkeypatch.setattr(
        GrammarMatcher,
        "fill",
        lambda self, row: threads.append(threading.current_thread().name) or fill(self, row),
    )
    pipeline.advance([("a", matcher, (), 0)])
    (first,) = pipeline.start([("a", matcher, [], 0)]).result()["a"]
    pipeline.advance([("a", matcher, no, len(no))])
    (after,) = pipeline.start([("a", matcher, [], len(no))]).result()["a"]
    # One fill per step, made by advance: start only collected it.
    assert len(threads) == 2 and all(t.startswith("pagedinfer-grammar") for t in threads)
    first_allowed, after_allowed = allowed_tokens([first, after], compiler.vocab_size)
    assert no[0] in first_allowed and len(first_allowed) < 10
    assert after_allowed == set(compiler.eos_token_ids)
    # A mask prepared for another position, or rows with a draft, are filled anew, from
    # the matcher's state after every token handed to advance.
    again = pipeline.start([("a", matcher, [], 99)]).result()["a"]
    assert len(threads) == 3 and allowed_tokens(again, compiler.vocab_size) == [after_allowed]
    pipeline.forget(["a"])
    assert pipeline.start([("a", matcher, [], len(no))]).result()["a"] is not None
    assert len(threads) == 4


def test_the_engine_advances_grammars_once_per_kept_token_off_its_thread(llm, monkeypatch):
    calls: list[tuple[str, int]] = []
    row_masks = GrammarMatcher.row_masks

    def spy(self, draft, vocab):
        calls.append((threading.current_thread().name, len(draft)))
        return row_masks(self, draft, vocab)

    monkeypatch.setattr(GrammarMatcher, "row_masks", spy)
    params = SamplingParams(
        max_tokens=30,
        temperature=1.0,
        seed=3,
        structured_output=StructuredOutput.json_schema(PERSON),
    )
    (out,) = llm.generate([PROMPT], params)
    tokens = len(out.outputs[0].token_ids)
    # The first mask, then one after each kept token but the last: every mask was
    # prepared one step ahead, none filled again when its step was scheduled.
    assert len(calls) == tokens
    assert all(name.startswith("pagedinfer-grammar") and draft == 0 for name, draft in calls)
    # Forks start from their first sample's mask, then each prepares its own.
    calls.clear()
    (out,) = llm.generate([PROMPT], dataclasses.replace(params, n=3))
    assert len(calls) == 1 + sum(len(s.token_ids) - 1 for s in out.outputs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_at_any_temperature(llm, temperature):
    params = SamplingParams(
        max_tokens=120,
        temperature=temperature,
        seed=7,
        n=1 if temperature == 0 else 4,
        structured_output=StructuredOutput.json_schema(PERSON),
    )
    (out,) = llm.generate([PROMPT], params)
    for sample in out.outputs:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), PERSON)
        else:  # ran out of tokens inside a long string: still a prefix of valid JSON
            assert sample.finish_reason == "length"
    assert any(s.finish_reason == "stop" for s in out.outputs)


def test_choice_regex_and_grammar_are_honoured_with_top_k_top_p_min_p(llm):
    params = [
        SamplingParams(
            max_tokens=8, temperature=1.0, top_k=5, structured_output=StructuredOutput.choice(
                ["alpha", "beta", "gamma"]
            )
        ),
        SamplingParams(
            max_tokens=12, temperature=0.8, top_p=0.9,
            structured_output=StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}"),
        ),
        SamplingParams(
            max_tokens=12, temperature=1.0, min_p=0.05,
            structured_output=StructuredOutput("grammar", 'root ::= "on" | "off"'),
        ),
    ]  # fmt: skip
    outs = llm.generate(["Pick one:", "Phone number:", "The switch is"], params)
    assert outs[0].outputs[0].text in {"alpha", "beta", "gamma"}
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in {"on", "off"}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        logprobs=20,  # more than the tokens that can start either word
        structured_output=StructuredOutput.choice(["red", "green"]),
    )
    (out,) = llm.generate(["My favourite colour is"], params)
    sample = out.outputs[0]
    assert sample.text in {"red", "green"}
    first = sample.logprobs[0]
    # Only tokens that start "red" or "green" can be picked, and they share all the mass.
    texts = [llm.engine.tokenizer.decode([t]) for t, _ in first["top"]]
    assert all("red".startswith(t) or "green".startswith(t) for t in texts)
    assert sum(np.exp(lp) for _, lp in first["top"]) == pytest.approx(1.0, abs=1e-4)


def test_seeded_samples_are_reproducible_and_the_same_with_greedy_batches(llm):
    so = StructuredOutput.json_schema(PERSON)
    seeded = SamplingParams(max_tokens=60, temperature=1.0, seed=11, n=2, structured_output=so)
    alone = llm.generate([PROMPT], seeded)[0]
    batched = llm.generate(
        [PROMPT, "Another person:"],
        [seeded, SamplingParams(max_tokens=30, temperature=0.0, structured_output=so)],
    )[0]
    assert [s.text for s in alone.outputs] == [s.text for s in batched.outputs]


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    params = SamplingParams(
        max_tokens=5, temperature=0.0, structured_output=StructuredOutput.json_schema(PERSON)
    )
    (out,) = llm.generate([PROMPT], params)
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith('{"name": ')
    assert llm.engine.scheduler.kv_cache.pool.num_free == llm.engine.num_blocks


@pytest.fixture(scope="module")
def speculative() -> LLM:
    # Passes priced far above their rows: every guess is drafted.
    return LLM(
        max_model_len=512,
        kv_cache_memory=256 * 2**20,
        max_num_batched_tokens=256,
        num_speculative_tokens=4,
        speculative_pass_rows=1000,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_drafts_keep_only_what_the_grammar_allows(llm, speculative, temperature):
    examples = '{"name": "Ann", "age": 31, "pets": ["cat"]}\n' * 4
    prompts = [f"People as JSON:\n{examples}", "Digits: 1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9"]
    params = [
        SamplingParams(
            max_tokens=40, temperature=temperature, seed=2,
            structured_output=StructuredOutput.json_schema(PERSON),
        ),
        # The prompt's drafts (" 1 2 ...") hold spaces, which this regex forbids.
        SamplingParams(
            max_tokens=12, temperature=temperature, seed=2,
            structured_output=StructuredOutput("regex", "[0-9]{10}"),
        ),
    ]  # fmt: skip
    before = speculative.engine.stats()
    expected = llm.generate(prompts, params)
    got = speculative.generate(prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert re.fullmatch("[0-9]{10}", got[1].outputs[0].text)
    after = speculative.engine.stats()
    proposed = after.draft_tokens - before.draft_tokens
    kept = after.accepted_draft_tokens - before.accepted_draft_tokens
    assert proposed > kept > 0


def test_preemption_and_prefix_caching_keep_constrained_outputs(llm):
    # 12 blocks of 16 tokens cannot hold every request at once: the scheduler preempts,
    # and the recomputed requests go on from the grammar state of their kept tokens.
    small = LLM(max_model_len=128, num_gpu_blocks=12, max_num_batched_tokens=64)
    intro = "Here is a careful description of one more person, written as a JSON object. "
    prompts = [f"{intro * 3}Person number {i}:" for i in range(8)]
    params = SamplingParams(
        max_tokens=40,
        temperature=1.0,
        seed=4,
        structured_output=StructuredOutput.json_schema(PERSON),
    )
    expected = llm.generate(prompts, params)
    got = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    again = small.generate(prompts[:1], params)[0]  # its prompt now from the prefix cache
    assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids
