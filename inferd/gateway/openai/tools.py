"""Chat answers with schemas, tools and reasoning: what constrains the output, and how its text
becomes `message.content`, `message.reasoning` and `message.tool_calls`.

What constrains a chat request's output (at most one thing):
  response_format / structured_outputs / guided_*   that schema, regex, choice or grammar
  tool_choice "required"   a JSON array of one or more {"name": <a tool>, "parameters": <its
                           schema>} (at most one item with parallel_tool_calls false)
  tool_choice {function}   that function's `parameters` schema: the output is its arguments
  tool_choice "auto"       nothing, unless a tool is `strict`: then the --tool-call-parser's own
                           format, as an xgrammar structural tag (free text until the parser's
                           start marker, then a call whose arguments match the tool's schema)

How the text is read back (OutputRules), in this order:
  1. --reasoning-parser: the thinking text goes to `reasoning` (and `reasoning_content`).
  2. Tool calls from what remains: "required" parses the array, a named function takes the text
     as its arguments, "auto" runs the --tool-call-parser. A choice that made calls and stopped
     normally finishes with "tool_calls".
Streaming applies the same rules piece by piece (ChoiceStream): reasoning and content as they
come; a named function's arguments as they come; "required" calls once the array is complete;
"auto" calls as the parser completes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from inferd.errors import InvalidRequestError
from inferd.gateway.openai.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from inferd.postprocess.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from inferd.postprocess.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    openai_call_id,
)
from inferd.sampling.structured import StructuredOutputsParams

Json = dict[str, Any]
ToolMode = Literal["none", "auto", "required", "named"]

# Parsers whose markers are special tokens, which detokenizing would otherwise drop.
_NEEDS_SPECIAL_TOKENS = frozenset({"mistral", "llama3_json"})
# Per parser: (trigger, text before a call's arguments with {name}, text after them).
_CALL_FORMATS = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', '{{"name": {name}, "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": {name}, "arguments": ', "}]"),
}
_ANY_OBJECT: Json = {"type": "object"}


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool and reasoning flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def chat_constraint(
    body: ChatCompletionRequest, settings: ToolSettings
) -> StructuredOutputsParams | None:
    """The one constraint of a chat request's output (see the module docstring); a 400 when
    two ask for different things or tool_choice "auto" is not enabled."""
    explicit = body.structured_params()
    if body.response_format is not None:
        fmt = body.response_format.params(disable_any_whitespace=False)
        if fmt is not None and explicit is not None:
            raise InvalidRequestError(
                "send response_format or structured_outputs, not both", "response_format"
            )
        explicit = explicit or fmt
    mode = body.tool_mode
    if mode in ("required", "named") and explicit is not None:
        raise InvalidRequestError(
            f"tool_choice {_choice_text(body)} constrains the output already; drop "
            "response_format / structured_outputs",
            "tool_choice",
        )
    if mode == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise InvalidRequestError(
            'tool_choice "auto" (the default when tools are sent) needs the server started '
            "with --enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice "
            '"required", "none" or a named function',
            "tool_choice",
        )
    tools = body.tools or []
    if mode == "required":
        return StructuredOutputsParams(json=_required_schema(tools, body.parallel_tool_calls))
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        return StructuredOutputsParams(json=_parameters(_tool(tools, body.tool_choice)))
    if mode == "auto" and explicit is None and any(t.function.strict for t in tools):
        assert settings.tool_call_parser is not None
        return _strict_tools_tag(tools, settings.tool_call_parser)
    return explicit


def skip_special_tokens(body: ChatCompletionRequest, settings: ToolSettings) -> bool | None:
    """False where the tool parser reads special tokens (`[TOOL_CALLS]`, `<|python_tag|>`);
    None: the request's own setting."""
    if body.tool_mode == "auto" and settings.tool_call_parser in _NEEDS_SPECIAL_TOKENS:
        return False
    return None


def _choice_text(body: ChatCompletionRequest) -> str:
    c = body.tool_choice
    return repr(c.function.name) if isinstance(c, NamedToolChoice) else f'"{c}"'


def _tool(tools: list[Tool], choice: NamedToolChoice) -> Tool:
    return next(t for t in tools if t.function.name == choice.function.name)


def _parameters(tool: Tool) -> Json:
    return tool.function.parameters or _ANY_OBJECT


