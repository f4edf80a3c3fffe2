"""The sampler, the stop checker and the incremental detokenizer, as specifications."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedinfer.service import sampler as sampler_module
from pagedinfer.service.detokenizer import IncrementalDetokenizer
from pagedinfer.service.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    apply_penalties,
    greedy_tokens,
    make_generator,
    processed_probs,
)
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.stop_checker import StopChecker

VOCAB = 64


def row(params: SamplingParams, prompt=(), output=(), index: int = 0) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), make_generator(params.seed, index))


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """One row per line of logits, all with the same (unseeded) params."""
    results = Sampler()(logits, [row(params) for _ in range(logits.shape[0])])
    return [r.token_id for r in results]


def frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts.float() / len(tokens)).tolist()


# --- greedy and filters ---------------------------------------------------------------


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(8)
    results = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in results)


def test_greedy_tokens_break_ties_and_treat_nan_as_torch_argmax_does():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [1.0, nan, 3.0, nan],  # NaN counts as the largest; the first one wins
            [2.0, 5.0, 5.0, 1.0],  # ties: the first
            [-inf, -inf, -inf, -inf],
            [inf, 1.0, inf, 0.0],
        ]
    )
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist() == [1, 1, 0, 0]
    # A transposed view and bf16 (which numpy has no type for) give the same answers.
    wide = random_logits(16, vocab=5000).t().contiguous().t()
    assert greedy_tokens(wide).tolist() == wide.argmax(-1).tolist()
    assert greedy_tokens(wide.bfloat16()).tolist() == wide.bfloat16().argmax(-1).tolist()


def test_top_k_1_is_greedy():
    logits = random_logits(32)
    assert sample(logits, SamplingParams(temperature=1.5, top_k=1)) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(32)
    assert sample(logits, SamplingParams(top_p=1e-6)) == logits.argmax(-1).tolist()


def test_min_p_1_is_greedy():
    logits = random_logits(32)
    assert sample(logits, SamplingParams(min_p=1.0)) == logits.argmax(-1).tolist()


def test_top_k_samples_only_among_the_k_most_likely():
    logits = random_logits(1).expand(2000, VOCAB)
    allowed = set(logits[0].topk(3).indices.tolist())
    torch.manual_seed(0)
    tokens = sample(logits, SamplingParams(temperature=3.0, top_k=3))
    assert set(tokens) == allowed


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    results = Sampler()(logits, [row(p) for p in params])
    argmax = logits.argmax(-1).tolist()
    assert [results[i].token_id for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_tiny_temperature_is_greedy_without_overflow():
    logits = random_logits(16) * 100
    assert sample(logits, SamplingParams(temperature=1e-7)) == logits.argmax(-1).tolist()


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters as plainly as they can be written: one row, one full sort."""
    probs = (logits / p.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if p.top_k > 0:
        order = order[: p.top_k]
    total = sum(probs[i].item() for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= p.top_p * total:
            break
        kept.append(i)
        mass += probs[i].item()
    kept = [i for i in kept if probs[i] >= p.min_p * probs[order[0]]]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out


FILTERS = [
    SamplingParams(temperature=0.9, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=5.0, top_p=0.99),  # flat: the cut lies far down the list
    SamplingParams(temperature=0.6, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0),
]


@pytest.mark.parametrize("candidates", [4, 10_000], ids=["few-candidates", "many-candidates"])
def test_filters_keep_exactly_what_a_full_sort_keeps(monkeypatch, candidates):
    monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
    logits = random_logits(len(FILTERS), vocab=300, seed=3)
    got = processed_probs(logits, FILTERS)
    for i, params in enumerate(FILTERS):
        want = reference_probs(logits[i], params)
        assert torch.equal(got[i] > 0, want > 0), params
        assert torch.allclose(got[i], want, atol=1e-6)


# --- distributions (many draws of a small fixed distribution, loose bounds) -----------

PROBS = [0.5, 0.3, 0.15, 0.05]
DRAWS = 20_000


def expected(kept: list[float]) -> list[float]:
    total = sum(kept)
    return [p / total for p in kept]


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=0.5), expected([p**2 for p in PROBS])),
        (SamplingParams(temperature=2.0), expected([math.sqrt(p) for p in PROBS])),
        (SamplingParams(top_k=2), expected([0.5, 0.3, 0, 0])),
        # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it: two tokens stay.
        (SamplingParams(top_p=0.7), expected([0.5, 0.3, 0, 0])),
        # min_p 0.2 of the top probability 0.5 drops everything under 0.1.
        (SamplingParams(min_p=0.2), expected([0.5, 0.3, 0.15, 0])),
        (SamplingParams(top_k=3, top_p=0.9, min_p=0.4), expected([0.5, 0.3, 0, 0])),
    ],
    ids=["plain", "t0.5", "t2", "top_k", "top_p", "min_p", "combined"],
)
def test_sampled_frequencies_follow_the_processed_distribution(params, want):
    torch.manual_seed(1234)
    logits = torch.tensor(PROBS).log().expand(DRAWS, len(PROBS))
    got = frequencies(sample(logits, params), len(PROBS))
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=0.015)
        if w == 0:
            assert g == 0


