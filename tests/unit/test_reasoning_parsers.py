"""Reasoning parsers (deepseek_r1, qwen3): whole outputs, and streams cut every way."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.postprocess.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningSplit,
    get_reasoning_parser,
)

pytestmark = pytest.mark.unit

R1 = DeepSeekR1ReasoningParser()
QWEN3 = Qwen3ReasoningParser()


def _split(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _stream(parser: ReasoningParser, pieces: Iterable[str]) -> ReasoningSplit:
    """The stream's pieces joined, as split() reports them (an empty part is None)."""
    s = parser.stream()
    sent = [*(s.feed(p) for p in pieces), s.finish()]
    reasoning = "".join(r for r, _ in sent)
    content = "".join(c for _, c in sent)
    return ReasoningSplit(reasoning or None, content or None)


def _agree(parser: ReasoningParser, text: str) -> ReasoningSplit:
    """split(text), after checking that streaming it whole and one character at a time agree."""
    expected = parser.split(text)
    assert _stream(parser, [text]) == expected
    assert _stream(parser, text) == expected
    return expected


@pytest.mark.parametrize(
    ("text", "r1", "qwen3"),
    [
        ("<think>\nR\n</think>\n\nC", ("R", "C"), ("R", "C")),
        ("R</think>C", ("R", "C"), ("R", "C")),  # the template put <think> in the prompt
        ("<think>R", ("R", None), ("R", None)),  # still thinking when the output ended
        ("C", ("C", None), (None, "C")),  # qwen3 with thinking off
        ("  <think>R1\n\nR2</think>C1\n\nC2\n", ("R1\n\nR2", "C1\n\nC2"), ("R1\n\nR2", "C1\n\nC2")),
        ("<think></think>C", (None, "C"), (None, "C")),
        ("<think>\n\n</think>\n\n", (None, None), (None, None)),
        ("", (None, None), (None, None)),
        (
            "<think>a<think>b</think>c</think>d",
            ("a<think>b", "c</think>d"),
            ("a<think>b", "c</think>d"),
        ),
        ("x<think>R</think>C", ("x<think>R", "C"), ("x<think>R", "C")),  # not a leading <think>
        ("<thinker>C", ("<thinker>C", None), (None, "<thinker>C")),
    ],
)
def test_split(text: str, r1: tuple[str | None, ...], qwen3: tuple[str | None, ...]) -> None:
    assert R1.split(text) == ReasoningSplit(*r1)
    assert QWEN3.split(text) == ReasoningSplit(*qwen3)


@pytest.mark.parametrize(
    "text",
    ["<think>\nThe user wants ü 中.\n</think>\n\nHallo!", "<think>R", "<thi", "  ", "a</think>"],
)
def test_deepseek_r1_streams_what_it_splits(text: str) -> None:
    _agree(R1, text)


@pytest.mark.parametrize("text", ["<think>\nR\n</think>\n\nC", "<think>R", "<thi", "C", ""])
def test_qwen3_streams_what_it_splits(text: str) -> None:
    _agree(QWEN3, text)


def test_qwen3_without_think_streams_the_text_before_end_as_content() -> None:
    # The documented exception: the stream cannot know yet, and does not take it back.
    assert QWEN3.split("R</think>C") == ReasoningSplit("R", "C")
    assert _stream(QWEN3, "R</think>C") == ReasoningSplit(None, "RC")


def test_holds_back_a_partial_end_marker_and_no_more() -> None:
    s = R1.stream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\nLet me see </thi") == ("Let me see", "")
    assert s.feed("n.") == (" </thin.", "")
    assert not s.reasoning_ended
    assert s.feed(" Done.</th") == (" Done.", "")
    assert s.feed("ink>\n\nHel") == ("", "Hel")
    assert s.reasoning_ended
    assert s.feed("lo </think> ") == ("", "lo </think>")  # later markers are content
    assert s.finish() == ("", "")


def test_reasoning_ended() -> None:
    r1, qwen3 = R1.stream(), QWEN3.stream()
    for s in (r1, qwen3):
        assert not s.reasoning_ended
        assert s.feed("abc") in (("abc", ""), ("", "abc"))
        assert not s.reasoning_ended
        s.feed("</think>")
        assert s.reasoning_ended
    assert r1.feed("C") == ("", "C") and qwen3.feed("C") == ("", "C")


def test_finish_flushes_held_text_into_its_phase() -> None:
    r1 = R1.stream()
    assert r1.feed("<think>R </thi") == ("R", "")
    assert r1.finish() == (" </thi", "")
    qwen3 = QWEN3.stream()
    assert qwen3.feed(" <th") == ("", "")
    assert qwen3.finish() == ("", "<th")


def test_get_reasoning_parser() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name, cls in REASONING_PARSERS.items():
        parser = get_reasoning_parser(name)
        assert isinstance(parser, cls) and parser.name == name
        assert (parser.start, parser.end) == ("<think>", "</think>")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


# --- properties: any text, cut any way ----------------------------------------------------------

pieces = st.sampled_from(
    ["<think>", "</think>", "<th", "</th", "<", "/", ">", "think", " ", "\n", "a", "ü", "中"]
)
cuts = st.lists(st.integers(0, 80), max_size=10)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(pieces, max_size=16), cut=cuts)
def test_deepseek_r1_any_split(parts: list[str], cut: list[int]) -> None:
    text = "".join(parts)
    assert _stream(R1, _split(text, cut)) == R1.split(text)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(pieces, max_size=16), cut=cuts, thinking=st.booleans())
def test_qwen3_any_split(parts: list[str], cut: list[int], thinking: bool) -> None:
    """Where the stream can know: the output starts with <think>, or has no </think>."""
    text = "".join(parts)
    if thinking:
        text = "<think>" + text
    else:
        while "</think>" in text:  # removing one can join the pieces around it into another
            text = text.replace("</think>", "")
    assert _stream(QWEN3, _split(text, cut)) == QWEN3.split(text)
