"""The grammars tool calling compiles to, on the tiny model's tokenizer: what each accepts and
refuses (a random model rarely writes a tool call by itself, so the strings are the test's)."""

from __future__ import annotations

from typing import Any

import pytest
import xgrammar as xgr

from inferd.config import read_environment
from inferd.gateway.openai.protocol import ChatCompletionRequest
from inferd.gateway.openai.tools import ToolSettings, chat_constraint
from inferd.models.loader import resolve_model_path
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.grammar import GrammarCompiler

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
HERMES = (
    '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", "days": 1}}}}\n'
    "</tool_call>"
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    path = resolve_model_path("inferd-tiny", None, read_environment())
    tok = Tokenizer.from_pretrained(path)
    return GrammarCompiler(tok.hf, 4096, sorted(tok.eos_token_ids))


def _accepts(compiler: GrammarCompiler, settings: ToolSettings, text: str, **body: Any) -> bool:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS} | body
    )
    spec = chat_constraint(request, settings)
    assert spec is not None
    matcher = xgr.GrammarMatcher(compiler.submit(spec).result())
    return bool(matcher.accept_string(text)) and matcher.is_completed()


def test_required_accepts_arrays_of_valid_calls_only(compiler: GrammarCompiler) -> None:
    s = ToolSettings()
    ok = '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]'
    assert _accepts(compiler, s, ok, tool_choice="required")
    two = '[{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {"a": 1}}]'
    assert _accepts(compiler, s, two, tool_choice="required")
    assert not _accepts(compiler, s, two, tool_choice="required", parallel_tool_calls=False)
    bad_city = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}]'
    assert not _accepts(compiler, s, bad_city, tool_choice="required")
    assert not _accepts(compiler, s, "[]", tool_choice="required")
    assert not _accepts(
        compiler, s, '[{"name": "other", "parameters": {}}]', tool_choice="required"
    )


def test_named_function_accepts_its_arguments_only(compiler: GrammarCompiler) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    s = ToolSettings()
    assert _accepts(compiler, s, '{"city": "Lima", "days": 7}', tool_choice=named)
    assert not _accepts(compiler, s, '{"city": "Lima"}', tool_choice=named)


@pytest.mark.parametrize(
    ("parser", "good", "bad"),
    [
        (
            "hermes",
            f"Sure. {HERMES.format(city='Oslo')}",
            f"Sure. {HERMES.format(city='Rome')}",
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Lima", "days": 3}}',
            '{"name": "get_weather", "parameters": {"town": "Lima"}}',
        ),
        (
            "mistral",
            'Ok[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 5}}]',
            'Ok[TOOL_CALLS][{"name": "get_weather", "arguments": {"days": 5}}]',
        ),
    ],
)  # fmt: skip
def test_strict_tool_in_auto_mode_constrains_only_the_call(
    compiler: GrammarCompiler, parser: str, good: str, bad: str
) -> None:
    s = ToolSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    assert _accepts(compiler, s, good)
    assert not _accepts(compiler, s, bad)
    # Free text with no call is fine; the tool that is not strict takes any object.
    assert _accepts(compiler, s, "No tool needed here.")
