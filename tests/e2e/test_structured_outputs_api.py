"""Structured outputs and tool calling through the real server and the official `openai` client.

The tiny model has random weights: every check is that the answer is valid (parses, matches the
schema) whatever it says, and that tool calls come back in OpenAI's shapes, streamed or not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import Server, start_server, stop_server
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
)
USER = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("structured"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield s
    stop_server(s)


def client(server: Server) -> Any:
    """The official client; typed Any here, since its overloads take TypedDicts that these
    tests write as plain dicts."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(server: Server, **body: Any) -> httpx.Response:
    base = {"messages": USER, "max_tokens": 120, "seed": 3, "temperature": 0.9}
    return httpx.post(f"{server.url}/v1/chat/completions", json=base | body, timeout=60)


def _finished(choices: list[Any]) -> list[Any]:
    done = [c for c in choices if c.finish_reason in ("stop", "tool_calls")]
    assert done, "no choice finished: the check proves nothing"
    return done


def test_response_format_json_schema_validates(server: Server) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client(server).chat.completions.create(
        model="inferd-tiny",
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        n=4,
        seed=5,
        temperature=1.0,
        max_tokens=60,
    )
    for c in _finished(r.choices):
        jsonschema.validate(json.loads(c.message.content or ""), schema)


def test_json_object_and_vllm_fields(server: Server) -> None:
    r = _chat(server, response_format={"type": "json_object"}, max_tokens=200, temperature=0.6)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice["message"]["content"].lstrip().startswith("{")
    regex = r"[A-Z][a-z]{2,5} [0-9]{2}"
    for body in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        r = _chat(server, **body)
        assert r.status_code == 200, r.text
        assert re.fullmatch(regex, r.json()["choices"][0]["message"]["content"])
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Pick:", "structured_outputs": {"choice": ["red", "blue"]}, "n": 3},
        timeout=60,
    )
    assert {c["text"] for c in r.json()["choices"]} <= {"red", "blue"}


def test_streamed_json_schema_validates(server: Server) -> None:
    stream = client(server).chat.completions.create(
        model="inferd-tiny",
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        stream=True,
        seed=9,
        max_tokens=80,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), WEATHER)


class Answer(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=9)
    color: Literal["red", "green"]


def test_openai_parse_with_a_pydantic_model(server: Server) -> None:
    completion = client(server).beta.chat.completions.parse(
        model="inferd-tiny",
        messages=USER,
        response_format=Answer,
        seed=0,
        max_tokens=230,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_tool_choice_required_calls_valid_functions(server: Server) -> None:
    r = client(server).chat.completions.create(
        model="inferd-tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        seed=11,
        max_tokens=150,
    )
    for c in _finished(r.choices):
        assert c.finish_reason == "tool_calls"
        assert c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            fn = call.function
            jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])


def test_parallel_tool_calls_false_makes_one_call(server: Server) -> None:
    r = _chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3)
    for c in r.json()["choices"]:
        if c["finish_reason"] == "tool_calls":
            assert len(c["message"]["tool_calls"]) == 1


def test_named_tool_choice_streamed_and_not(server: Server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client(server).chat.completions.create(
        model="inferd-tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice=named,
        seed=2,
        max_tokens=80,
    )
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = _stream_tool_calls(server, tools=TOOLS, tool_choice=named, seed=2, max_tokens=80)
    assert streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [
        ("get_weather", json.loads(call.function.arguments))
    ]


def _stream_tool_calls(server: Server, **body: Any) -> dict[str, Any]:
    """Reassembles delta.tool_calls by index, as OpenAI's clients do."""
    stream = client(server).chat.completions.create(
        model="inferd-tiny",
        messages=USER,
        stream=True,
        **body,
    )
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for frag in choice.delta.tool_calls or []:
            call = calls.setdefault(frag.index, {"name": "", "arguments": "", "id": ""})
            call["id"] += frag.id or ""
            if frag.function is not None:
                call["name"] += frag.function.name or ""
                call["arguments"] += frag.function.arguments or ""
    return {"calls": [calls[i] for i in sorted(calls)], "content": content, "finish_reason": finish}


def test_auto_tool_choice_parses_what_the_model_wrote(server: Server) -> None:
    # The regex makes the model write a hermes tool call; the parser must find it.
    regex = re.escape("Let me check. " + HERMES_CALL)
    body = {"tools": TOOLS, "structured_outputs": {"regex": regex}, "max_tokens": 200}
    r = _chat(server, **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    streamed = _stream_tool_calls(server, extra_body=body, max_tokens=200)
    assert streamed["content"].strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 3})
    ]
    assert streamed["finish_reason"] == "tool_calls"


def test_strict_tool_in_auto_mode_is_served(server: Server) -> None:
    # The structural tag's semantics are tested on the grammar itself
    # (tests/integration/test_tool_grammars.py); here: the server takes it and answers.
    fn = {"name": "get_weather", "parameters": WEATHER, "strict": True}
    r = _chat(server, tools=[{"type": "function", "function": fn}], max_tokens=20)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_history_with_tool_calls_and_results(server: Server) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = _chat(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


NAMED_MISSING = {"type": "function", "function": {"name": "nope"}}
BAD_BODIES = [
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs", "cannot compile the regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"tools": TOOLS, "tool_choice": NAMED_MISSING}, "body", "not in tools"),
    ({"tool_choice": "required"}, "body", "needs tools"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "constrains",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_BODIES)
def test_bad_constraints_are_400s(
    server: Server, body: dict[str, Any], param: str, message: str
) -> None:
    r = _chat(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]
    assert param in (error["param"] or "body")


def test_grammar_stage_and_cache_counters(server: Server) -> None:
    before = server.metrics()
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    bodies = [_chat(server, response_format=fmt, max_tokens=30).json() for _ in range(2)]
    assert all(b["timings"]["grammar"] > 0 for b in bodies)
    after = server.metrics()
    assert (
        after["inferd_grammar_cache_misses_total"] - before["inferd_grammar_cache_misses_total"]
        == 1
    )
    assert after["inferd_grammar_cache_hits_total"] - before["inferd_grammar_cache_hits_total"] == 1


def test_auto_tool_choice_needs_the_flags(tmp_path_factory: pytest.TempPathFactory) -> None:
    plain = start_server(tmp_path_factory.mktemp("plain"), "--reasoning-parser", "deepseek_r1")
    try:
        r = _chat(plain, tools=TOOLS)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        # deepseek_r1: without `</think>` the model is still thinking, so it is all reasoning.
        r = _chat(plain, temperature=0.0, max_tokens=8)
        message = r.json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning"]
        assert message["reasoning_content"] == message["reasoning"]
    finally:
        stop_server(plain)
