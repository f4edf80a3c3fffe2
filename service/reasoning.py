"""Reasoning parsers: the thinking of a thinking model, split from its answer.

Thinking models write their reasoning between tags before the answer: Qwen3 and SmolLM3
as `<think>...</think>` at the start of their output (the tag is their first token when
thinking is on; with `enable_thinking: false` the chat template writes an empty block into
the prompt instead), DeepSeek-R1 and its distills the same, but their chat templates open
the block in the prompt, so the output starts inside the thinking and only its end tag
appears. The server moves the thinking into the message's `reasoning_content` (and
`reasoning`) and keeps the answer as `content`, for whole responses and stream deltas
alike.

The split works on the text, not on token ids, so a tag the tokenizer splits over
several tokens (or that a stream delivers in pieces) is found the same way; a stream
holds back only a tail that may still grow into a tag. Whether the output starts inside
the thinking is read from the end of the rendered prompt, so a template that opens the
block there (or closes an empty one) is understood whatever the family.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many prompt tokens to decode to see whether the prompt leaves a thinking block open.
PROMPT_TAIL_TOKENS = 32


@dataclass(frozen=True)
class ReasoningParser:
    """One family's thinking format.

    starts_inside: whether the output starts inside the thinking unless the prompt closes
    the block (DeepSeek-R1: its template opens the block in the prompt, and older
    versions of it left the model to write the start tag, which is then skipped).
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False

    def thinking_at_start(self, prompt_tail: str) -> bool:
        """Whether the output starts inside a thinking block, given the prompt's last
        characters: an open start tag in the prompt means yes, a closed block no."""
        return self.prompt_state(prompt_tail) == "inside"

    def prompt_state(self, prompt_tail: str) -> str:
        """ "inside": the output starts inside a thinking block (the prompt opened it, or
        the family always starts there); "closed": the prompt ends with a closed block, so
        thinking is off; "outside": the output may open a block itself."""
        opened, closed = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if opened > closed:
            return "inside"
        if closed >= 0 and not prompt_tail[closed + len(self.end) :].strip():
            return "closed"  # the template wrote an empty block: thinking is off
        return "inside" if self.starts_inside else "outside"

    def stream(self, prompt_tail: str) -> ReasoningStream:
        """The parser of one output, fed its text piece by piece."""
        return ReasoningStream(self, self.thinking_at_start(prompt_tail))

    def split(self, text: str, prompt_tail: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; each None when empty (content is ""
        rather than None when there was no reasoning either)."""
        parser = self.stream(prompt_tail)
        reasoning, content = parser.feed(text)
        tail = parser.finish()
        reasoning, content = reasoning + tail[0], content + tail[1]
        if not reasoning:
            return None, content
        return reasoning, content or None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "smollm3": ReasoningParser("smollm3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        choices = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {choices}") from None


# Where a stream stands: before the first visible character (a start tag may still
# come), inside the thinking, or in the answer.
_BEFORE, _THINKING, _ANSWER = "before", "thinking", "answer"


class ReasoningStream:
    """Splits one output, streamed as text pieces, into reasoning and content pieces.

    Whitespace around the thinking (the newlines after the start tag, before the end tag
    and before the answer) belongs to neither. The concatenated pieces equal
    `ReasoningParser.split` of the whole text.
    """

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser = parser
        self.state = _THINKING if thinking else _BEFORE
        self.buffer = ""
        self.leading = True  # at the start of the thinking or answer: drop whitespace
        # A model whose template opened the block may still write the start tag first.
        self.repeat_start = thinking
        self.saw_thinking = thinking

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes; a possible tag prefix is held."""
        self.buffer += text
        reasoning, content = [], []
        while self.buffer:
            if self.state == _BEFORE:
                if not self._open_thinking():
                    break
            elif self.state == _THINKING:
                piece, done = self._thinking()
                reasoning.append(piece)
                if not done:
                    break
            else:
                if self.leading:
                    self.buffer = self.buffer.lstrip()
                    self.leading = not self.buffer
                content.append(self.buffer)
                self.buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the output."""
        rest, self.buffer = self.buffer, ""
        if self.state == _THINKING:
            return rest.strip() if self.leading else rest.rstrip(), ""
        if self.state == _ANSWER and self.leading:
            return "", rest.lstrip()
        return "", rest

    def _open_thinking(self) -> bool:
        """Before anything visible: a start tag opens the thinking, anything else
        starts the answer. False while the buffer may still become a start tag."""
        start = self.parser.start
        text = self.buffer.lstrip()
        if text.startswith(start):
            self.buffer = text[len(start) :]
            self.state, self.leading, self.saw_thinking = _THINKING, True, True
            return True
        if start.startswith(text):
            return False
        self.state, self.leading = _ANSWER, False  # the answer, exactly as written
        return True

    def _thinking(self) -> tuple[str, bool]:
        """(reasoning piece, whether the thinking ended): up to the end tag, less a tail
        that may still be whitespace before it or the start of it."""
        start, end = self.parser.start, self.parser.end
        if self.leading:
            self.buffer = self.buffer.lstrip()
            if self.repeat_start:
                if start.startswith(self.buffer):
                    return "", False  # may still be a repeated start tag
                if self.buffer.startswith(start):
                    self.buffer = self.buffer[len(start) :].lstrip()
                self.repeat_start = False
            if not self.buffer:
                return "", False
            self.leading = False
        cut = self.buffer.find(end)
        if cut >= 0:
            piece = self.buffer[:cut].rstrip()
            self.buffer = self.buffer[cut + len(end) :]
            self.state, self.leading = _ANSWER, True
            return piece, True
        keep = _tag_prefix_length(self.buffer, end)
        emit = len(self.buffer) - keep
        while emit > 0 and self.buffer[emit - 1].isspace():
            emit -= 1
        piece, self.buffer = self.buffer[:emit], self.buffer[emit:]
        return piece, False


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