def _required_schema(tools: list[Tool], parallel: bool) -> Json:
    """A JSON array of calls, each {"name": one tool's name, "parameters": its arguments}."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: Json = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _strict_tools_tag(tools: list[Tool], parser: str) -> StructuredOutputsParams | None:
    """The parser's call format as an xgrammar structural tag: text is free until the trigger,
    then a call must be one of the tools, its arguments matching its schema (any object for a
    tool that is not strict). None for a parser without a known format."""
    call_format = _CALL_FORMATS.get(parser)
    if call_format is None:
        return None
    trigger, begin, end = call_format
    tags = [
        {
            "type": "tag",
            "begin": begin.format(name=json.dumps(t.function.name)),
            "content": {
                "type": "json_schema",
                "json_schema": _parameters(t) if t.function.strict else _ANY_OBJECT,
            },
            "end": end,
        }
        for t in tools
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": False,
        },
    }
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))


# -- reading the output back --------------------------------------------------------------------


@dataclass(frozen=True)
class OutputRules:
    """How one chat request's text becomes a message (None from `for_request`: plain text)."""

    mode: ToolMode
    function: str | None = None
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    @classmethod
    def for_request(cls, body: ChatCompletionRequest, settings: ToolSettings) -> OutputRules | None:
        mode = body.tool_mode
        reasoning = settings.reasoning_parser
        if mode == "none" and reasoning is None:
            return None
        choice = body.tool_choice
        parser = settings.tool_call_parser if mode == "auto" else None
        return cls(
            mode=mode,
            function=choice.function.name if isinstance(choice, NamedToolChoice) else None,
            tool_parser=None if parser is None else get_tool_parser(parser),
            reasoning=None if reasoning is None else get_reasoning_parser(reasoning),
        )

    def message(self, text: str, finish_reason: str | None) -> tuple[Json, str | None]:
        """The final `message` object, and the finish_reason ("tool_calls" once calls were
        made and generation stopped normally)."""
        msg: Json = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            msg["content"] = split.content
            _set_reasoning(msg, split.reasoning)
        content, calls = self._tool_calls(msg["content"] or "")
        if self.mode != "none":
            msg["content"] = content
        if calls:
            msg["tool_calls"] = [_call_json(c) for c in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason

    def _tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "required":
            calls = _parse_required(text)
            return (None, calls) if calls else (text or None, [])
        if self.mode == "named":
            assert self.function is not None
            return None, [ToolCall(openai_call_id(), self.function, text.strip())]
        if self.tool_parser is not None:
            found = self.tool_parser.extract(text)
            return found.content, list(found.tool_calls)
        return text, []

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


def _parse_required(text: str) -> list[ToolCall]:
    """The calls of a "required" answer (a JSON array of {"name", "parameters"}); none if the
    text is not one (the generation was cut by max_tokens or a stop string)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return []
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ToolCall(openai_call_id(), item["name"], arguments))
    return calls


def _call_json(c: ToolCall) -> Json:
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }


def _set_reasoning(target: Json, reasoning: str | None) -> None:
    # `reasoning` is vLLM's current name; `reasoning_content` the one older clients read.
    target["reasoning"] = reasoning
    target["reasoning_content"] = reasoning


@dataclass
class ChoiceStream:
    """One streamed choice: text pieces in, `delta` fields out (content, reasoning,
    tool_calls), as OutputRules would give for the whole text."""

    rules: OutputRules
    reasoning: ReasoningStream | None = None
    tools: ToolCallStream | None = None
    held: list[str] = field(default_factory=list)  # a "required" answer, parsed at the end
    num_calls: int = 0

    def __post_init__(self) -> None:
        if self.rules.reasoning is not None:
            self.reasoning = self.rules.reasoning.stream()
        if self.rules.tool_parser is not None:
            self.tools = self.rules.tool_parser.stream()

    def feed(self, text: str) -> Json:
        if self.reasoning is None:
            return self._content(text)
        thought, content = self.reasoning.feed(text)
        return merge_delta(_reasoning_delta(thought), self._content(content))

    def finish(self) -> Json:
        delta: Json = {}
        if self.reasoning is not None:
            thought, content = self.reasoning.finish()
            delta = merge_delta(_reasoning_delta(thought), self._content(content))
        return merge_delta(delta, self._end_content())

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _content(self, text: str) -> Json:
        if not text:
            return {}
        mode = self.rules.mode
        if mode == "required":
            self.held.append(text)
            return {}
        if mode == "named":
            return self._named(text)
        if self.tools is not None:
            return self._calls(self.tools.feed(text))
        return {"content": text}

    def _named(self, text: str) -> Json:
        first = self.num_calls == 0
        self.num_calls = 1
        fragment: Json = {"index": 0, "function": {"arguments": text}}
        if first:
            fragment = {
                "index": 0,
                "id": openai_call_id(),
                "type": "function",
                "function": {"name": self.rules.function, "arguments": text},
            }
        return {"tool_calls": [fragment]}

    def _end_content(self) -> Json:
        if self.rules.mode == "required":
            text = "".join(self.held)
            calls = _parse_required(text)
            if not calls:
                return {"content": text} if text else {}
            self.num_calls = len(calls)
            return {"tool_calls": [dict(_call_json(c), index=i) for i, c in enumerate(calls)]}
        if self.tools is not None:
            return self._calls(self.tools.finish())
        return {}

    def _calls(self, d: Any) -> Json:
        out: Json = {}
        if d.content:
            out["content"] = d.content
        if d.tool_calls:
            out["tool_calls"] = [self._fragment(f) for f in d.tool_calls]
        return out

    def _fragment(self, f: ToolCallDelta) -> Json:
        self.num_calls = max(self.num_calls, f.index + 1)
        fragment: Json = {"index": f.index, "function": {"arguments": f.arguments}}
        if f.id is not None:
            fragment["id"] = f.id
            fragment["type"] = "function"
        if f.name is not None:
            fragment["function"]["name"] = f.name
        return fragment


def _reasoning_delta(text: str) -> Json:
    if not text:
        return {}
    out: Json = {}
    _set_reasoning(out, text)
    return out


def merge_delta(a: Json, b: Json) -> Json:
    """Two deltas as one: text fields concatenated, tool_call fragments in order."""
    out = dict(a)
    for key, value in b.items():
        if key in out:
            out[key] = out[key] + value
        else:
            out[key] = value
    return out
