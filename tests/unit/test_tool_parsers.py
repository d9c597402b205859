"""Tool-call parsers (hermes, llama3_json, mistral): whole outputs, and streams cut every way."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from inferd.postprocess.text_stream import StrippedText
from inferd.postprocess.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    StreamDelta,
    ToolParser,
    get_tool_parser,
)

pytestmark = pytest.mark.unit

Calls = list[tuple[str, str]]  # (name, arguments) in order


def _split(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _reassemble(deltas: Iterable[StreamDelta]) -> tuple[str, Calls, list[str]]:
    """(content, calls, ids) as a client rebuilds them from the fragments, checking their shape:
    a call's first fragment has its id and name, later ones neither; indexes count from 0."""
    content = ""
    names: list[str] = []
    ids: list[str] = []
    arguments: list[str] = []
    for d in deltas:
        content += d.content
        for f in d.tool_calls:
            if f.index == len(names):
                assert f.id is not None and f.name is not None
                names.append(f.name)
                ids.append(f.id)
                arguments.append(f.arguments)
            else:
                assert f.index == len(names) - 1 and f.id is None and f.name is None
                arguments[f.index] += f.arguments
    return content, list(zip(names, arguments, strict=True)), ids


def _stream(parser: ToolParser, pieces: Iterable[str]) -> tuple[str, Calls]:
    s = parser.stream()
    content, calls, _ = _reassemble([*(s.feed(p) for p in pieces), s.finish()])
    return content, calls


def _calls(result: ExtractedToolCalls) -> Calls:
    return [(c.name, c.arguments) for c in result.tool_calls]


def _extract(parser: ToolParser, text: str) -> tuple[str, Calls]:
    result = parser.extract(text)
    assert result.content != ""  # empty content is None
    return result.content or "", _calls(result)


def _agree(parser: ToolParser, text: str) -> tuple[str, Calls]:
    """extract(text), after checking that streaming it whole and one character at a time gives
    the same content and calls."""
    expected = _extract(parser, text)
    assert _stream(parser, [text]) == expected
    assert _stream(parser, text) == expected
    return expected


HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()
MISTRAL = MistralToolParser()


def _hermes_block(name: str, arguments: object) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# --- hermes -------------------------------------------------------------------------------------


def test_hermes_single_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    assert _agree(HERMES, text) == ("", [("get_weather", '{"city": "Paris"}')])
    assert HERMES.extract(text).content is None


def test_hermes_parallel_calls_with_content_before_and_after() -> None:
    text = (
        "I'll check both cities.\n"
        + _hermes_block("get_weather", {"city": "Paris"})
        + "\n"
        + _hermes_block("get_time", {"tz": "Europe/Paris"})
        + "\nDone."
    )
    assert _agree(HERMES, text) == (
        "I'll check both cities.\n\n\nDone.",  # the text outside the blocks, as it is
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    )


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_hermes_unicode_and_nested_arguments(ensure_ascii: bool) -> None:
    arguments = {
        "city": "Zürich",
        "note": "東京 🌧",
        "filter": {"days": [1, 2], "opts": {"x": None}},
    }
    written = json.dumps(arguments, ensure_ascii=ensure_ascii)  # literal, or \u-escaped
    text = f'<tool_call>{{"name": "search", "arguments": {written}}}</tool_call>'
    _, calls = _agree(HERMES, text)
    assert calls == [("search", json.dumps(arguments, ensure_ascii=False))]
    assert "Zürich" in calls[0][1] and "東京 🌧" in calls[0][1]  # never \u-escaped
    assert json.loads(calls[0][1]) == arguments


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "f", "arguments": {"x": 1}',  # unbalanced
        '{"name": "f", "arguments": {"x": 1}} trailing',
        "not json at all",
        '{"arguments": {"x": 1}}',  # no name
        '{"name": 3, "arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": {"x": NaN}}',  # not JSON: json.dumps would write it back
        '["f", {"x": 1}]',
        "",
    ],
)
def test_hermes_malformed_block_makes_the_whole_text_content(block: str) -> None:
    text = f"Let me see.\n<tool_call>\n{block}\n</tool_call>\n"
    assert _agree(HERMES, text) == (text.strip(), [])


def test_hermes_one_malformed_block_among_good_ones_makes_everything_content() -> None:
    text = _hermes_block("f", {"x": 1}) + "\n<tool_call>{oops}</tool_call>"
    assert _extract(HERMES, text) == (text, [])


