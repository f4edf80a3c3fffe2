"""Speculative decoding end to end on the embedded model: exactly the outputs of decoding
one token at a time, for every sampling option, in fewer steps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedinfer.service import LLM, EngineConfig, SamplingParams
from pagedinfer.service.outputs import CompletionDelta

# A small budget chunks the longer prompts, so a prefill's last chunk can also draft.
CONFIG = dict(max_model_len=256, kv_cache_memory=32 * 2**20, max_num_batched_tokens=64)
# Prompts whose continuations repeat what came before: drafts are proposed, and kept.
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "red, green, blue, red, green, blue, red, green, blue, red,",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
]


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: list[dict] | None
    deltas: list[list[int]]  # the token ids of each delta, in order


def run(
    llm: LLM, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
) -> list[Sample]:
    """One request (text or token ids) through the engine, step by step: each sample
    and its deltas."""
    engine = llm.engine
    ids = prompt if isinstance(prompt, list) else engine.encode_prompt(prompt=prompt)
    request_id = engine.add_request(ids, params, cache_salt=cache_salt)
    samples = [Sample([], "", None, 0, None, []) for _ in range(params.n)]
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == request_id
            record(samples[delta.index], delta)
    return samples


def record(sample: Sample, delta: CompletionDelta) -> None:
    assert sample.finish_reason is None, "a delta after the sample finished"
    sample.token_ids += delta.token_ids
    sample.text += delta.text
    sample.finish_reason = delta.finish_reason
    sample.completion_tokens = delta.completion_tokens
    if delta.logprobs is not None:
        sample.logprobs = (sample.logprobs or []) + delta.logprobs
    sample.deltas.append(delta.token_ids)


def drafts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.draft_tokens, stats.accepted_draft_tokens


def assert_pool_drained(llm: LLM) -> None:
    kv = llm.engine.stats().kv  # prefix-cached blocks count as free
    assert not llm.engine.has_unfinished()
    assert kv.free == kv.total and kv.used == 0


def assert_same(plain: list[Sample], speculative: list[Sample]) -> None:
    for a, b in zip(plain, speculative, strict=True):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert b.completion_tokens == a.completion_tokens == len(b.token_ids)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    # Passes priced far above their rows: every guess is drafted, the most rows to check.
    return LLM(**CONFIG, num_speculative_tokens=4, speculative_pass_rows=1000)


@pytest.fixture(params=["compiled", "torch"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU paths: the compiled kernels (a draft's rows go to the decode kernel) and
    torch ops alone (a draft is a short prefill)."""
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", request.param)
    return request.param


def assert_same_outputs(plain: LLM, speculative: LLM, params: SamplingParams) -> None:
    """The prompts, batched, give the same outputs with and without speculation, and
    some draft tokens were kept."""
    before = drafts(speculative)
    expected = plain.generate(PROMPTS, params)
    got = speculative.generate(PROMPTS, params)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert len(b.outputs[0].token_ids) == params.max_tokens
    assert drafts(speculative)[1] > before[1]
    assert_pool_drained(speculative)


def test_greedy_outputs_are_identical_and_drafts_are_kept(
    plain: LLM, speculative: LLM, cpu_kernels: str
) -> None:
    before = drafts(speculative)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_same_outputs(plain, speculative, params)
    proposed, kept = (now - then for now, then in zip(drafts(speculative), before, strict=True))
    assert proposed > kept > 0
    assert drafts(plain) == (0, 0)


def test_kept_drafts_yield_several_tokens_per_step(plain: LLM, speculative: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = run(plain, PROMPTS[1], params)
    got = run(speculative, PROMPTS[1], params)
    assert_same(expected, got)
    assert all(len(d) == 1 for d in expected[0].deltas)
    assert max(len(d) for d in got[0].deltas) > 1
    assert len(got[0].deltas) < len(expected[0].deltas)


def test_seeded_sampling_draws_the_same_tokens(plain: LLM, speculative: LLM) -> None:
    # A kept draft token used one draw of the sample's generator, a rejected one none.
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    assert_same_outputs(plain, speculative, params)


def test_penalties_see_the_draft_tokens_before_each_row(plain: LLM, speculative: LLM) -> None:
    # A frequency penalty this strong changes the greedy pick when a row does not count
    # the draft tokens before it.
    params = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        repetition_penalty=1.05,
        frequency_penalty=1.0,
        ignore_eos=True,
    )
    assert_same_outputs(plain, speculative, params)


def test_logprobs_have_one_entry_per_token_and_match(plain: LLM, speculative: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)
    (expected,) = run(plain, PROMPTS[0], params)
    (got,) = run(speculative, PROMPTS[0], params)
    assert max(len(d) for d in got.deltas) > 1
    assert_same([expected], [got])
    assert [e["token_id"] for e in got.logprobs] == got.token_ids
    for a, b in zip(expected.logprobs, got.logprobs, strict=True):
        assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4)
        assert [t for t, _ in b["top"]] == [t for t, _ in a["top"]]
        assert [v for _, v in b["top"]] == pytest.approx([v for _, v in a["top"]], abs=1e-4)


