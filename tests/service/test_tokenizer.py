"""The tokenizer read straight from tokenizer.json gives transformers' ids and text.

Each checkpoint here is loaded both ways, ours (`load_tokenizer`) and transformers'
(`PreTrainedTokenizerFast.from_pretrained`, what the server used before), and every
prompt of the benchmark's real chat workloads must render and encode to the same ids.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from pagedinfer.service.prompts import encode_chat
from pagedinfer.service.tokenizer import Tokenizer, load_tokenizer

WORKLOADS = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads"
CHATS = [
    p["messages"]
    for name in ("chat_prompts.json", "extraction_prompts.json")
    for p in json.loads((WORKLOADS / name).read_text())["prompts"]
]
TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ttabs\tand a trailing newline\n",
    "Ünïcödé: naïve café, 東京タワー, Привет мир, 🤖🚀 emoji 👩‍👩‍👧",
    "code:\n    def f(x):\n        return x ** 2  # squared\n",
    "numbers 3.14159 and 1,000,000 and 2026-12-04",
    "a special token <|im_end|> inside text, and <s> and </s> too",
    "",
]
# A Llama-2 style template that uses what transformers gives templates: the special
# tokens, namespace, loop controls, tojson, raise_exception and the generation tag.
LLAMA_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
    {% if m['role'] == 'user' %}
[INST] {% if ns.system %}<<SYS>>{{ ns.system }}<</SYS>> {% endif %}{{ m['content'] | trim }} [/INST]
    {% else %}
        {% generation %}
 {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] | trim }} {{ eos_token }}
        {% endgeneration %}
    {% endif %}
{% endfor %}
{% if tools %} TOOLS {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %} {% endif %}"""


def edited_copy(source: Path, path: Path, name: str, fields: dict[str, Any]) -> Path:
    """A copy of `source`'s tokenizer files with `fields` set in its JSON file `name`."""
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((path / name).read_text())
    (path / name).write_text(json.dumps({**data, **fields}))
    return path


def transformers_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def save_checkpoint(path: Path, backend: BackendTokenizer, template: str, **special: str) -> Path:
    """A tokenizer directory as transformers writes it."""
    from transformers import PreTrainedTokenizerFast

    path.mkdir()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, **special
    ).save_pretrained(path)
    return path


