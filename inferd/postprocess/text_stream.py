"""One output sequence's text: incremental detokenization followed by stop-string checking.

The engine's output processor keeps one TextStream per sequence and, each step, pushes the ids
sampled for it; when the sequence ends for another reason (EOS, length, abort) it calls finish()
to release the text still held back.

StrippedText is the small piece the tool-call and reasoning parsers stream their content through,
so the pieces they send join to the whole text, stripped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.postprocess.detokenizer import IncrementalDetokenizer, TextBuffer, TokenDecoder
from inferd.postprocess.stop_checker import StopChecker


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to hand out
    stop: str | None = None  # the stop string that ended the sequence in this push, if any


class TextStream:
    """ids in, text deltas out; `.text` is everything handed out so far.

    Stop strings are looked for once the sequence has more than `min_tokens` tokens (vLLM's rule:
    min_tokens holds back stop strings as it does EOS and stop_token_ids), so one that ends within
    the first min_tokens tokens' text does not stop it. After a stop string matched, the sequence
    is over: later pushes and finish() return nothing.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._checker = StopChecker(stop, include_stop_str_in_output) if stop else None
        self._text = TextBuffer()
        self._min_tokens = min_tokens
        self._num_tokens = 0

    @property
    def text(self) -> str:
        return self._text.value

    @property
    def stop(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return None if self._checker is None else self._checker.stop

    def push(self, ids: Sequence[int]) -> TextDelta:
        if self.stop is not None:
            return TextDelta("")
        self._num_tokens += len(ids)
        return self._check(self._detokenizer.add_tokens(ids))

    def finish(self) -> str:
        """Flushes held text. The flushed text can still contain a stop string: see `.stop`."""
        if self.stop is not None:
            return ""
        delta = self._check(self._detokenizer.flush())
        if self._checker is None or delta.stop is not None:
            return delta.text
        held = self._checker.finish()
        self._append(held)
        return delta.text + held

    def _check(self, text: str) -> TextDelta:
        if self._checker is None:
            self._append(text)
            return TextDelta(text)
        result = self._checker.push(text, match=self._num_tokens > self._min_tokens)
        self._append(result.text)
        return TextDelta(result.text, result.stop)

    def _append(self, text: str) -> None:
        if text:
            self._text.append(text)


class StrippedText:
    """Sends a text piece by piece so that the pieces join to `whole_text.strip()`.

    Leading whitespace is dropped; trailing whitespace is held until non-whitespace follows, and
    dropped if none does. Content and reasoning streams send through one of these each.

    >>> s = StrippedText()
    >>> [s.push(p) for p in ("\\n Hi", " ", "\\n", "there ", " ")]
    ['Hi', '', '', ' \\nthere', '']
    """

    def __init__(self) -> None:
        self._started = False  # some non-whitespace was sent
        self._held = ""  # whitespace received after the last non-whitespace sent

    def push(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            if self._started:
                self._held += text
            return ""
        sent = self._held + body if self._started else body.lstrip()
        self._started = True
        self._held = text[len(body) :]
        return sent
