"""logit_bias, min_tokens, skip_special_tokens and include_stop_str_in_output: in the
sampler, and end to end on the embedded model, beside greedy requests whose tokens are
picked without their logits."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.service import LLM, SamplingParams
from pagedinfer.service.sampler import Sampler, SamplingRow, argmax_only
from pagedinfer.service.stop_checker import StopChecker

VOCAB = 64
EOS = 2


def row(params: SamplingParams, output=()) -> SamplingRow:
    return SamplingRow(params, [1, 2, 3], list(output), None)


def logits_with_argmax(token: int, rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, token] = 5.0
    return logits


def test_processed_rows_never_take_the_argmax_only_path():
    assert argmax_only(SamplingParams(temperature=0.0))
    assert not argmax_only(SamplingParams(temperature=0.0, logit_bias={3: 1.0}))
    assert not argmax_only(SamplingParams(temperature=0.0, min_tokens=2))
    # Once min_tokens are out, nothing is masked: the logits-free pick serves again.
    assert not argmax_only(SamplingParams(temperature=0.0, min_tokens=2), 1)
    assert argmax_only(SamplingParams(temperature=0.0, min_tokens=2), 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bias_of_100_forces_a_token_and_minus_100_bans_one(temperature):
    sampler = Sampler([EOS])
    logits = logits_with_argmax(EOS, rows=2)
    rows = [
        row(SamplingParams(temperature=temperature, logit_bias={7: 100.0})),
        row(SamplingParams(temperature=0.0, logit_bias={EOS: -100.0, 9: 1.0})),
    ]
    raw = logits.clone()
    results = sampler(logits, rows)
    assert [r.token_id for r in results] == [7, 9]
    assert torch.equal(logits, raw)  # the caller's logits (and logprobs) stay raw


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    sampler = Sampler([EOS])
    logits = logits_with_argmax(EOS, rows=4)
    logits[:, 5] = 4.0  # stop token id, next likeliest
    logits[:, 6] = 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    rows = [row(params, [8, 8]), row(params, [8, 8, 8]), row(ignoring, [8]), row(params)]
    tokens = [r.token_id for r in sampler(logits, rows)]
    # Two outputs: still masked; three: EOS again; ignore_eos keeps EOS a plain token.
    assert tokens == [6, EOS, EOS, 6]


def test_min_tokens_keeps_stop_strings_from_ending_early():
    checker = StopChecker(SamplingParams(stop=["x"], min_tokens=3), [EOS])
    assert checker.check(10, "ax", 1, 2).finish_reason is None
    assert checker.check(10, "axbx", 1, 3) == ("stop", "axb")


def test_include_stop_str_in_output_keeps_the_stop():
    include = SamplingParams(stop=["END"], stop_token_ids=[9], include_stop_str_in_output=True)
    checker = StopChecker(include, [EOS])
    assert checker.check(10, "abc END tail", 8, 4) == ("stop", "abc END")
    assert checker.check(9, "abc<9>", 3, 4) == ("stop", "abc<9>")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


# --- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, kv_cache_memory=64 * 2**20, max_num_batched_tokens=256)


def chat_prompt(llm: LLM, text: str) -> list[int]:
    return llm.engine.encode_prompt(messages=[{"role": "user", "content": text}])


def test_logit_bias_forces_a_token_beside_plain_greedy_requests(llm):
    """A biased greedy request in the same batch as plain greedy ones (which the CPU
    executor may pick without logits): the bias applies, the others are unchanged."""
    prompt = "The capital of France is"
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate([prompt], plain)
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            logit_bias={forced: 100.0})  # fmt: skip
    banned = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            logit_bias={alone.outputs[0].token_ids[0]: -100.0})  # fmt: skip
    outs = llm.generate([prompt, prompt, prompt], [plain, biased, banned])
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == [forced] * 8
    assert outs[2].outputs[0].token_ids[0] != alone.outputs[0].token_ids[0]


def test_min_tokens_prevents_an_early_eos(llm):
    """EOS biased to be every step's argmax: without min_tokens it is the first token;
    with min_tokens 5 it comes right after the fifth."""
    eos = llm.tokenizer.eos_token_id
    assert eos in llm.engine.eos_token_ids
    prompt = chat_prompt(llm, "Say yes.")
    base = dict(max_tokens=32, temperature=0.0, logit_bias={eos: 100.0})
    at_once, held = llm.generate(
        [prompt, prompt], [SamplingParams(**base), SamplingParams(**base, min_tokens=5)]
    )
    assert at_once.outputs[0].token_ids == [eos]
    assert held.outputs[0].finish_reason == "stop"
    tokens = held.outputs[0].token_ids
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:-1]


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={special: 100.0})
    shown, hidden = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(**params, skip_special_tokens=False), SamplingParams(**params)],
    )
    assert shown.outputs[0].text == "<|im_start|>" * 3
    assert hidden.outputs[0].text == ""


def test_include_stop_str_in_output_end_to_end(llm):
    prompt = "1, 2, 3, 4, 5, 6,"
    base = dict(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[" 8"])
    cut, kept = llm.generate(
        [prompt, prompt],
        [SamplingParams(**base), SamplingParams(**base, include_stop_str_in_output=True)],
    )
    assert cut.outputs[0].finish_reason == kept.outputs[0].finish_reason == "stop"
    assert kept.outputs[0].text == cut.outputs[0].text + " 8"


def test_the_grpc_sampling_message_carries_the_fields():
    from pagedinfer.service.proto import inference_pb2 as pb
    from pagedinfer.service.server import sampling_params_from_proto

    message = pb.SamplingParams(logit_bias={5: 100.0, 7: -2.5}, min_tokens=3,
                                skip_special_tokens=False, include_stop_str_in_output=True)  # fmt: skip
    params = sampling_params_from_proto(message)
    assert params.logit_bias == {5: 100.0, 7: -2.5}
    assert params.min_tokens == 3
    assert not params.skip_special_tokens and params.include_stop_str_in_output
    defaults = sampling_params_from_proto(pb.SamplingParams())
    assert (defaults.logit_bias, defaults.min_tokens) == ({}, 0)
    assert defaults.skip_special_tokens and not defaults.include_stop_str_in_output
    with pytest.raises(ValueError, match=r"^sampling\.logit_bias"):
        sampling_params_from_proto(pb.SamplingParams(logit_bias={5: 150.0}))


def test_the_engine_refuses_a_bias_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias holds ids outside the vocabulary"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


def test_speculative_drafts_see_the_processed_logits():
    """With speculative decoding, a draft token a bias bans or min_tokens masks is
    rejected: the outputs equal those of decoding one token at a time, and drafts are kept."""
    config = dict(max_model_len=256, kv_cache_memory=32 * 2**20, max_num_batched_tokens=64)
    plain = LLM(**config)
    speculative = LLM(**config, num_speculative_tokens=4, speculative_pass_rows=1000)
    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"
    tokenizer = plain.tokenizer
    banned = tokenizer.encode(" green", add_special_tokens=False)[0]
    eos = tokenizer.eos_token_id
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={banned: -100.0}),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, logit_bias={eos: 8.0}),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True,
                       logit_bias={banned: -100.0}),
    ]  # fmt: skip
    expected = plain.generate([prompt] * 3, params)
    got = speculative.generate([prompt] * 3, params)
    for a, b in zip(expected, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert banned not in got[0].outputs[0].token_ids
    assert eos not in got[1].outputs[0].token_ids[:6]
    assert speculative.engine.stats().accepted_draft_tokens > 0
