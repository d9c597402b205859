"""Chat requests with schemas, tools and reasoning: the constraint each one gets, and how the
model's text is read back into content, reasoning and tool calls, whole and streamed."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.errors import InvalidRequestError
from inferd.gateway.openai.protocol import ChatCompletionRequest
from inferd.gateway.openai.tools import (
    OutputRules,
    ToolSettings,
    chat_constraint,
    merge_delta,
    skip_special_tokens,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]} | fields
    )


def test_required_is_an_array_of_calls_and_parallel_false_caps_it() -> None:
    spec = chat_constraint(_body(tools=TOOLS, tool_choice="required"), ToolSettings())
    assert spec is not None and isinstance(spec.json, dict)
    assert spec.json["minItems"] == 1 and "maxItems" not in spec.json
    items = spec.json["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["get_time"]]
    assert items[0]["properties"]["parameters"] == WEATHER
    assert items[1]["properties"]["parameters"] == {"type": "object"}  # no parameters: any object
    single = chat_constraint(
        _body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolSettings()
    )
    assert single is not None and isinstance(single.json, dict) and single.json["maxItems"] == 1


def test_named_function_is_its_parameters_schema() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = chat_constraint(_body(tools=TOOLS, tool_choice=named), ToolSettings())
    assert spec is not None and spec.json == WEATHER


def test_auto_needs_the_server_flags_and_strict_tools_get_a_structural_tag() -> None:
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        chat_constraint(_body(tools=TOOLS), ToolSettings())
    assert chat_constraint(_body(tools=TOOLS), AUTO) is None  # no strict tool: free text
    strict = [
        {"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}
    ]
    spec = chat_constraint(_body(tools=strict), AUTO)
    assert spec is not None and spec.structural_tag is not None
    tag = json.loads(spec.structural_tag)["format"]
    assert tag["triggers"] == ["<tool_call>"]
    (only,) = tag["tags"]
    assert only["begin"] == '<tool_call>\n{"name": "f", "arguments": '
    assert only["content"]["json_schema"] == WEATHER
    # tool_choice none: tools are only context; nothing is constrained or parsed.
    assert chat_constraint(_body(tools=TOOLS, tool_choice="none"), ToolSettings()) is None
    assert OutputRules.for_request(_body(tools=TOOLS, tool_choice="none"), ToolSettings()) is None


def test_one_constraint_at_a_time() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert chat_constraint(_body(response_format=fmt), ToolSettings()).json == WEATHER  # type: ignore[union-attr]
    with pytest.raises(InvalidRequestError, match="not both"):
        chat_constraint(
            _body(response_format=fmt, structured_outputs={"regex": "a"}), ToolSettings()
        )
    with pytest.raises(InvalidRequestError, match="constrains the output already"):
        chat_constraint(
            _body(response_format=fmt, tools=TOOLS, tool_choice="required"), ToolSettings()
        )
    with pytest.raises(InvalidRequestError, match="not both"):
        _body(structured_outputs={"regex": "a"}, guided_regex="b").structured_params()
    guided = _body(guided_choice=["a", "b"]).structured_params()
    assert guided is not None and guided.choice == ["a", "b"]


def test_special_tokens_are_kept_for_parsers_that_read_them() -> None:
    mistral = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert skip_special_tokens(_body(tools=TOOLS), mistral) is False
    assert skip_special_tokens(_body(tools=TOOLS), AUTO) is None
    assert skip_special_tokens(_body(), mistral) is None


def _rules(settings: ToolSettings = AUTO, **fields: Any) -> OutputRules:
    rules = OutputRules.for_request(_body(**fields), settings)
    assert rules is not None
    return rules


def test_required_answer_becomes_tool_calls() -> None:
    rules = _rules(tools=TOOLS, tool_choice="required")
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}},
        ]
    )
    msg, finish = rules.message(text, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    # Cut by max_tokens: not an array of calls, so it stays text and the reason stays "length".
    msg, finish = rules.message('[{"name": "get_wea', "length")
    assert finish == "length" and msg["content"] == '[{"name": "get_wea' and "tool_calls" not in msg


def test_auto_answer_is_parsed_and_reasoning_split_first() -> None:
    settings = ToolSettings(True, "hermes", "deepseek_r1")
    rules = _rules(settings, tools=TOOLS)
    msg, finish = rules.message(f"Need weather.</think>Checking.\n{HERMES}", "stop")
    assert finish == "tool_calls"
    assert msg["reasoning"] == msg["reasoning_content"] == "Need weather."
    assert msg["content"] == "Checking."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    plain, finish = _rules(tools=TOOLS).message("Just text.", "stop")
    assert plain["content"] == "Just text." and "tool_calls" not in plain and finish == "stop"


def _streamed(
    rules: OutputRules, pieces: list[str], finish: str
) -> tuple[dict[str, Any], str | None]:
    """What a client reassembles from the stream's deltas: joined text, calls by index."""
    reader = rules.stream()
    delta: dict[str, Any] = {}
    for p in pieces:
        delta = merge_delta(delta, reader.feed(p))
    delta = merge_delta(delta, reader.finish())
    calls: dict[int, dict[str, str]] = {}
    for frag in delta.pop("tool_calls", []):
        call = calls.setdefault(frag["index"], {"name": "", "arguments": ""})
        call["name"] += frag["function"].get("name") or ""
        call["arguments"] += frag["function"]["arguments"]
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta, reader.finish_reason(finish)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_stream_reassembles_to_the_whole_answer(cuts: list[int]) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r1 = ToolSettings(True, "hermes", "deepseek_r1")
    cases: list[tuple[OutputRules, str]] = [
        (_rules(r1, tools=TOOLS), f"Think.</think>Sure. {HERMES}"),
        (_rules(tools=TOOLS, tool_choice="required"), '[{"name": "get_time", "parameters": {}}]'),
        (_rules(tools=TOOLS, tool_choice=named), '{"city": "Lima"}'),
        (_rules(ToolSettings(reasoning_parser="qwen3")), "<think>a b</think> The answer."),
    ]
    for rules, text in cases:
        whole, whole_finish = rules.message(text, "stop")
        streamed, finish = _streamed(rules, _pieces(text, cuts), "stop")
        assert finish == whole_finish
        assert (streamed.get("content") or None) == whole["content"]
        assert (streamed.get("reasoning") or None) == whole.get("reasoning")
        want = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in whole.get("tool_calls", [])
        ]
        got = [
            {"name": c["name"], "arguments": json.dumps(json.loads(c["arguments"]))}
            for c in streamed.get("tool_calls", [])
        ]
        assert got == [
            {"name": w["name"], "arguments": json.dumps(json.loads(w["arguments"]))} for w in want
        ]
