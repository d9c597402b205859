"""Stop strings on streamed text: find them across delta boundaries, hold back what might start one.

State kept between pushes: the last (longest stop - 1) characters received, which is all a stop
string straddling into the next delta can start in, and how many of them are still held back.

Invariant (include_stop_str_in_output=False): no emitted character can start a stop string. A
character is released only once the text from it on is neither a stop string nor a proper prefix
of one, and then no later text can make it one. So a stop, when found, starts in held or new
text, and truncating there never takes back anything already emitted. With
include_stop_str_in_output=True nothing is held: every character before a stop's end is output
anyway, and a stop found now always ends in the new delta.

When several stop strings match in one push, the one that ends first wins (ties: the one that
starts first), which is the one a character-by-character stream would have hit, so the result does
not depend on how the text was split into deltas.

A push with `match=False` (the sequence has not reached its min_tokens yet) looks for no stop
string but keeps the state: a stop that ends in such a push never matches, one that starts there
and ends in a later push does, as vLLM's detokenizer checks them only past min_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    text: str  # text that can be emitted now
    stop: str | None = None  # the stop string matched by this push, if one was


class StopChecker:
    """Feeds on text deltas; emits them minus stop strings and what might start one.

    >>> c = StopChecker(("</s>",), include_stop_str_in_output=False)
    >>> c.push("Hello</"), c.push("s> more")
    (StopResult(text='Hello', stop=None), StopResult(text='', stop='</s>'))
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._context_len = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""  # the last _context_len characters received
        self._held = 0  # how many characters at the end of _tail are not emitted yet
        self.stop: str | None = None  # set once a stop string matched; later pushes emit nothing

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def push(self, delta: str, *, match: bool = True) -> StopResult:
        """`delta`'s text that can be emitted now; `match=False`: no stop string may end here."""
        if self.stop is not None or not delta:
            return StopResult("")
        buf = self._tail + delta
        first_unsent = len(self._tail) - self._held
        found = earliest_stop(buf, self._stops, new_from=len(self._tail)) if match else None
        if found is not None:
            return self._stop_at(buf, first_unsent, *found)
        hold = 0 if self._include else held_suffix_len(buf, self._stops, self._context_len)
        end = max(first_unsent, len(buf) - hold)
        self._tail = buf[max(0, len(buf) - self._context_len) :]
        self._held = len(buf) - end
        return StopResult(buf[first_unsent:end])

    def finish(self) -> str:
        """Releases the held text (the sequence ended without a stop string)."""
        held = self._tail[len(self._tail) - self._held :] if self._held else ""
        self._held = 0
        return held

    def _stop_at(self, buf: str, first_unsent: int, start: int, stop: str) -> StopResult:
        end = start + len(stop) if self._include else max(start, first_unsent)
        self.stop = stop
        self._held = 0
        self._tail = ""
        return StopResult(buf[first_unsent:end], stop)


def earliest_stop(text: str, stops: Sequence[str], new_from: int = 0) -> tuple[int, str] | None:
    """(start, stop) of the first stop string to end in text[new_from:], or None.

    Only matches that end after `new_from` are looked for: the text before it was searched already.
    """
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])


def held_suffix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest suffix of `text` (at most max_len) that begins some stop string."""
    for k in range(min(max_len, len(text)), 0, -1):
        suffix = text[len(text) - k :]
        if any(s.startswith(suffix) for s in stops):
            return k
    return 0