# --- penalties --------------------------------------------------------------------------


def test_penalties_change_logits_exactly_as_the_formulas_say():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    rows = [
        row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 1],
            output=[2, 3, 3],
        ),
        row(SamplingParams(), prompt=[0], output=[1]),  # no penalties: untouched
    ]
    out = logits.clone()
    apply_penalties(out, rows, [0])
    # repetition over prompt+output: positive / 2, negative * 2; then the output terms.
    want0 = [
        2.0 / 2,
        -1.0 * 2,
        0.5 / 2 - 0.5 * 1 - 0.25,
        -3.0 * 2 - 0.5 * 2 - 0.25,
        1.0,
        0.0,
    ]
    assert out[0].tolist() == pytest.approx(want0)
    assert torch.equal(out[1], logits[1])


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    apply_penalties(logits, [row(params, prompt=[0, 0, 1], output=[1, 2, 2])], [0])
    assert logits[0].tolist() == [0.0, -2.0, -3.0, 0.0]


def test_repetition_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, greedy) == [0]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    result = Sampler()(logits, [row(penalised, prompt=[0])])
    assert result[0].token_id == 1


def test_penalties_leave_the_callers_logits_alone():
    logits = random_logits(2)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=1.0, temperature=0.7)
    Sampler()(logits, [row(params, prompt=[1, 2], output=[3]) for _ in range(2)])
    assert torch.equal(logits, before)


# --- seeds ------------------------------------------------------------------------------


def generate(seed_rows: list[tuple[int, SamplingParams]], steps: int, batch_size: int):
    """Runs `steps` sampling steps; seeded rows sit at the given positions of a batch
    otherwise filled with unseeded and differently seeded rows. Returns each seeded
    row's tokens. Every row sees the same logits for a given step.
    """
    positions = {pos: make_generator(p.seed, 0) for pos, p in seed_rows}
    params_at = dict(seed_rows)
    filler = [SamplingParams(), SamplingParams(seed=999, top_k=5), SamplingParams(temperature=0)]
    filler_generators = {i: make_generator(filler[i % 3].seed, i) for i in range(batch_size)}
    tokens: dict[int, list[int]] = {pos: [] for pos in positions}
    sampler = Sampler()
    for step in range(steps):
        logits = random_logits(1, seed=step).expand(batch_size, VOCAB).contiguous()
        rows = []
        for i in range(batch_size):
            if i in positions:
                rows.append(SamplingRow(params_at[i], [1, 2], tokens[i], positions[i]))
            else:
                rows.append(SamplingRow(filler[i % 3], [1], [], filler_generators[i]))
        for pos, result in enumerate(sampler(logits, rows)):
            if pos in tokens:
                tokens[pos].append(result.token_id)
    return tokens


SEEDED = SamplingParams(seed=42, temperature=1.0, top_p=0.95, repetition_penalty=1.1)


def test_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    alone = generate([(0, SEEDED)], steps=12, batch_size=1)[0]
    at_three = generate([(3, SEEDED)], steps=12, batch_size=7)[3]
    other = SamplingParams(seed=7, temperature=0.8)
    crowded = generate([(1, other), (5, SEEDED)], steps=12, batch_size=9)[5]
    assert alone == at_three == crowded


