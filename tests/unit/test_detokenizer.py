"""IncrementalDetokenizer and TextStream against full decodes, on two tokenizers built here.

Both are trained on generated ASCII text, so any other character is split into bytes: byte-level
BPE (GPT-2 style) spells bytes with its byte alphabet, the SentencePiece-style BPE (Llama-2's
tokenizer.json decoders) falls back to <0xXX> tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inferd.postprocess.detokenizer import (
    MAX_HELD_CALLS,
    MAX_PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from inferd.postprocess.text_stream import TextStream

pytestmark = pytest.mark.unit

_WORDS = "the an ing er qu ick br own fox jump s ed over lazy dog a b c 1 2 3"
_SYLLABLES = [*_WORDS.split(" "), ".", ",", "!", "?", "-", "(", ")", ":", ";", "'", '"', "\n", "\t"]


def _corpus(n: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(3, 12))
        ]
        lines.append(" ".join(words))
    return lines


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _sentencepiece() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    # Llama-2 keeps <0x00>..<0xFF> as ordinary vocabulary entries (not special tokens, which
    # skip_special_tokens would drop) and decodes with Replace + ByteFallback + Fuse + Strip.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = base + b
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


BYTE_LEVEL = _byte_level()
SENTENCEPIECE = _sentencepiece()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "sentencepiece": SENTENCEPIECE}

# Pieces that split into bytes across tokens: CJK, emoji (4 bytes), ZWJ sequences, flags,
# skin-tone modifiers, combining marks, and a real U+FFFD.
_PIECES = [
    "the",
    " quick",
    " fox",
    " ",
    "  ",
    "\n",
    "é",
    "e\u0301",
    "a\u0308\u0323",
    "中文",
    "日本語",
    "한국어",
    "😀",
    "👨\u200d👩\u200d👧\u200d👦",
    "👍🏽",
    "🇯🇵",
    "\u0915\u094d\u0937",
    "\ufffd",
    "ñ",
    "!",
]
texts = st.one_of(
    st.lists(st.sampled_from(_PIECES), min_size=1, max_size=25).map("".join),
    st.text(min_size=1, max_size=40),
)


def _groups(ids: Sequence[int], rng: random.Random, max_size: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_size)
        out.append(list(ids[i : i + n]))
        i += n
    return out


def _stream(detok: IncrementalDetokenizer, groups: list[list[int]]) -> list[str]:
    pieces = [detok.add_tokens(g) for g in groups]
    pieces.append(detok.flush())
    return pieces


def _check_stream(
    tok: Tokenizer, prompt: list[int], output: list[int], expected: str, seed: int
) -> None:
    rng = random.Random(seed)
    for max_size in (1, 3, 8):
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = _stream(detok, _groups(output, rng, max_size))
        assert "".join(pieces) == expected
        assert detok.text == expected
        if "\ufffd" not in expected:
            # Text goes out only once its characters are whole.
            assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=150, deadline=None)
@given(text=texts, seed=st.integers(0, 2**16))
def test_byte_level_stream_equals_full_decode(text: str, seed: int) -> None:
    ids = BYTE_LEVEL.encode(text).ids
    assert BYTE_LEVEL.decode(ids) == text  # the tokenizer round-trips: decode is a fair reference
    _check_stream(BYTE_LEVEL, [], ids, text, seed)


@settings(max_examples=150, deadline=None)
@given(text=texts, seed=st.integers(0, 2**16))
def test_sentencepiece_stream_equals_full_decode(text: str, seed: int) -> None:
    ids = SENTENCEPIECE.encode(text).ids
    _check_stream(SENTENCEPIECE, [], ids, SENTENCEPIECE.decode(ids), seed)


def _clean_splits(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Split points where the prompt's decode is a whole-character prefix of the full decode."""
    full = tok.decode(ids)
    splits = []
    for k in range(1, len(ids)):
        head = tok.decode(ids[:k])
        if full.startswith(head) and not head.endswith("\ufffd"):
            splits.append(k)
    return splits


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=80, deadline=None)
@given(text=texts, data=st.data())
def test_output_adds_to_prompt_decode(name: str, text: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode("the quick " + text).ids
    k = data.draw(st.sampled_from(_clean_splits(tok, ids)))
    prompt, output = ids[:k], ids[k:]
    expected = tok.decode(ids)[len(tok.decode(prompt)) :]
    _check_stream(tok, prompt, output, expected, data.draw(st.integers(0, 2**16)))


def test_first_token_keeps_its_leading_space() -> None:
    for tok in TOKENIZERS.values():
        prompt = tok.encode("the quick").ids
        output = tok.encode("the quick fox").ids[len(prompt) :]
        detok = IncrementalDetokenizer(tok, prompt)
        assert detok.add_tokens(output[:1]).startswith(" ")


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(name: str, skip: bool) -> None:
    tok = TOKENIZERS[name]
    special = tok.token_to_id("<|endoftext|>" if name == "byte_level" else "</s>")
    assert special is not None
    prompt = tok.encode("the fox").ids
    output = [*tok.encode(" jumped 中").ids, special, *tok.encode(" over 😀 dog").ids, special]
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    expected = full[len(tok.decode(prompt, skip_special_tokens=skip)) :]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert "".join(_stream(detok, [[t] for t in output])) == expected


def test_output_cut_inside_a_character_is_flushed_as_replacement() -> None:
    ids = BYTE_LEVEL.encode("ab 中文😀").ids[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(BYTE_LEVEL, [])
    pieces = [detok.add_tokens([t]) for t in ids]
    assert "".join(pieces) == "ab 中文"
    assert detok.flush() == "\ufffd"
    assert detok.text == BYTE_LEVEL.decode(ids)


class _RecordingDecoder:
    """Wraps a tokenizer to record how many ids each decode call is given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_each_step_decodes_a_small_window(name: str) -> None:
    tok = TOKENIZERS[name]
    text = " ".join(["the quick brown fox 中文 jumps over 👍🏽 the lazy dog"] * 40)
    ids = tok.encode(text).ids
    rec = _RecordingDecoder(tok)
    detok = IncrementalDetokenizer(rec, ids[:50])
    pieces = [detok.add_tokens([t]) for t in ids[50:]]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)[len(tok.decode(ids[:50])) :]
    assert max(rec.sizes) <= MAX_PROMPT_CONTEXT_TOKENS + 1
    # Past the prompt, the window is the ids of the previous emit plus those of an unfinished
    # character: here at most 4 byte tokens each.
    assert max(rec.sizes[30:]) <= 8
    assert len(rec.sizes) <= 2 * len(ids)


def test_real_replacement_chars_do_not_grow_the_window_forever() -> None:
    ids = BYTE_LEVEL.encode("ok " + "\ufffd" * 300).ids
    rec = _RecordingDecoder(BYTE_LEVEL)
    detok = IncrementalDetokenizer(rec, [])
    pieces = [detok.add_tokens([t]) for t in ids]
    pieces.append(detok.flush())
    text = "".join(pieces)
    # Past MAX_HELD_CALLS the window is emitted as is; if it ended inside a character, the
    # rest of that character reads as extra U+FFFDs: only garbage text is affected.
    assert text.startswith("ok ") and set(text[3:]) == {"\ufffd"}
    # Window: the ids of the previous (forced) emit plus those held since.
    assert max(rec.sizes) <= 2 * MAX_HELD_CALLS + 8


def test_short_runs_of_replacement_chars_are_exact() -> None:
    text = "a" + "\ufffd" * (MAX_HELD_CALLS // 4) + " fox"
    ids = BYTE_LEVEL.encode(text).ids
    detok = IncrementalDetokenizer(BYTE_LEVEL, [])
    assert "".join(_stream(detok, [[t] for t in ids])) == text


def test_empty_add_emits_nothing() -> None:
    detok = IncrementalDetokenizer(BYTE_LEVEL, BYTE_LEVEL.encode("hi").ids)
    assert detok.add_tokens([]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


# ---- TextStream: detokenizer + stop strings ----


def _reference_stop_output(
    text: str, stops: Sequence[str], include: bool
) -> tuple[str, str | None]:
    """What a sequence with this full text outputs: brute force over every end position."""
    for end in range(1, len(text) + 1):
        # At one end position the longest stop starts first and wins.
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def _run_stream(
    tok: Tokenizer, ids: list[int], stops: Sequence[str], include: bool, rng: random.Random
) -> tuple[str, str | None]:
    stream = TextStream(tok, [], stop=tuple(stops), include_stop_str_in_output=include)
    out, stop = [], None
    for g in _groups(ids, rng, 4):
        delta = stream.push(g)
        out.append(delta.text)
        assert stream.text == "".join(out)
        if delta.stop is not None:
            stop = delta.stop
            break
    out.append(stream.finish())
    assert stream.text == "".join(out)
    # A stop string can also turn up in the text flushed by finish().
    assert stop is None or stream.stop == stop
    return "".join(out), stream.stop


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=20).map("".join),
    data=st.data(),
    include=st.booleans(),
)
def test_text_stream_matches_stop_reference(
    name: str, text: str, data: st.DataObject, include: bool
) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text).ids
    full = tok.decode(ids)
    # Stops cut from the decoded text (so they straddle tokens) plus ones that may never match.
    spans = st.tuples(st.integers(0, max(len(full) - 1, 0)), st.integers(1, 6))
    cut = [full[i : i + n] for i, n in data.draw(st.lists(spans, max_size=3))]
    stops = [s for s in cut if s] + data.draw(
        st.lists(st.sampled_from(["zz", "😀x", "中"]), max_size=2)
    )
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    got = _run_stream(tok, ids, stops, include, rng)
    assert got == _reference_stop_output(full, stops, include)


def test_text_stream_stop_straddling_tokens() -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = BYTE_LEVEL.encode(text).ids
    stream = TextStream(BYTE_LEVEL, [], stop=("fox jum",))
    deltas = [stream.push([t]) for t in ids]
    stops = [d.stop for d in deltas if d.stop is not None]
    assert stops == ["fox jum"]
    assert stream.text == text[: text.index("fox jum")]
    assert stream.finish() == ""
    assert stream.push(ids[:2]).text == ""


def test_text_stream_finish_releases_held_text() -> None:
    ids = BYTE_LEVEL.encode("the lazy do").ids
    stream = TextStream(BYTE_LEVEL, [], stop=("dog!",))
    streamed = "".join(stream.push([t]).text for t in ids)
    assert streamed == "the lazy "  # "do" could still start "dog!"
    assert stream.finish() == "do"
    assert stream.text == "the lazy do"
    assert stream.stop is None


def test_text_stream_finds_stop_in_flushed_text() -> None:
    ids = BYTE_LEVEL.encode("ab 中").ids[:-1]  # ends inside 中: flushed as U+FFFD
    stream = TextStream(BYTE_LEVEL, [], stop=("\ufffd",))
    assert "".join(stream.push([t]).text for t in ids) == "ab "
    assert stream.finish() == ""
    assert stream.stop == "\ufffd"
    assert stream.text == "ab "


def test_text_stream_without_stops_passes_text_through() -> None:
    ids = SENTENCEPIECE.encode("the fox 😀 jumps").ids
    stream = TextStream(SENTENCEPIECE, [])
    text = "".join(stream.push([t]).text for t in ids) + stream.finish()
    assert text == SENTENCEPIECE.decode(ids) == stream.text


def test_text_stream_looks_for_stop_strings_only_past_min_tokens() -> None:
    # vLLM's rule: min_tokens holds back stop strings as it does EOS and stop_token_ids. A stop
    # that ends in the first min_tokens tokens' text is passed; the next one stops the stream.
    text = "one two one two one two"
    ids = BYTE_LEVEL.encode(text).ids
    first_end = next(i for i in range(1, len(ids) + 1) if "two" in BYTE_LEVEL.decode(ids[:i]))
    stream = TextStream(BYTE_LEVEL, [], stop=("two",), min_tokens=first_end)
    deltas = [stream.push([t]) for t in ids]
    assert [d.stop for d in deltas if d.stop is not None] == ["two"]
    assert stream.text == "one two one "
    eager = TextStream(BYTE_LEVEL, [], stop=("two",))
    assert [eager.push([t]).stop for t in ids].count("two") == 1 and eager.text == "one "