def sentencepiece_style(tmp_path: Path) -> Path:
    """A Llama-2 style BPE: '▁' for spaces, byte fallback, a bos post-processor."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials + byte_tokens)
    corpus = [m["content"] for chat in CHATS for m in chat] + TEXTS
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return save_checkpoint(
        tmp_path / "sentencepiece-style",
        backend,
        LLAMA_TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> list[Path]:
    tmp = tmp_path_factory.mktemp("tokenizers")
    return [default_model_dir, sentencepiece_style(tmp)]


def test_both_checkpoints_load_without_transformers(checkpoints: list[Path]) -> None:
    for path in checkpoints:
        assert isinstance(load_tokenizer(path), Tokenizer), path


def test_every_real_chat_prompt_renders_to_transformers_ids(checkpoints: list[Path]) -> None:
    for path in checkpoints:
        ours, theirs = load_tokenizer(path), transformers_tokenizer(path)
        for messages in CHATS:
            want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert (
                ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                == want
            )
            assert encode_chat(ours, messages) == encode_chat(theirs, messages), messages


def test_multi_turn_chats_with_tools_and_reasoning_render_alike(checkpoints: list[Path]) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "<é>"}}}]
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello.", "reasoning": "greet back", "name": None},
        {"role": "user", "content": "Weather in Zürich?"},
    ]
    for path in checkpoints:
        ours, theirs = load_tokenizer(path), transformers_tokenizer(path)
        for kwargs in ({"add_generation_prompt": True}, {"tools": tools}):
            want = theirs.apply_chat_template(chat, tokenize=False, **kwargs)
            assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == want
            ids = theirs.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
            assert ours.apply_chat_template(chat, tokenize=True, **kwargs) == ids


def test_encode_and_decode_equal_transformers(checkpoints: list[Path]) -> None:
    rng = random.Random(0)
    for path in checkpoints:
        ours, theirs = load_tokenizer(path), transformers_tokenizer(path)
        assert ours.special_tokens_map == theirs.special_tokens_map
        assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
        assert len(ours) == len(theirs)
        texts = TEXTS + [m["content"] for chat in CHATS[:20] for m in chat]
        for text in texts:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == theirs.encode(text, add_special_tokens=special), text
                for skip in (True, False):
                    got = ours.decode(ids, skip_special_tokens=skip)
                    assert got == theirs.decode(ids, skip_special_tokens=skip), ids
        # Any ids, special ones and cut UTF-8 sequences included.
        for _ in range(200):
            ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 12))]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )


def test_a_template_that_raises_is_a_value_error_naming_it(checkpoints: list[Path]) -> None:
    ours = load_tokenizer(checkpoints[1])
    with pytest.raises(ValueError, match=r"chat template.*unknown role tool"):
        encode_chat(ours, [{"role": "tool", "content": "42"}])


def test_templates_cannot_reach_internals(checkpoints: list[Path]) -> None:
    import jinja2

    ours = load_tokenizer(checkpoints[0])
    for template in (
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ messages.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
    ):
        ours.chat_template, ours._template = template, None
        with pytest.raises(jinja2.exceptions.SecurityError):
            ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_what_transformers_would_change_loads_through_transformers(
    tmp_path: Path, default_model_dir: Path
) -> None:
    def copy(name: str) -> Path:
        path = tmp_path / name
        shutil.copytree(default_model_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
        return path

    only_in_config = copy("token-only-in-config")
    config = json.loads((only_in_config / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<|not-in-the-vocabulary|>"]
    (only_in_config / "tokenizer_config.json").write_text(json.dumps(config))

    mistral = copy("mistral")
    model = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**model, "model_type": "mistral"}))

    for path in (only_in_config, mistral):
        tokenizer = load_tokenizer(path)
        assert not isinstance(tokenizer, Tokenizer), path
        assert type(tokenizer).__module__.startswith("transformers"), path
    # Transformers really does change it: the config's extra token becomes one id.
    assert len(load_tokenizer(only_in_config).encode("<|not-in-the-vocabulary|>")) == 1


def test_a_config_with_flags_named_like_tokens_loads_without_transformers(
    tmp_path: Path, default_model_dir: Path
) -> None:
    flags = {"add_bos_token": False, "add_eos_token": False, "legacy_token": None}
    path = edited_copy(default_model_dir, tmp_path / "flags", "tokenizer_config.json", flags)
    ours, theirs = load_tokenizer(path), transformers_tokenizer(path)
    assert isinstance(ours, Tokenizer)
    for special in (True, False):
        assert ours.encode(TEXTS[2], special) == theirs.encode(TEXTS[2], add_special_tokens=special)
    assert encode_chat(ours, CHATS[0]) == encode_chat(theirs, CHATS[0])


def test_a_file_that_truncates_or_pads_encodes_in_full(
    tmp_path: Path, default_model_dir: Path
) -> None:
    data: dict[str, Any] = {}
    data["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    data["padding"] = {
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 2, "pad_type_id": 0, "pad_token": "<|im_end|>",
    }  # fmt: skip
    path = edited_copy(default_model_dir, tmp_path / "truncating", "tokenizer.json", data)
    text = "one two three four five six seven eight nine"
    ours = load_tokenizer(path)
    assert isinstance(ours, Tokenizer)
    assert len(ours.encode(text)) == 9
    assert ours.encode(text) == transformers_tokenizer(path).encode(text)


def test_a_server_start_does_not_import_transformers(default_model_dir: Path) -> None:
    script = (
        "import sys\n"
        "from pagedinfer.service.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(default_model_dir)!r})\n"
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "print(type(t).__name__, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["Tokenizer", "False"]


def test_a_continued_final_message_renders_as_transformers_renders_it(
    checkpoints: list[Path],
) -> None:
    chat = [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "  Autumn moonlight - "},
    ]
    for path in checkpoints:
        ours, theirs = load_tokenizer(path), transformers_tokenizer(path)
        options = {"add_generation_prompt": False, "continue_final_message": True}
        want = theirs.apply_chat_template(chat, tokenize=False, **options)
        assert ours.apply_chat_template(chat, tokenize=False, **options) == want
        assert want.endswith("Autumn moonlight - "), want[-40:]