def test_different_seeds_and_sample_indices_give_different_streams():
    a = generate([(0, SEEDED)], steps=20, batch_size=1)[0]
    b = generate([(0, SamplingParams(seed=43, temperature=1.0, top_p=0.95))], 20, 1)[0]
    assert a != b
    first = make_generator(5, 0).initial_seed()
    assert first != make_generator(5, 1).initial_seed()
    assert first == make_generator(5, 0).initial_seed()
    assert make_generator(None, 0) is None


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_model_distribution():
    logits = random_logits(3)
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.5, top_k=4, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    results = Sampler()(logits, [row(p, prompt=[1, 2, 3]) for p in params])
    first, second, third = results
    assert first.logprob == pytest.approx(raw[0, first.token_id].item())
    top = raw[0].topk(3)
    assert [t for t, _ in first.top_logprobs] == top.indices.tolist()
    assert [v for _, v in first.top_logprobs] == pytest.approx(top.values.tolist())
    assert second.logprob == pytest.approx(raw[1].max().item())
    assert second.top_logprobs == []
    assert third == SampleResult(third.token_id, None, None)


def test_logprobs_on_the_greedy_fast_path():
    logits = random_logits(4)
    results = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=2))] * 4)
    raw = torch.log_softmax(logits, -1)
    for i, result in enumerate(results):
        assert result.token_id == raw[i].argmax().item()
        assert result.logprob == pytest.approx(raw[i].max().item())
        assert result.top_logprobs[0][0] == result.token_id


def test_logits_must_have_one_row_per_sampling_row():
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(2, VOCAB), [row(SamplingParams())])


# --- stop checker -----------------------------------------------------------------------

EOS = 2


def feed(checker: StopChecker, pieces: list[tuple[int, str]]):
    """Feeds (token id, text delta) pairs; returns the step that stopped and the decision."""
    text = ""
    for step, (token, delta) in enumerate(pieces):
        text += delta
        decision = checker.check(token, text, len(delta), step + 1)
        if decision.finish_reason is not None:
            return step, decision
    return None, (None, text)


def test_eos_stops_and_leaves_its_text_out():
    checker = StopChecker(SamplingParams(), eos_token_ids=[EOS])
    step, (reason, text) = feed(checker, [(10, "Hello"), (EOS, "</s>")])
    assert (step, reason, text) == (1, "stop", "Hello")


def test_ignore_eos_does_not_stop_on_eos_but_stop_token_ids_still_apply():
    checker = StopChecker(SamplingParams(ignore_eos=True, stop_token_ids=[7]), eos_token_ids=[EOS])
    step, (reason, text) = feed(checker, [(EOS, "a"), (5, "b"), (7, "c"), (8, "d")])
    assert (step, reason, text) == (2, "stop", "ab")


def test_stop_string_inside_one_token():
    checker = StopChecker(SamplingParams(stop=["END"]))
    step, (reason, text) = feed(checker, [(1, "one "), (2, "twoENDthree")])
    assert (step, reason, text) == (1, "stop", "one two")


def test_stop_string_spanning_tokens():
    checker = StopChecker(SamplingParams(stop=["lo Wo"]))
    step, (reason, text) = feed(checker, [(1, "Hel"), (2, "lo W"), (3, "orld")])
    assert (step, reason, text) == (2, "stop", "Hel")


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(SamplingParams(stop=["cd", "b"]))
    step, (reason, text) = feed(checker, [(1, "a"), (2, "bcd")])
    assert (step, reason, text) == (1, "stop", "a")


def test_the_max_tokens_th_token_ends_for_length_unless_it_is_a_stop():
    params = SamplingParams(max_tokens=2, stop=["b"], stop_token_ids=[7])
    step, (reason, text) = feed(StopChecker(params), [(1, "a"), (2, "c"), (3, "d")])
    assert (step, reason, text) == (1, "length", "ac")
    step, (reason, text) = feed(StopChecker(params), [(1, "a"), (7, "c")])
    assert (step, reason, text) == (1, "stop", "a")
    step, (reason, text) = feed(StopChecker(params), [(1, "a"), (2, "cbd")])
    assert (step, reason, text) == (1, "stop", "ac")
    assert not StopChecker(params).is_last(1) and StopChecker(params).is_last(2)


def test_no_stop_returns_the_text_unchanged():
    checker = StopChecker(SamplingParams(stop=["zz"]), eos_token_ids=[EOS])
    step, (reason, text) = feed(checker, [(1, "z"), (3, ""), (4, "y z")])
    assert (step, reason, text) == (None, None, "zy z")
    assert checker.hold_back == 1
    assert StopChecker(SamplingParams()).hold_back == 0


# --- incremental detokenizer ------------------------------------------------------------


