"""Prompts: exactly one input, never empty, chat roles checked, token ids in the vocabulary."""

from __future__ import annotations

import pytest

from pagedinfer.service.prompts import ChatOptions, check_token_ids, encode_chat, encode_prompt


class Tokenizer:
    """A stand-in: one id per character; the chat template joins role and content."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text]

    def apply_chat_template(
        self, messages, add_generation_prompt: bool, tokenize: bool, continue_final_message=False
    ):
        assert tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return {"input_ids": self.encode(text, add_special_tokens=False)}


TOKENIZER = Tokenizer()


def test_each_kind_of_prompt_becomes_token_ids() -> None:
    assert encode_prompt(TOKENIZER, prompt="hi") == [104, 105]
    assert encode_prompt(TOKENIZER, prompt_token_ids=(3, 4)) == [3, 4]
    chat = encode_prompt(TOKENIZER, messages=[{"role": "user", "content": "hi"}])
    assert chat == TOKENIZER.encode("<user>hi<assistant>", add_special_tokens=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"exactly one of prompt, prompt_token_ids, messages \(got none\)"),
        ({"prompt": "a", "prompt_token_ids": [1]}, r"\(got prompt, prompt_token_ids\)"),
        ({"prompt": "a", "messages": []}, r"\(got prompt, messages\)"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
        ({"messages": []}, "messages must not be empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, r"messages\[0\]\.role"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content"),
    ],
)
def test_bad_prompts_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_prompt(TOKENIZER, **kwargs)


def test_chat_template_output_as_a_plain_list_is_taken_as_is() -> None:
    class ListTokenizer(Tokenizer):
        def apply_chat_template(self, messages, **options):
            return [1, 2, 3]

    assert encode_chat(ListTokenizer(), [{"role": "system", "content": "x"}]) == [1, 2, 3]


def test_token_ids_outside_the_vocabulary_are_named() -> None:
    check_token_ids([0, 9], vocab_size=10)
    for bad in ([10], [-1], [1, 2.0]):
        with pytest.raises(ValueError, match=r"prompt_token_ids .* \[0, 10\)"):
            check_token_ids(bad, vocab_size=10)


def test_chat_options_reach_the_template_and_are_checked() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert encode_chat(TOKENIZER, messages, options) == TOKENIZER.encode(
        "<user>hi<assistant>Sure", add_special_tokens=False
    )
    refused = [
        (ChatOptions(continue_final_message=True), messages, "add_generation_prompt"),
        (ChatOptions(False, True), messages[:1], "must be an assistant message"),
        (ChatOptions(template_kwargs={"messages": []}), messages, "chat_template_kwargs: messages"),
    ]
    for bad, conversation, message in refused:
        with pytest.raises(ValueError, match=message):
            encode_chat(TOKENIZER, conversation, bad)