def test_hermes_malformed_block_after_a_sent_call_streams_as_content() -> None:
    # The documented exception: a call already sent cannot be taken back.
    good = _hermes_block("f", {"x": 1})
    bad = "<tool_call>{oops}</tool_call>"
    after = _hermes_block("g", {})
    assert _stream(HERMES, [good, "\n" + bad, after]) == (bad + after, [("f", '{"x": 1}')])


def test_hermes_unterminated_last_block_is_parsed() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n'
    assert _agree(HERMES, text) == ("Sure.", [("f", '{"x": [1, 2]}')])


def test_hermes_unterminated_malformed_block_is_content() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "argu'
    assert _agree(HERMES, text) == (text, [])


def test_hermes_arguments_as_a_json_string_or_missing() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"ü\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert _agree(HERMES, text) == ("", [("f", '{"x": "ü"}'), ("now", "{}")])


def test_hermes_text_without_calls_is_content_stripped() -> None:
    assert _agree(HERMES, "  Hello <b>world</b> </tool_call>\n") == (
        "Hello <b>world</b> </tool_call>",
        [],
    )
    assert HERMES.extract("  \n").content is None


def test_hermes_holds_back_what_may_begin_a_marker_and_no_more() -> None:
    s = HERMES.stream()
    assert s.feed("Hi <tool") == StreamDelta("Hi")  # the space waits for what follows it
    assert s.feed("box> there") == StreamDelta(" <toolbox> there")
    assert s.feed(" <tool_") == StreamDelta("")
    assert s.feed("call>") == StreamDelta("")
    assert s.feed('{"name": "f", "arguments": {}}</tool_c') == StreamDelta("")
    delta = s.feed("all>")
    assert delta.content == ""
    assert [(f.index, f.name, f.arguments) for f in delta.tool_calls] == [
        (0, "f", ""),
        (0, None, "{}"),
    ]
    assert s.finish() == StreamDelta()


def test_hermes_partial_marker_at_the_end_is_released_by_finish() -> None:
    s = HERMES.stream()
    assert s.feed("The tag is <tool_ca") == StreamDelta("The tag is")
    assert s.finish() == StreamDelta(" <tool_ca")


def test_stream_sends_name_and_id_first_then_the_arguments() -> None:
    s = HERMES.stream()
    delta = s.feed(_hermes_block("f", {"a": 1}) + _hermes_block("g", {"b": 2}))
    first, args, second, args2 = delta.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "f", "")
    assert re.fullmatch(r"call_[0-9a-f]{24}", first.id or "")
    assert (args.index, args.id, args.name, args.arguments) == (0, None, None, '{"a": 1}')
    assert (second.index, second.name, args2.index, args2.arguments) == (1, "g", 1, '{"b": 2}')
    assert second.id != first.id


def test_extract_makes_fresh_ids() -> None:
    text = _hermes_block("f", {}) + _hermes_block("f", {})
    ids = [c.id for c in [*HERMES.extract(text).tool_calls, *HERMES.extract(text).tool_calls]]
    assert len(set(ids)) == 4 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# --- llama3_json --------------------------------------------------------------------------------


def test_llama_single_call_with_python_tag_and_parameters() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _agree(LLAMA, text) == ("", [("get_weather", '{"city": "Paris"}')])


def test_llama_parallel_calls_separated_by_semicolons() -> None:
    text = '{"name": "f", "arguments": {"x": 1}} ;\n{"name": "g", "parameters": {"y": {"z": []}}};'
    assert _agree(LLAMA, text) == ("", [("f", '{"x": 1}'), ("g", '{"y": {"z": []}}')])


def test_llama_text_after_the_calls_is_content() -> None:
    text = '{"name": "f", "parameters": {"q": "ü 中"}}\n\nI called f.'
    assert _agree(LLAMA, text) == ("I called f.", [("f", '{"q": "ü 中"}')])


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        'Here: {"name": "f", "parameters": {}}',  # a call is only at the start
        "<|python_tag|>print('hello')",  # Llama's code interpreter, not a JSON call
        '{"name": "Alice", "age": 30}',  # a JSON answer, not a call: no parameters
        '{"city": "Paris"}',
        '{"name": "f", "parameters": {"x": 1}, "arguments": {"x": 2}}',
        '{"name": "f", "parameters": [1]}',
        '{"name": "f", "parameters": {"x": 1}',  # the output ended inside the object
    ],
)
def test_llama_content(text: str) -> None:
    assert _agree(LLAMA, text) == (text, [])