def detokenize(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add_token(t) for t in output_ids]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Héllo wörld: café, naïve, Straße, Ελληνικά, русский текст.",
    "你好，世界。日本語のテキストと한국어 문장.",
    "Emoji 🎉👨\u200d👩\u200d👧 and flags 🇫🇷🇯🇵 done 🤖!",
    "  leading spaces,\ttabs\nand new lines\n\n  indented",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model_dir):
    """The embedded default model's tokenizer (byte-level BPE, like GPT-2's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    deltas = detokenize(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # Split into a prompt and an output at every position: the output's text follows.
    for cut in range(1, len(ids)):
        prompt_text = tok.decode(ids[:cut])
        if "\ufffd" in prompt_text:  # the cut splits a character: no clean boundary
            continue
        deltas = detokenize(tok, ids[:cut], ids[cut:])
        assert prompt_text + "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = [*tok.encode("Hi there", add_special_tokens=False), tok.eos_token_id]
    assert "".join(detokenize(tok, [], ids)) == "Hi there"


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Llama-style tokenizer: "▁" marks spaces, bytes fall back to <0xNN> tokens,
    and decoding strips the leading space, so decoding token by token loses spaces.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=150,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz,.!"),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"]
    tokenizer.train_from_iterator(corpus * 10, trainer)
    # The <0xNN> byte tokens are ordinary vocabulary entries, as in Llama's tokenizer.
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def test_sentencepiece_spaces_and_byte_fallback_survive(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    text = "hello world the fox héllo 你好 🎉 over the dog."
    ids = tok.encode(text, add_special_tokens=False)
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != text  # what the sliding window is there for
    deltas = detokenize(tok, [], ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    prompt = tok.encode("hello world", add_special_tokens=False)
    deltas = detokenize(tok, prompt, tok.encode("the fox", add_special_tokens=False))
    assert "".join(deltas) == " the fox"


def test_an_unfinished_character_is_held_then_flushed(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    euro = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("hello", add_special_tokens=False))
    assert detok.add_token(euro[0]) == ""
    assert detok.add_token(euro[1]) == ""
    assert detok.add_token(euro[2]) == "€"
    assert detok.add_token(euro[0]) == ""  # a stray lead byte at the end of the sequence
    flushed = detok.flush()  # how invalid bytes render is the tokenizer's business
    assert flushed.endswith("\ufffd")
    assert detok.output_text == "€" + flushed


def test_tokens_picked_without_logits_are_taken_as_they_are() -> None:
    """Rows whose token the model picked (their logits rows unwritten: NaN here) keep it;
    the others are sampled from their logits as usual."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    logits[[0, 2]] = float("nan")
    greedy = SamplingParams(temperature=0.0)
    results = Sampler()(logits, [row(greedy)] * 3, torch.tensor([7, -1, 4]))
    assert [r.token_id for r in results] == [7, int(logits[1].argmax()), 4]
    every = Sampler()(logits[[0, 2]], [row(greedy)] * 2, torch.tensor([7, 4]))
    assert [r.token_id for r in every] == [7, 4]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ],
    ids=["sampled", "logprobs", "penalised"],
)
def test_a_token_for_a_row_that_needs_its_logits_is_refused(params) -> None:
    logits = torch.zeros(2, 10)
    greedy = SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="a row that needs its logits was given a token"):
        Sampler()(logits, [row(greedy), row(params)], torch.tensor([1, 2]))


def test_tokens_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tokens must be \[2\], got \(3,\)"):
        Sampler()(torch.zeros(2, 10), [row(SamplingParams(temperature=0.0))] * 2, torch.ones(3))


def test_a_batch_larger_than_a_chunk_samples_as_one_batch_would(monkeypatch):
    """Rows are sampled a chunk at a time (so the logits' copies stay small); seeded,
    penalised, greedy and logprob rows come out as with the whole batch in one chunk."""
    kinds = [
        SamplingParams(seed=3, temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(seed=5, temperature=1.2, top_k=5, repetition_penalty=1.3),
        SamplingParams(seed=9, temperature=0.7, presence_penalty=0.5, logprobs=1),
    ]
    params = [kinds[i % 4] for i in range(11)]
    logits = random_logits(11, seed=4)

    def run() -> list[tuple]:
        rows = [row(p, prompt=[1, 2], output=[3, i % 5], index=i) for i, p in enumerate(params)]
        return [(r.token_id, r.logprob, r.top_logprobs) for r in Sampler()(logits, rows)]

    whole = run()
    monkeypatch.setattr(sampler_module, "SAMPLE_CHUNK_ROWS", 3)
    assert run() == whole
