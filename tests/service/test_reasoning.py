"""Reasoning parsers: the thinking split from the answer, whole and streamed in any pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedinfer.service.reasoning import REASONING_PARSERS, get_reasoning_parser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
USER_TURN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def streamed(parser, text: str, pieces: list[int], prompt_tail: str) -> tuple[str, str]:
    """The concatenated pieces of `text` fed in chunks of the given sizes."""
    stream = parser.stream(prompt_tail)
    reasoning, content, at = "", "", 0
    for size in [*pieces, len(text)]:
        r, c = stream.feed(text[at : at + size])
        reasoning, content, at = reasoning + r, content + c, at + size
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("parser", "prompt_tail", "text", "expected"),
    [
        # Qwen3 / SmolLM3: the model opens the block itself.
        (QWEN3, USER_TURN, "<think>\nLet me add.\n</think>\n\n4", ("Let me add.", "4")),
        (QWEN3, USER_TURN, "Just 4.", (None, "Just 4.")),
        # thinking off: the template wrote an empty block into the prompt.
        (QWEN3, USER_TURN + "<think>\n\n</think>\n\n", "4", (None, "4")),
        # a template that opens the block in the prompt (Qwen3 thinking-2507).
        (QWEN3, USER_TURN + "<think>\n", "Hmm.\n</think>\n\n4", ("Hmm.", "4")),
        # a tag that is not at the start is part of the answer.
        (QWEN3, USER_TURN, "a <think>b</think>", (None, "a <think>b</think>")),
        # DeepSeek-R1: the output starts inside the thinking, with or without its tag.
        (R1, USER_TURN + "<think>\n", "Hmm.\n</think>\n\n4", ("Hmm.", "4")),
        (R1, USER_TURN, "<think>Hmm.</think>4", ("Hmm.", "4")),
        (R1, USER_TURN, "still thinking when max_tokens ran out", ("still thinking when max_tokens ran out", None)),
        (R1, USER_TURN, "</think>4", (None, "4")),
    ],
)  # fmt: skip
def test_split_whole_output(parser, prompt_tail, text, expected):
    assert parser.split(text, prompt_tail) == expected


@pytest.mark.parametrize("tail", [USER_TURN, USER_TURN + "<think>\n"])
def test_a_tag_split_over_pieces_is_found(tail):
    text = (
        "<think>\nfirst, 2+2\n</think>\n\nThe answer is 4." if tail == USER_TURN else "x</think>y"
    )
    whole = QWEN3.split(text, tail)
    for size in range(1, len(text) + 1):
        reasoning, content = streamed(QWEN3, text, [size] * len(text), tail)
        assert (reasoning or None, content or None) == whole, size


def test_a_stream_holds_only_what_may_become_a_tag():
    stream = QWEN3.stream(USER_TURN)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>I think") == ("I think", "")
    assert stream.feed(" more </th") == (" more", "")
    assert stream.feed("ink>\n\nAnswer") == ("", "Answer")
    assert stream.feed(" goes on") == ("", " goes on")
    assert stream.finish() == ("", "")


def test_a_stream_that_does_not_open_a_block_streams_the_answer_at_once():
    stream = QWEN3.stream(USER_TURN)
    assert stream.feed("<b>") == ("", "<b>")


@given(
    st.lists(st.sampled_from(["<think>", "</think>", "\n", " ", "a", "<", "/", "think", ">"]), max_size=12),
    st.lists(st.integers(1, 5), max_size=20),
    st.sampled_from(list(REASONING_PARSERS.values())),
    st.sampled_from([USER_TURN, USER_TURN + "<think>\n"]),
)  # fmt: skip
def test_streamed_pieces_equal_the_whole_split(words, sizes, parser, tail):
    text = "".join(words)
    reasoning, content = streamed(parser, text, sizes, tail)
    whole_reasoning, whole_content = parser.split(text, tail)
    assert reasoning == (whole_reasoning or "")
    assert content == (whole_content or "")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="qwen3, smollm3, deepseek_r1"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize("prompt_opens", [True, False])
def test_a_grammar_after_thinking_leaves_the_thinking_free(default_model_dir, prompt_opens):
    import llguidance

    from pagedinfer.service.structured_output import GrammarCompiler, StructuredOutput, Thinking
    from pagedinfer.service.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    answer = StructuredOutput.json_schema({"type": "integer"})
    output = StructuredOutput("json", answer.spec, Thinking("<think>", "</think>", prompt_opens))
    compiler.check(output)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.ll_tokenizer(), compiler._compile_uncached(output))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts("<think>\nany { text\n</think>\n\n42")
    assert not accepts("<think>a</think>\n\nforty-two")  # the answer stays constrained
    assert not accepts("<think>a</think>" + "\n" * 12 + "42")  # little whitespace between
    # Inside an opened block any text thinks; otherwise only the start tag or the answer.
    assert accepts("so </think>42") == prompt_opens
    assert accepts("42") == (not prompt_opens)


def test_the_prompt_says_where_the_output_starts():
    assert QWEN3.prompt_state(USER_TURN) == "outside"
    assert QWEN3.prompt_state(USER_TURN + "<think>\n") == "inside"
    assert QWEN3.prompt_state(USER_TURN + "<think>\n\n</think>\n\n") == "closed"
    assert R1.prompt_state(USER_TURN) == "inside"
    assert R1.prompt_state(USER_TURN + "<think>\n\n</think>\n\n") == "closed"
