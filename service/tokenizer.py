"""A checkpoint's tokenizer and chat template, read straight from `tokenizer.json`.

transformers takes about a second to import, most of a warm start's tokenizer cost, and
the server needs only four things from it: encode, decode, the chat template and the
special tokens. `Tokenizer` gives exactly those over the `tokenizers` library and a
sandboxed jinja2 environment set up as transformers sets up its own (the same filters,
globals and block trimming), so the ids equal transformers' for every prompt.

`load_tokenizer` takes this path only where transformers would add nothing to the file:
every token the config names is already a special token of `tokenizer.json`, and there
is one chat template. Anything else (a legacy vocabulary,
tokens only the config knows, named templates) loads through transformers, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning arrives under; templates read the first, gpt-oss's "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encode, decode and the chat template of one checkpoint, without transformers.

    backend: the `tokenizers` tokenizer of `tokenizer.json`. special_tokens: the named
    special tokens (`NAMED_SPECIAL_TOKENS` keys) as strings. chat_template: the jinja
    source, or None when the checkpoint has none.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
    ) -> None:
        # transformers turns a file's truncation and padding off unless a call asks for them.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        for name in NAMED_SPECIAL_TOKENS:
            setattr(self, name, special_tokens.get(name))
            setattr(self, f"{name}_id", self.convert_tokens_to_ids(special_tokens.get(name)))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str] | None) -> Any:
        """The id of a token (None if it is not in the vocabulary), or a list of them."""
        if tokens is None or isinstance(tokens, str):
            return None if tokens is None else self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template: its text, or (tokenize) its
        ids, encoded without added special tokens as the template writes its own.
        continue_final_message: the text ends right after the last message's content,
        with no end-of-turn after it, so that the model goes on writing it."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        if not conversation:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        messages = [
            {k: v for k, v in _plain(message).items() if v is not None} for message in conversation
        ]
        rendered = self._template.render(
            messages=_alias_reasoning(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens_map, **template_kwargs}),
        )
        if continue_final_message:
            rendered = _open_final_message(rendered, messages[-1].get("content"))
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer: a `Tokenizer` where `tokenizer.json` alone defines it,
    else transformers' (its fast tokenizer from `tokenizer.json`, else AutoTokenizer)."""
    path = Path(path)
    try:
        tokenizer = _read_plain_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
        if (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: no usable tokenizer ({err})") from err


def _read_plain_tokenizer(path: Path) -> Tokenizer | None:
    """A `Tokenizer` for `path`, or None (with the reason logged) where transformers would
    change what `tokenizer.json` defines."""
    file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
    if not (file.is_file() and config_file.is_file()):
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    named = _named_tokens(path, config)
    reason = _needs_transformers(path, config)
    backend = None
    if reason is None:
        backend = BackendTokenizer.from_file(str(file))
        reason = _backend_differs(backend, config, named)
    if reason is not None:
        logger.debug("tokenizer of %s loads through transformers: %s", path, reason)
        return None
    template_file = path / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else config.get("chat_template")
    )
    return Tokenizer(backend, named, template)


def _needs_transformers(path: Path, config: Mapping[str, Any]) -> str | None:
    """Why the files alone do not define the tokenizer as transformers loads it, or None."""
    if (path / "added_tokens.json").is_file():
        return "a legacy added_tokens.json"
    if (path / "chat_templates").is_dir() or not isinstance(config.get("chat_template", ""), str):
        return "named chat templates"
    if config.get("split_special_tokens"):
        return "split_special_tokens"
    model_type = _model_type(path)
    if model_type is not None and "mistral" in model_type:
        return "transformers patches Mistral tokenizers' pre-tokenizer"
    return None


def _backend_differs(
    backend: BackendTokenizer, config: Mapping[str, Any], named: Mapping[str, str]
) -> str | None:
    """Why transformers would change `backend` at load, or None."""
    if backend.post_processor is None and (
        config.get("add_bos_token") or config.get("add_eos_token")
    ):
        return "the config adds bos/eos tokens"
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE vocabulary"
    added = backend.get_added_tokens_decoder()
    special = {t.content for t in added.values() if t.special}
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(int(index))
        if have is None or have.content != token.get("content"):
            return f"added token {index} is only in the config"
        if bool(have.special) != bool(token.get("special", False)):
            return f"added token {index} differs in the config"
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = extra.values() if isinstance(extra, Mapping) else extra
    model_specific = [  # e.g. an image_token; not flags such as add_bos_token
        v
        for k, v in config.items()
        if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS and _is_token(v)
    ]
    for token in [*named.values(), *extra, *model_specific]:
        if _content(token) not in special:
            return f"{_content(token)!r} is not a special token of tokenizer.json"
    return None


def _named_tokens(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens as transformers reads them: the config's, overridden by a
    legacy special_tokens_map.json where the config lists no added tokens."""
    tokens = {k: config[k] for k in NAMED_SPECIAL_TOKENS if config.get(k) is not None}
    legacy = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        saved = json.loads(legacy.read_text(encoding="utf-8"))
        tokens.update({k: v for k, v in saved.items() if k in NAMED_SPECIAL_TOKENS and v})
    return {k: _content(v) for k, v in tokens.items()}


def _is_token(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and "content" in value)


def _content(token: Any) -> str:
    return token.get("content", "") if isinstance(token, Mapping) else str(token)


def _model_type(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8")).get("model_type")


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it: an immutable sandbox with
    blocks trimmed, loop controls, the `{% generation %}` tag, `tojson` without HTML
    escaping, and the helpers templates call (`raise_exception`, `strftime_now`)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part of a template
    for training masks; serving renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the model's prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """`dict(...)` for templates, without the class itself (and its attributes) exposed."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so a template never sees a caller's objects
    (their methods are outside what the sandbox knows to block)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _open_final_message(rendered: str, content: Any) -> str:
    """`rendered` cut right after the last message's content (as transformers cuts it):
    whatever the template wrote after it (an end of turn) is dropped."""
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    text = content if isinstance(content, str) else ""
    stripped = text.strip()
    at = rendered.rfind(stripped) if stripped else -1
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "content, so it cannot be continued"
        )
    kept = text.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]
    return rendered[: at + len(stripped)]


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose reasoning came under an older name carry it under every name."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
