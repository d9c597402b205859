"""Reasoning ("thinking") text in a model's output: deepseek_r1 and qwen3.

Both models think between `<think>` and `</think>`, then answer. The parser splits the output into
`reasoning` (sent as `message.reasoning`) and `content` (what tool calls and JSON are parsed
from), whole (`split`) or as it streams (`stream`). Each part is stripped; an empty part is None.

    <think>
    The user wants a greeting.
    </think>

    Hello!

splits into reasoning "The user wants a greeting." and content "Hello!" with either parser. They
differ when the output does not start with `<think>` (a chat template may have put it in the
prompt, and so the model does not write it):

    output                         deepseek_r1                  qwen3
    "<think>R</think>C"            reasoning R, content C      reasoning R, content C
    "R</think>C"                   reasoning R, content C      reasoning R, content C
    "<think>R" (still thinking)    reasoning R                 reasoning R
    "C"                            reasoning C                 content C

deepseek_r1 reads everything before the first `</think>` as reasoning: R1's template ends the
prompt with `<think>`, so an output without `</think>` is a model that is still thinking (vLLM's
rule). qwen3 reads reasoning only when the output starts with `<think>` or contains `</think>`:
Qwen3 answers without thinking when thinking is off. For a template that puts `<think>` in the
prompt (Qwen3 "Thinking-2507", QwQ), deepseek_r1 is the parser that streams it right.

Streaming sends each piece as soon as it is known, holding back only a tail that could begin the
marker being looked for (`</thi` is held, `</thin.` released) and whitespace, held until
non-whitespace follows (so the pieces join to `split`'s stripped parts). The stream's parts equal
`split`'s for every way of cutting the text, with one exception: qwen3 on an output that does
not start with `<think>` streams as content what precedes a `</think>` that comes later (it
cannot know yet), and does not take it back; `split` calls it reasoning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from inferd.postprocess.stop_checker import held_suffix_len
from inferd.postprocess.text_stream import StrippedText


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None when there was none
    content: str | None  # None when empty


class ReasoningStream(ABC):
    """One choice's incremental split. Feed it the model's text in pieces of any size."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of output; returns (reasoning piece, content piece) to send now."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """End of output: flushes what was held back."""

    @property
    @abstractmethod
    def reasoning_ended(self) -> bool:
        """True once the end marker has been seen (the content phase)."""


class ReasoningParser(ABC):
    """`<think>reasoning</think>content`; subclasses say what text before `</think>` is."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether an output that does not start with `start` is reasoning until `end` (True), or
    # content unless an `end` comes (False).
    implicit_start: ClassVar[bool]

    def split(self, text: str) -> ReasoningSplit:
        """Reasoning and content of a whole output."""
        lead = text.lstrip()
        started = lead.startswith(self.start)
        body = lead[len(self.start) :] if started else text
        reasoning, found, content = body.partition(self.end)
        if found:
            return ReasoningSplit(reasoning.strip() or None, content.strip() or None)
        if started or self.implicit_start:
            return ReasoningSplit(body.strip() or None, None)
        return ReasoningSplit(None, text.strip() or None)

    def stream(self) -> ReasoningStream:
        """A fresh incremental split, one per choice."""
        return _ThinkStream(self.start, self.end, self.implicit_start)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek R1 (and its distills): reasoning up to the first `</think>`; a leading `<think>`
    is dropped; without `</think>` the whole output is reasoning and content is None."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only in an output that starts with `<think>` or contains `</think>`;
    anything else (thinking off: `enable_thinking=False`) is all content."""

    name = "qwen3"
    implicit_start = False


_Phase = Literal["head", "reasoning", "unmarked", "content"]


class _ThinkStream(ReasoningStream):
    """Phases: "head" (waiting to see whether the output starts with `start`), "reasoning"
    (before `end`), "unmarked" (before `end` in an output without `start` when that is content:
    qwen3), "content" (after `end`).

    `_buf` is the text received and not sent: the head, or a tail that may begin `end`."""

    def __init__(self, start: str, end: str, implicit_start: bool) -> None:
        self._start = start
        self._end = end
        self._implicit_start = implicit_start
        self._phase: _Phase = "head"
        self._buf = ""
        self._reasoning = StrippedText()
        self._content = StrippedText()

    @property
    def reasoning_ended(self) -> bool:
        return self._phase == "content"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        if self._phase == "head":
            self._decide_start()
        if self._phase in ("reasoning", "unmarked"):
            return self._until_end()
        if self._phase == "content":
            return "", self._take(self._content, len(self._buf))
        return "", ""

    def finish(self) -> tuple[str, str]:
        if self._phase == "head":  # whitespace, or part of `start` that never completed
            self._phase = "reasoning" if self._implicit_start else "unmarked"
        everything = len(self._buf)
        if self._phase == "reasoning":
            return self._take(self._reasoning, everything), ""
        return "", self._take(self._content, everything)

    def _decide_start(self) -> None:
        lead = self._buf.lstrip()
        if len(lead) < len(self._start) and self._start.startswith(lead):
            return  # nothing yet, or part of `start`: wait
        if lead.startswith(self._start):
            self._buf = lead[len(self._start) :]
            self._phase = "reasoning"
        else:
            self._phase = "reasoning" if self._implicit_start else "unmarked"

    def _until_end(self) -> tuple[str, str]:
        """Sends the text before `end` in the phase's channel, then what follows it as content;
        without `end`, all but a tail that may begin it."""
        channel = self._reasoning if self._phase == "reasoning" else self._content
        at = self._buf.find(self._end)
        if at < 0:
            keep = held_suffix_len(self._buf, (self._end,), len(self._end) - 1)
            before = self._take(channel, len(self._buf) - keep)
            return (before, "") if channel is self._reasoning else ("", before)
        before = self._take(channel, at)
        self._buf = self._buf[len(self._end) :]
        self._phase = "content"
        after = self._take(self._content, len(self._buf))
        return (before, after) if channel is self._reasoning else ("", before + after)

    def _take(self, channel: StrippedText, n: int) -> str:
        """Sends the first n characters of `_buf` through `channel`."""
        sent, self._buf = channel.push(self._buf[:n]), self._buf[n:]
        return sent


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name` (vLLM's `--reasoning-parser` names)."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
