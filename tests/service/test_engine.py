"""The engine end to end on the embedded model, checked token for token against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.service import LLM, SamplingParams
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.loader import ensure_default_model

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Translate to German: The weather is nice today.",
    "The three primary colours are red, yellow and",
    "Q: Why is the sky blue?\nA:",
    "In 1969 the first humans landed on the Moon. The mission was called Apollo 11 and "
    "its crew were Neil Armstrong, Buzz Aldrin and Michael Collins. Armstrong's first words",
    "Hi",
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference():
    """Greedy continuations from transformers' own generate, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # ignore_eos means "do not stop at EOS", not "never pick EOS": run to the length limit.
    model.generation_config.eos_token_id = None
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt_ids: list[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=tok.eos_token_id,
                )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def llm() -> LLM:
    # fp32 products: the exact logits transformers computes (int8 rows differ slightly)
    return LLM(
        max_model_len=512,
        kv_cache_memory=256 * 2**20,
        max_num_batched_tokens=256,
        gguf_activations="fp32",
    )


def test_batched_greedy_matches_hugging_face(llm, hf_reference):
    outputs = llm.generate(PROMPTS, GREEDY)
    assert len(outputs) == len(PROMPTS)
    for out in outputs:
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_reference(out.prompt_token_ids)
        assert out.outputs[0].text == llm.tokenizer.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )
    assert llm.engine.stats().kv.used == 0


def test_preemption_keeps_greedy_output_identical(hf_reference):
    # 12 blocks of 16 tokens cannot hold every prompt at once: the scheduler must preempt.
    small = LLM(
        max_model_len=128, num_gpu_blocks=12, max_num_batched_tokens=64, gguf_activations="fp32"
    )
    outputs = small.generate(PROMPTS, GREEDY)
    stats = small.engine.stats()
    assert stats.num_preemptions > 0
    for out in outputs:
        assert out.outputs[0].token_ids == hf_reference(out.prompt_token_ids)
    assert stats.kv.used == 0


def test_prefix_caching_reuses_shared_prefix(llm, hf_reference):
    system = (
        "You are a careful assistant. Answer briefly and precisely, cite no sources, "
        "and never make things up. If you do not know, say so. " * 4
    )
    prompts = [system + q for q in ("What is 2+2?", "Name a fruit.", "Spell cat.")]
    first = llm.generate(prompts[:1], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    assert rest[0].cached_tokens > 0 and rest[1].cached_tokens > 0
    assert rest[0].cached_tokens >= 16 * (len(llm.tokenizer.encode(system)) // 16 - 1)
    for out in [first, *rest]:
        assert out.outputs[0].token_ids == hf_reference(out.prompt_token_ids)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    crowd = (
        llm.generate(
            [PROMPTS[2], PROMPTS[0], PROMPTS[3]],
            [SamplingParams(max_tokens=20, temperature=1.0), params, SamplingParams(max_tokens=5)],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == crowd
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_fork_and_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[7])
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7)
    request_id = engine.add_request(prompt, params)
    engine.step()  # the whole prompt fits one step: prefill, sample 3 first tokens, fork
    group = engine._groups[request_id]
    tables = [group.samples[i].request.block_table for i in range(3)]
    full_prompt_blocks = len(prompt) // 16
    assert full_prompt_blocks >= 2
    shared = tables[0][:full_prompt_blocks]
    assert all(t[:full_prompt_blocks] == shared for t in tables)
    used_by_three = engine.stats().kv.used
    assert used_by_three < 3 * len(tables[0])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv.used == 0


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_n_samples_return_n_outputs(llm, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=3, ignore_eos=True)
    out = llm.generate("Tell me a colour:", params)
    assert [o.index for o in out[0].outputs] == [0, 1, 2]
    assert all(
        len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in out[0].outputs
    )
    assert llm.engine.stats().kv.used == 0


def test_stop_string_ends_and_trims_output(llm):
    base = llm.generate("1, 2, 3, 4,", GREEDY)[0].outputs[0].text
    stop = base.strip().split(",")[2].strip()  # a number the model writes later on
    out = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]))
    sample = out[0].outputs[0]
    assert sample.finish_reason == "stop"
    assert stop not in sample.text
    assert base.startswith(sample.text)