def test_llama_only_semicolons_separate_calls() -> None:
    text = '{"name": "f", "parameters": {"x": 1}} {"name": "g", "parameters": {}}'
    assert _agree(LLAMA, text) == ('{"name": "g", "parameters": {}}', [("f", '{"x": 1}')])


def test_llama_malformed_second_call() -> None:
    text = '{"name": "f", "parameters": {}}; {"name": "g"}'
    assert _extract(LLAMA, text) == (text, [])
    # The stream had sent f before it saw g: it sends the rest as content.
    assert _stream(LLAMA, text) == ('; {"name": "g"}', [("f", "{}")])


def test_llama_holds_back_a_partial_python_tag() -> None:
    s = LLAMA.stream()
    assert s.feed("  <|pyth") == StreamDelta()
    assert s.feed("on_tag|> ") == StreamDelta()
    assert s.feed("Hi") == StreamDelta("<|python_tag|> Hi")
    s = LLAMA.stream()
    assert s.feed("<|py") == StreamDelta()
    assert s.feed("x") == StreamDelta("<|pyx")


# --- mistral ------------------------------------------------------------------------------------


def test_mistral_array_form() -> None:
    text = (
        'Let me look.[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
        '{"name": "g", "arguments": {"s": "]} [TOOL_CALLS]"}}]'
    )
    assert _agree(MISTRAL, text) == (
        "Let me look.",
        [("f", '{"x": 1}'), ("g", '{"s": "]} [TOOL_CALLS]"}')],
    )


def test_mistral_args_form_parallel_and_with_call_ids() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{}'
    assert _agree(MISTRAL, text) == ("", [("get_weather", '{"city": "Zürich"}'), ("f", "{}")])


def test_mistral_name_then_object_without_args_token() -> None:
    # What is left of the v11 form when control tokens are decoded away (vLLM accepts it too).
    text = 'Sure. [TOOL_CALLS]add{"a": 3.5, "b": {"c": [4]}}'
    assert _agree(MISTRAL, text) == ("Sure.", [("add", '{"a": 3.5, "b": {"c": [4]}}')])


def test_mistral_text_between_and_after_calls_is_content() -> None:
    text = '[TOOL_CALLS]f[ARGS]{"x": 1} and [TOOL_CALLS]g[ARGS]{} done'
    assert _agree(MISTRAL, text) == ("and  done", [("f", '{"x": 1}'), ("g", "{}")])


@pytest.mark.parametrize(
    "calls",
    [
        '[{"name": "f", "arguments": {"x": 1}]',  # bad JSON
        "[]",
        '[{"arguments": {}}]',
        '["f"]',
        'f[ARGS]{"x": }',
        'f[ARGS][{"x": 1}]',
        'two words[ARGS]{"x": 1}',
        'f[ARGS]{"x": 1',  # ended inside the object
        "",
        "I cannot call tools.",
        "x" * 300,  # a name part this long is not waited for
    ],
)
def test_mistral_malformed_calls_are_content(calls: str) -> None:
    text = f"Hmm.[TOOL_CALLS]{calls}"
    assert _agree(MISTRAL, text) == (text, [])


def test_mistral_ids_are_nine_alphanumerics() -> None:
    result = MISTRAL.extract("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]f[ARGS]{}")
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"[0-9a-zA-Z]{9}", i) for i in ids)


def test_mistral_holds_back_a_partial_marker_and_gives_up_on_a_long_name() -> None:
    s = MISTRAL.stream()
    assert s.feed("See [TOOL") == StreamDelta("See")
    assert s.feed("BOX] ") == StreamDelta(" [TOOLBOX]")
    assert s.feed("[TOOL_CALLS]") == StreamDelta()
    assert s.feed("y" * 200) == StreamDelta()  # could still be a name
    assert s.feed("y" * 100) == StreamDelta(" [TOOL_CALLS]" + "y" * 300)
    assert s.feed(" more") == StreamDelta(" more")


# --- the registry and shared pieces -------------------------------------------------------------


def test_get_tool_parser() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name, cls in TOOL_PARSERS.items():
        parser = get_tool_parser(name)
        assert isinstance(parser, cls) and parser.name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


@given(st.lists(st.text(alphabet=" \n\tab", max_size=5), max_size=8))
def test_stripped_text_joins_to_the_stripped_whole(pieces: list[str]) -> None:
    s = StrippedText()
    sent = [s.push(p) for p in pieces]
    assert "".join(sent) == "".join(pieces).strip()
    assert all(not p or not p[-1].isspace() for p in sent)  # trailing whitespace always waits