def stop_inside_a_kept_draft(sample: Sample) -> int:
    """The position of an output token that came in the middle of a step's kept tokens
    (neither first nor last) and occurs nowhere earlier in the output."""
    position = 0
    for tokens in sample.deltas:
        for j in range(1, len(tokens) - 1):
            if tokens[j] not in sample.token_ids[: position + j]:
                return position + j
        position += len(tokens)
    raise AssertionError("no step kept a draft token seen for the first time")


@pytest.mark.parametrize("kind", ["stop_token_ids", "stop"])
def test_a_stop_inside_a_kept_draft_ends_the_output_where_it_would_without(
    plain: LLM, speculative: LLM, kind: str
) -> None:
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    (free,) = run(speculative, PROMPTS[0], SamplingParams(**params))
    position = stop_inside_a_kept_draft(free)
    token = free.token_ids[position]
    if kind == "stop_token_ids":
        stop = {"stop_token_ids": [token]}
    else:
        word = speculative.tokenizer.decode([token]).strip()
        assert word and word not in speculative.tokenizer.decode(free.token_ids[:position])
        stop = {"stop": [word]}
    expected = run(plain, PROMPTS[0], SamplingParams(**params, **stop))
    got = run(speculative, PROMPTS[0], SamplingParams(**params, **stop))
    assert_same(expected, got)
    assert got[0].finish_reason == "stop"
    assert got[0].token_ids == free.token_ids[: position + 1]
    # The step that stopped had kept tokens past the stop: they were dropped.
    last = len(got[0].deltas) - 1
    assert len(got[0].deltas[last]) < len(free.deltas[last])
    assert_pool_drained(speculative)


def test_a_stop_in_the_step_that_reaches_max_tokens_finishes_as_a_stop(
    speculative: LLM,
) -> None:
    # The kept tokens reach max_tokens (the scheduler finishes the request for length)
    # but a stop token comes first among them: the request stopped, it did not run out.
    params = dict(temperature=0.0, ignore_eos=True)
    (free,) = run(speculative, PROMPTS[0], SamplingParams(max_tokens=16, **params))
    position = stop_inside_a_kept_draft(free)
    step_end = 0
    for tokens in free.deltas:
        step_end += len(tokens)
        if step_end > position:
            break
    stop = SamplingParams(max_tokens=step_end, stop_token_ids=[free.token_ids[position]], **params)
    (got,) = run(speculative, PROMPTS[0], stop)
    assert got.finish_reason == "stop"
    assert got.completion_tokens == position + 1 < step_end
    # Finished requests are reported with the scheduler's next output.
    (request,) = speculative.engine.scheduler.schedule().finished
    assert request.status.finish_reason == "stop"
    assert request.num_output_tokens == position + 1


def test_preemption_under_a_tight_pool_keeps_outputs_identical(plain: LLM) -> None:
    # 6 blocks of 16 tokens for three requests that grow to 3 blocks each: drafts,
    # preemptions and recomputes mix.
    tight = LLM(
        max_model_len=64, num_gpu_blocks=6, max_num_batched_tokens=32, num_speculative_tokens=4
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = plain.generate(PROMPTS, params)
    got = tight.generate(PROMPTS, params)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.accepted_draft_tokens > 0
    assert_pool_drained(tight)


def test_max_tokens_is_respected_exactly(plain: LLM, speculative: LLM) -> None:
    lengths = range(1, 8)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    expected = plain.generate([PROMPTS[0]] * len(params), params)
    got = speculative.generate([PROMPTS[0]] * len(params), params)
    for n, a, b in zip(lengths, expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == n
        assert b.outputs[0].finish_reason == "length"
    assert_pool_drained(speculative)


def test_n_samples_are_identical_with_and_without_speculation(plain: LLM, speculative: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    expected = run(plain, PROMPTS[1], params)
    got = run(speculative, PROMPTS[1], params)
    assert_same(expected, got)
    assert expected[0].token_ids != expected[1].token_ids  # two samples, not one twice
    assert_pool_drained(speculative)


def test_n_samples_fork_correctly_when_the_prompts_last_chunk_drafts(
    plain: LLM, speculative: LLM
) -> None:
    # 65 prompt tokens in a budget of 64: the prefill's last chunk is one token, which
    # the scheduler treats as a decode and gives a draft; the samples fork after it. A
    # salt of its own: no prefix-cache hit from other tests shortens the prefill.
    prompt = speculative.engine.encode_prompt(prompt=PROMPTS[0] * 4)[:65]
    params = SamplingParams(max_tokens=12, temperature=0.0, n=2, ignore_eos=True)
    expected = run(plain, prompt, params, cache_salt="last-chunk")
    got = run(speculative, prompt, params, cache_salt="last-chunk")
    assert_same(expected, got)
    assert got[0].token_ids == got[1].token_ids  # greedy: both samples alike
    assert_pool_drained(speculative)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"speculative_max_running": 0}, "speculative_max_running"),
        ({"speculative_max_running": 1.5}, "speculative_max_running"),
        ({"speculative_pass_rows": 0}, "speculative_pass_rows"),
        ({"speculative_pass_rows": 2.5}, "speculative_pass_rows"),
    ],
)
def test_invalid_speculation_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("spec", [0, 16])
def test_speculation_settings_at_the_bounds_are_accepted(spec: int) -> None:
    config = EngineConfig(num_speculative_tokens=spec, prompt_lookup_min=2, prompt_lookup_max=2)
    assert config.num_speculative_tokens == spec