def test_logprobs_report_chosen_and_top_tokens(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 3
    for entry, token in zip(lps, out[0].outputs[0].token_ids, strict=True):
        assert entry["token_id"] == token
        assert entry["logprob"] <= 0.0
        assert len(entry["top"]) == 2
        assert entry["top"][0][0] == token  # greedy picks the most likely token


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_that_can_never_fit_is_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("Hello", SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], SamplingParams(max_tokens=2))


def test_greedy_rows_take_tokens_picked_without_their_logits(llm, hf_reference, monkeypatch):
    """In one batch: greedy requests, whose tokens the CPU executor picks without their
    logits where the CPU allows it (AVX-512 VNNI), and a greedy request with logprobs,
    whose rows keep their logits. Every request gets Hugging Face's tokens."""
    from pagedinfer.kernels.cpu import greedy_argmax

    runner = llm.engine.runner
    execute = runner.execute
    outputs = []

    def recording(out):
        result = execute(out)
        outputs.append(result)
        return result

    monkeypatch.setattr(runner, "execute", recording)
    with_logprobs = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1)
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, [GREEDY, GREEDY, with_logprobs])
    tok = llm.tokenizer
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_reference(tok.encode(prompt))
    assert all(len(entry["top"]) == 1 for entry in outs[2].outputs[0].logprobs)
    picked = []  # per request and step: (no logprobs, its rows' tokens)
    for result in outputs:
        if result.tokens is None:
            continue
        first = 0
        for req, rows in zip(result.requests, result.num_rows, strict=True):
            tokens = result.tokens[first : first + rows].tolist()
            picked.append((req.sampling_params.logprobs is None, tokens))
            first += rows
    if greedy_argmax.fast():
        # The embedded model's LM head lies on its 8-bit grid: the executor picks from it.
        assert runner.executor is not None and runner.executor.argmax is not None
        assert {greedy for greedy, _ in picked} == {True, False}
        assert all(min(tokens) >= 0 for greedy, tokens in picked if greedy)
        assert all(set(tokens) == {-1} for greedy, tokens in picked if not greedy)
    else:
        assert not picked


def test_a_batch_with_one_bad_prompt_queues_none_of_it(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(["Hello", [10**9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_request_ids_are_unique_across_every_sample(llm):
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, n=2), request_id="x")
    try:
        with pytest.raises(ValueError, match="'x' is already in use"):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="x")
        # Sample 1 of x will fork under this id: a request of its own may not take it.
        with pytest.raises(ValueError, match=r"'x#1' is already in use .*request 'x'"):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="x#1")
    finally:
        engine.abort("x")
    assert not engine.has_unfinished()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="x#1")
    while engine.has_unfinished():
        engine.step()


def test_int8_products_answer_a_chat_prompt_sensibly() -> None:
    """With int8 products the embedded model's layers (a Q4_1 file's codes) multiply int8
    rows in integers, on the fused step and the layer-by-layer path alike; greedy decoding
    of a chat prompt still answers it. The default stays the exact fp32 path."""
    from pagedinfer.kernels.cpu import grid_gemm, int8_gemm

    assert EngineConfig().gguf_activations == "fp32"
    llm = LLM(max_model_len=256, num_gpu_blocks=32, gguf_activations="int8")
    executor = llm.engine.runner.executor
    if executor is None or not executor.active or not int8_gemm.fast():
        pytest.skip("the integer products run on the compiled kernels of an AVX2 CPU")
    assert llm.engine.config.gguf_activations == "int8"
    assert all(kind in grid_gemm.DOTS for kind in executor.fused.kinds[:4])
    assert all(layer.qkv.weight.kind in grid_gemm.DOTS for layer in executor.layers)
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    (out,) = llm.generate([chat], SamplingParams(max_tokens=16, temperature=0))
    assert "Paris" in out.outputs[0].text
