"""Incremental detokenization: token ids arrive a few at a time, text leaves as soon as it is final.

vLLM's prefix_offset / read_offset algorithm, on ids:

    ids:  ... | prefix window | unread ids |
              ^prefix_offset  ^read_offset ^len(ids)

    prefix_text = decode(ids[prefix_offset:read_offset])   (cached)
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

Decoding a few tokens of context before the new ones keeps what a decoder decides from its
neighbours (the leading space of a '▁word' or 'Ġword' token, which Llama's Strip decoder drops
at the start of a text) identical to a full decode. When new_text ends in U+FFFD, the last token
is probably part of a multi-byte character whose other bytes are still to come, so nothing is
emitted and the same window is decoded again next time. Once text is emitted the window slides:
prefix_offset takes read_offset's place, so each call decodes only a handful of tokens.

Invariant: the emitted pieces concatenate to decode(output) (byte-level BPE, empty prompt) or to
what the output adds to decode(prompt) (SentencePiece-style), for text made of whole characters.
A prompt that itself ends in the middle of a character is not handled (vLLM does not either).
The first window reaches back to the start of a character in the prompt (vLLM v1 does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as context for the first output tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), and how far back the window may start instead when
# that would cut a character: a window that starts inside one decodes to U+FFFD, and with
# ByteFallback turns the whole run of byte tokens it starts in (up to the new ones) into U+FFFDs.
PROMPT_CONTEXT_TOKENS = 5
MAX_PROMPT_CONTEXT_TOKENS = 24
# Consecutive calls a trailing U+FFFD may hold text back. A character is at most 4 bytes, so an
# unfinished one is finished within a few tokens; a longer run means the model produced a real
# U+FFFD (or invalid bytes), and holding on would only grow the window decoded each call.
MAX_HELD_CALLS = 64
_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (tokenizers.Tokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextBuffer:
    """Text appended piece by piece and read now and then: joined only when read, so a long
    generation costs O(n) instead of O(n^2) string concatenation."""

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def append(self, piece: str) -> None:
        self._pieces.append(piece)

    @property
    def value(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class IncrementalDetokenizer:
    """Turns one sequence's output ids into text deltas.

    With a GPT-2 style tokenizer and prompt "The sky": add_tokens([id of "Ġis"]) returns " is";
    add_tokens([id of "Ġ"]) returns " "; add_tokens([byte token \xe4]) returns "" (a third
    of "中"); add_tokens([\xb8, \xad]) returns "中"; flush() at the end returns "".
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the window is kept: ids before prefix_offset are dropped as it slides.
        self._ids = self._prompt_window(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._held_calls = 0
        self._text = TextBuffer()

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text.value

    def add_tokens(self, ids: Sequence[int]) -> str:
        """Appends output ids; returns the text they finalize (possibly "")."""
        if not ids:
            return ""
        self._ids.extend(ids)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text):
            # Only skipped special tokens or empty pieces so far.
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and self._held_calls < MAX_HELD_CALLS:
            self._held_calls += 1
            return ""
        return self._advance(new_text)

    def flush(self) -> str:
        """Emits what is still held (the sequence ended); an unfinished character stays U+FFFD."""
        if len(self._ids) == self._read_offset:
            return ""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._advance(new_text)

    def _advance(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # The ids just read become the next call's context window.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(0, self._read_offset)
        self._held_calls = 0
        self._text.append(delta)
        return delta

    def _prompt_window(self, prompt: Sequence[int]) -> list[int]:
        """The shortest prompt suffix of >= PROMPT_CONTEXT_TOKENS ids that starts a character."""
        longest = min(len(prompt), MAX_PROMPT_CONTEXT_TOKENS)
        for n in range(min(PROMPT_CONTEXT_TOKENS, longest), longest + 1):
            window = list(prompt[len(prompt) - n :])
            text = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
            if not text.startswith(_REPLACEMENT_CHAR):
                return window
        return list(prompt[len(prompt) - min(PROMPT_CONTEXT_TOKENS, len(prompt)) :])

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )
