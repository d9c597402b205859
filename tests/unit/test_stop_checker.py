"""StopChecker against brute-force references, over every way of splitting text into deltas."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.postprocess.stop_checker import StopChecker, StopResult, held_suffix_len

pytestmark = pytest.mark.unit


def _reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """The output of a sequence with this text, checked one character at a time."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):  # same end: the one starting first
            if text[:end].endswith(s):
                return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def _releasable(received: str, stops: Sequence[str]) -> str:
    """Received text minus its longest suffix that could still begin a stop string."""
    for start in range(len(received) + 1):
        rest = received[start:]
        if not rest or any(s.startswith(rest) for s in stops):
            return received[:start]
    return received


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


small_text = st.text(alphabet="ab c", max_size=30)
stop_lists = st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(
    text=small_text,
    stops=stop_lists,
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_matches_character_by_character_reference(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    checker = StopChecker(tuple(stops), include)
    out: list[str] = []
    received = ""
    stop = None
    for delta in _split(text, cuts):
        received += delta
        result = checker.push(delta)
        out.append(result.text)
        if result.stop is not None:
            stop = result.stop
            break
        # Hold back exactly what could still begin a stop string, nothing more.
        expected_out = received if include else _releasable(received, stops)
        assert "".join(out) == expected_out
    if stop is None:
        out.append(checker.finish())
    assert ("".join(out), stop) == _reference(text, stops, include)
    assert checker.stop == stop


def test_stop_straddling_deltas() -> None:
    checker = StopChecker(("STOP",))
    assert checker.push("Hello S") == StopResult("Hello ")
    assert checker.push("T") == StopResult("")
    assert checker.push("OP and more") == StopResult("", "STOP")
    assert checker.stopped


def test_include_stop_str_in_output() -> None:
    checker = StopChecker(("STOP",), include_stop_str_in_output=True)
    # Nothing is held: the stop's beginning is output whether or not it completes.
    assert checker.push("Hello ST") == StopResult("Hello ST")
    assert checker.push("OP and more") == StopResult("OP", "STOP")


def test_earliest_match_wins() -> None:
    checker = StopChecker(("world", "lo w"))
    assert checker.push("hello world") == StopResult("hel", "lo w")
    # A stop that ends first wins over one that starts first but ends later.
    checker = StopChecker(("abcd", "c"))
    assert checker.push("xabcd") == StopResult("xab", "c")


def test_held_text_released_when_it_cannot_match() -> None:
    checker = StopChecker(("abc",))
    assert checker.push("xab") == StopResult("x")
    assert checker.push("d") == StopResult("abd")


def test_held_text_released_at_finish() -> None:
    checker = StopChecker(("</s>", "###"))
    assert checker.push("answer #") == StopResult("answer ")
    assert checker.push("#") == StopResult("")
    assert checker.finish() == "##"
    assert checker.finish() == ""
    assert not checker.stopped


def test_pushes_after_stop_emit_nothing() -> None:
    checker = StopChecker(("x",))
    assert checker.push("ax") == StopResult("a", "x")
    assert checker.push("more") == StopResult("")
    assert checker.finish() == ""
    assert checker.stop == "x"


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopChecker(("ok", ""))


def test_held_suffix_len() -> None:
    assert held_suffix_len("hello wor", ("world",), 4) == 3
    assert held_suffix_len("hello", ("world",), 4) == 0
    assert held_suffix_len("aaaa", ("aaab",), 3) == 3


def test_a_push_that_may_not_match_keeps_the_state_a_later_match_needs() -> None:
    # Before min_tokens (TextStream passes match=False): a stop that ends there is not one...
    c = StopChecker(("ab",))
    assert c.push("xab", match=False) == StopResult("xab")
    # ...but what might start one is still held, and a stop that ends later is found whole.
    assert c.push("a", match=False) == StopResult("")
    assert c.push("b!") == StopResult("", "ab")
    assert c.stopped
