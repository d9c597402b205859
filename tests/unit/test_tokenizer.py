"""The tokenizer wrapper: encode/decode, BOS rules, chat templates, EOS ids.

Reference behaviour comes from transformers' AutoTokenizer on the same files where it applies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.errors import InvalidRequestError, ModelLoadError
from inferd.models.tiny import BOS, EOS, IM_END, PAD, build_tokenizer
from inferd.preprocess.tokenizer import NoChatTemplateError, Tokenizer, load_generation_config

TEXTS = [
    "Hello world, this is a test.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\ttabbed",
    "Café naïve über Größe, São Paulo.",
    "你好世界，日本語のテキスト，한국어 문장",
    "Emoji 🚀🎉 and family 👨‍👩‍👧 and flags 🇫🇷",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. ¿Qué tal? <b>bold</b> & done"},
    {"role": "user", "content": "Count to 3"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(4096, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


def _variant(
    src: Path,
    dst: Path,
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    post_processor: Any = "keep",
) -> Path:
    shutil.copytree(src, dst)
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    for key in drop:
        tok_config.pop(key, None)
    tok_config.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if post_processor != "keep":
        tok_json = json.loads((dst / "tokenizer.json").read_text())
        tok_json["post_processor"] = post_processor
        (dst / "tokenizer.json").write_text(json.dumps(tok_json))
    return dst


def _id(tok: Tokenizer, token: str) -> int:
    """The id of a token the test vocabulary has (`token_to_id` is None for an unknown one)."""
    found = tok.hf.token_to_id(token)
    assert found is not None, token
    return found


def _hf(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder)


# -- encode / decode -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == text  # BOS is skipped as a special token


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    # Byte-level BPE: every Unicode string is encodable and decodes back exactly, special tokens'
    # text included once decode keeps them (Hypothesis also tries string constants of the code
    # under test, such as "<|im_start|>", which encodes to the special token).
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_non_ascii_uses_merged_tokens(tok: Tokenizer) -> None:
    # The training text had accented words and CJK, so they are not all single bytes.
    for word in ("café", "你好", "こんにちは"):
        assert len(tok.encode(word, add_special_tokens=False)) < len(word.encode())


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, tiny_dir: Path, text: str) -> None:
    hf = _hf(tiny_dir)
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_bos_added_once(tok: Tokenizer) -> None:
    bos = tok.bos_token_id
    assert bos == tok.hf.token_to_id(BOS)
    ids = tok.encode("hello")
    assert ids[0] == bos and bos not in ids[1:]
    assert bos not in tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize(
    ("name", "config", "post_processor"),
    [
        # The config asks for BOS and tokenizer.json adds it too: still only once.
        ("flag-and-post-processor", {"add_bos_token": True}, "keep"),
        # An explicit false does not strip what tokenizer.json adds (transformers 5).
        ("flag-false", {"add_bos_token": False}, "keep"),
        ("neither", {}, None),
        # add_eos_token is ignored, as transformers 5 does.
        ("eos-flag", {"add_eos_token": True}, "keep"),
    ],
)
def test_bos_follows_post_processor_like_transformers(
    tiny_dir: Path, tmp_path: Path, name: str, config: dict[str, Any], post_processor: Any
) -> None:
    folder = _variant(tiny_dir, tmp_path / name, config, post_processor=post_processor)
    ours = Tokenizer.from_pretrained(folder)
    ids = ours.encode("some words")
    assert ids == _hf(folder).encode("some words")
    assert ids.count(_id(ours, BOS)) <= 1


def test_bos_flag_adds_bos_when_post_processor_does_not(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "flag", {"add_bos_token": True}, post_processor=None)
    ours = Tokenizer.from_pretrained(folder)
    bare = ours.hf.encode("some words", add_special_tokens=False).ids
    assert ours.hf.encode("some words").ids == bare  # tokenizer.json adds nothing
    assert ours.encode("some words") == [ours.bos_token_id, *bare]
    assert ours.encode("some words", add_special_tokens=False) == bare


def test_special_tokens_as_added_token_dicts(tiny_dir: Path, tmp_path: Path) -> None:
    as_dict = {"__type": "AddedToken", "content": BOS, "lstrip": False, "special": True}
    folder = _variant(tiny_dir, tmp_path / "dicts", {"bos_token": as_dict})
    assert Tokenizer.from_pretrained(folder).bos_token_id == 0


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    specials = [_id(tok, t) for t in (BOS, EOS, "<|im_start|>", IM_END, PAD)]
    assert tok.all_special_ids == sorted(specials)
    assert tok.pad_token_id == tok.hf.token_to_id(PAD)
    assert tok.decode(specials, skip_special_tokens=False) == "".join(
        (BOS, EOS, "<|im_start|>", IM_END, PAD)
    )


# -- EOS -----------------------------------------------------------------------------------------


def test_eos_ids_are_the_union(tok: Tokenizer, tiny_dir: Path, tmp_path: Path) -> None:
    eos, im_end = tok.hf.token_to_id(EOS), tok.hf.token_to_id(IM_END)
    assert tok.eos_token_ids == frozenset({eos, im_end})
    folder = _variant(tiny_dir, tmp_path / "gen", {"eos_token": IM_END})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({eos, im_end})
    (folder / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({im_end})


def test_load_generation_config(tiny_dir: Path, tmp_path: Path) -> None:
    assert load_generation_config(tiny_dir) == {"eos_token_id": [1, 3]}
    assert load_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        load_generation_config(tmp_path)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


# -- chat templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, tiny_dir: Path, add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    ref = _hf(tiny_dir).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


# A template exercising what transformers provides: bos_token, tojson (no HTML escaping, unicode
# kept), raise_exception, loop controls, trim/lstrip blocks, extra keyword arguments.
FANCY = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    [{{ m['role'] }}] {{ m['content'] | tojson }}
{% endfor %}
{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


def _with_template(tiny_dir: Path, folder: Path, template: Any) -> Path:
    return _variant(tiny_dir, folder, {"chat_template": template})


def test_fancy_template_matches_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _with_template(tiny_dir, tmp_path / "fancy", FANCY)
    ours = Tokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, enable_thinking=False)
    ref = _hf(folder).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert ours == ref
    assert ours.startswith(BOS) and "<b>bold</b> & done" in ours and "¿Qué" in ours
    assert "Count" not in ours  # {% break %} after three messages
    assert "<no-think>" in ours and ours.endswith("[assistant]")


def test_template_raise_exception_is_a_request_error(tiny_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_with_template(tiny_dir, tmp_path / "raise", FANCY))
    with pytest.raises(InvalidRequestError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_none_fields_are_dropped(tok: Tokenizer, tiny_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ 'tc' if 'tool_calls' in m else 'plain' }}{% endfor %}"
    ours = Tokenizer.from_pretrained(_with_template(tiny_dir, tmp_path / "none", template))
    assert ours.apply_chat_template([{"role": "user", "content": "a", "tool_calls": None}]) == (
        "plain"
    )


def test_named_templates(tiny_dir: Path, tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    tok = Tokenizer.from_pretrained(_with_template(tiny_dir, tmp_path / "named", named))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}, {"name": "g"}]) == "T2"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    with pytest.raises(InvalidRequestError, match="no chat template named"):
        tok.apply_chat_template(msgs, chat_template="nope")


def test_chat_template_jinja_file_takes_precedence(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _with_template(tiny_dir, tmp_path / "jinja", "from config")
    (folder / "chat_template.jinja").write_text("from file")
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "from file"


def test_no_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_dir, tmp_path / "plain", drop=("chat_template",))
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        Tokenizer.from_pretrained(folder).apply_chat_template(MESSAGES)


def test_continue_final_message(tok: Tokenizer) -> None:
    msgs = [*MESSAGES[:2], {"role": "assistant", "content": "The answer is"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)


def test_empty_messages(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        tok.apply_chat_template([])