# --- properties: any text, cut any way ----------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.text(alphabet='ab ü中🌧"\\{}[]<>/;\n')
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(alphabet="abcü_", max_size=5), json_values, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
# Content: characters markers are made of, and whitespace; full markers are filtered out.
content = st.text(alphabet="<>[]{}/_|tool_caTOL;ARGS\n x", max_size=12)
cuts = st.lists(st.integers(0, 400), max_size=12)


def _normalized(cs: list[tuple[str, dict[str, object]]]) -> Calls:
    return [(n, json.dumps(a, ensure_ascii=False)) for n, a in cs]


def _check(parser: ToolParser, text: str, cut: list[int], expected: tuple[str, Calls]) -> None:
    assert _extract(parser, text) == expected
    assert _stream(parser, _split(text, cut)) == expected


@settings(max_examples=200, deadline=None)
@given(calls=calls, texts=st.lists(content, min_size=4, max_size=4), cut=cuts)
def test_hermes_well_formed_any_split(
    calls: list[tuple[str, dict[str, object]]], texts: list[str], cut: list[int]
) -> None:
    assume(not any("<tool_call>" in t for t in texts))
    objects = [json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls]
    blocks = [f"<tool_call>{o}</tool_call>" for o in objects]
    assume(all(b.count("</tool_call>") == 1 for b in blocks))
    text = texts[0] + "".join(b + t for b, t in zip(blocks, texts[1:], strict=False))
    used = texts[: len(blocks) + 1]
    _check(HERMES, text, cut, ("".join(used).strip(), _normalized(calls)))


@settings(max_examples=200, deadline=None)
@given(
    calls=calls,
    tag=st.booleans(),
    seps=st.lists(st.sampled_from([";", " ; ", ";\n"]), min_size=2),
    tail=content,
    cut=cuts,
)
def test_llama_well_formed_any_split(
    calls: list[tuple[str, dict[str, object]]],
    tag: bool,
    seps: list[str],
    tail: str,
    cut: list[int],
) -> None:
    objects = [json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls]
    text = ("<|python_tag|>" if tag else "") + "".join(
        o + s for o, s in zip(objects, [*seps[: len(objects) - 1], ""], strict=True)
    )
    tail_text = "\n" + "Ok" + tail  # text after the calls: content
    _check(LLAMA, text + tail_text, cut, (tail_text.strip(), _normalized(calls)))


@settings(max_examples=200, deadline=None)
@given(
    calls=calls,
    array=st.booleans(),
    texts=st.lists(content, min_size=4, max_size=4),
    cut=cuts,
)
def test_mistral_well_formed_any_split(
    calls: list[tuple[str, dict[str, object]]], array: bool, texts: list[str], cut: list[int]
) -> None:
    assume(not any("[TOOL_CALLS]" in t for t in texts))
    if array:
        items = [{"name": n, "arguments": a} for n, a in calls]
        text = texts[0] + "[TOOL_CALLS]" + json.dumps(items) + texts[1]
        used = texts[:2]
    else:
        regions = [f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls]
        text = texts[0] + "".join(r + t for r, t in zip(regions, texts[1:], strict=False))
        used = texts[: len(regions) + 1]
    _check(MISTRAL, text, cut, ("".join(used).strip(), _normalized(calls)))


# Arbitrary text over the formats' own pieces: markers, JSON fragments, whole calls.
fragments = st.sampled_from(
    [
        "<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[ARGS]", "[TOOL", "<|python_tag|>",
        "<|py", "{", "}", "[", "]", '"', "\\", ";", ":", " ", "\n", "f", "ü",
        '{"name": "f", "arguments": {"x": 1}}', '{"name": "g", "parameters": {}}', '"name"',
    ]
) | st.sampled_from(
    [
        '<tool_call>{"name": "f", "arguments": {"x": "ü"}}</tool_call>',
        '[TOOL_CALLS]f[ARGS]{"x": [1]}',
        '[TOOL_CALLS][{"name": "g", "arguments": {}}]',
    ]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    parser=st.sampled_from([HERMES, LLAMA, MISTRAL]),
    parts=st.lists(fragments, max_size=14),
    cut=cuts,
)
def test_any_text_any_split(parser: ToolParser, parts: list[str], cut: list[int]) -> None:
    text = "".join(parts)
    whole = _stream(parser, [text])
    assert _stream(parser, _split(text, cut)) == whole  # the split does not matter
    expected = _extract(parser, text)
    if expected[1] or not whole[1]:
        # extract found calls, or the stream sent none: they agree. (Otherwise a malformed
        # call came after calls the stream had sent.)
        assert whole == expected
