"""Tool calls in a model's text (`tool_choice: "auto"`): hermes, llama3_json and mistral.

Each parser reads the text the model wrote, whole (`extract`) or as it streams (`stream`), and
splits it into content and tool calls in OpenAI's shape: a call's `arguments` is a JSON object as
a string, `json.dumps(..., ensure_ascii=False)` of what the model wrote, so equal calls compare
equal whatever spacing the model used.

The formats (as vLLM's parsers of the same names accept them; the full rules are on each class):

    hermes       Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>
    llama3_json  <|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", ...}
    mistral      Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]
                 Sure.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{...}

Rules common to all three:
- Content is the text outside the calls, stripped; None when empty.
- All or nothing: when one call in the text is malformed (JSON that does not parse, no string
  `name`, arguments that are not a JSON object), `extract` returns the whole text, stripped, as
  content and no calls. Nothing the model wrote is lost, and a half-understood answer never
  becomes a partial set of calls.
- `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]` and `<|python_tag|>` are special tokens: they are only in
  the text when it is detokenized with `skip_special_tokens=False` (mistral needs them; llama3_json
  works either way, the python tag being optional). `<tool_call>` is an ordinary added token in
  Qwen's and Hermes' vocabularies and survives the default.

Streaming. A stream is fed the text in pieces of any size and answers each with a StreamDelta:
- Content is sent as it arrives, except a tail that could still begin a call marker (`<tool` is
  held, `<toolbox` released), and whitespace, held until non-whitespace follows (so the pieces
  join to exactly `extract`'s stripped content, and no whitespace-only chunk is sent between
  calls). Leading whitespace and the whitespace left at `finish()` are dropped.
- Inside a call nothing is sent. When the call is complete and parses, two fragments go out
  together: `ToolCallDelta(index, id, name, "")` then `ToolCallDelta(index, arguments=...)` with
  the whole arguments string. The name is held back until then on purpose: a name sent early
  cannot be taken back when the JSON after it turns out malformed (vLLM streams a call with
  broken arguments then), and holding it makes a stream agree with `extract` on such text.
- The stream is `extract` run incrementally (`extract` is one feed of the whole text and a
  finish), so for any split of a text the stream's content and calls equal `extract`'s whenever
  `extract` finds calls, and whenever neither finds any. The one difference: a malformed call
  after well-formed ones were sent. Those cannot be taken back; from the malformed call on, the
  stream sends everything as content, where `extract` would have returned only content.
"""

# Over 500 lines because the three formats share one incremental machinery (regions, held
# markers, the all-or-nothing rule); a module per format would export its private pieces.

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from inferd.postprocess.stop_checker import held_suffix_len
from inferd.postprocess.text_stream import StrippedText


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex chars (mistral: 9 alphanumerics, see MistralToolParser)
    name: str
    arguments: str  # a JSON object as a string: json.dumps of the arguments, ensure_ascii=False


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of `delta.tool_calls` in a stream, in OpenAI's shape."""

    index: int  # position of the call in this choice's tool_calls (0, 1, ...)
    id: str | None = None  # set on the call's first fragment only
    name: str | None = None  # set on the call's first fragment only
    arguments: str = ""  # a piece of the arguments; the pieces join to ToolCall.arguments


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # text outside the tool calls, stripped; None when empty
    tool_calls: list[ToolCall]  # empty: no (valid) tool call, and everything is content


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""  # content text to send now
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ToolCallStream(ABC):
    """One choice's incremental parse. Feed it the model's text in pieces of any size."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The next piece of the model's output; returns what can be sent now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """End of output: flushes what was held back (an unfinished call, a partial marker)."""


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Content and tool calls of a whole output."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parse, one per choice."""


# --- what a call is -----------------------------------------------------------------------------


class _Malformed(Exception):
    """A call region that is not a well-formed tool call."""


def _loads(text: str) -> Any:
    """json.loads, but NaN and Infinity are refused (they are not JSON, and json.dumps would
    write them back into the arguments); any failure, nesting too deep included, is _Malformed."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise _Malformed(str(e)) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _arguments(value: object) -> str:
    """The arguments string of a call: a JSON object, normalized. Some models write the object
    as a JSON string (`"arguments": "{\\"x\\": 1}"`); that is unwrapped."""
    if isinstance(value, str):
        value = _loads(value)
    if not isinstance(value, dict):
        raise _Malformed("the arguments are not a JSON object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj: object, keys: tuple[str, ...], *, required: bool) -> tuple[str, str]:
    """(name, arguments) of `{"name": "f", <one of keys>: {...}}`.

    Without an arguments key the call has no arguments (`{}`) unless `required`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _Malformed("not a call: no name")
    present = [k for k in keys if k in obj]
    if len(present) > 1:
        raise _Malformed(f"both {present[0]!r} and {present[1]!r}")
    if not present:
        if required:
            raise _Malformed("no arguments")
        return obj["name"], "{}"
    return obj["name"], _arguments(obj[present[0]])


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonValue:
    """A JSON object or array arriving in pieces, collected until its brackets balance.

    The first character fed must be `{` or `[`. Brackets are counted outside strings only; whether
    the collected text is valid JSON is json.loads's call, once it is complete."""

    def __init__(self) -> None:
        self.text = ""  # the value's text so far
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the previous character was a backslash inside a string

    def feed(self, text: str) -> str | None:
        """The text after the value once the value is complete (`.text` is then the value);
        None while it is not."""
        for i, ch in enumerate(text):
            if self._closes(ch):
                self.text += text[: i + 1]
                return text[i + 1 :]
        self.text += text
        return None

    def _closes(self, ch: str) -> bool:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            return self._depth == 0
        return False


# --- streams ------------------------------------------------------------------------------------


class _Out:
    """What one feed() or finish() sends, collected in order."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def delta(self) -> StreamDelta:
        return StreamDelta("".join(self.content), tuple(self.calls))


class _Stream(ToolCallStream):
    """What every format's stream shares: the content channel and the numbering of calls."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._content = StrippedText()
        self._sent_calls = 0
        # A call failed to parse: extract() then returns the whole text as content, and the
        # stream sends the rest of the output as content.
        self.malformed = False

    def feed(self, text: str) -> StreamDelta:
        out = _Out()
        self._feed(text, out)
        return out.delta()

    def finish(self) -> StreamDelta:
        out = _Out()
        self._finish(out)
        return out.delta()

    @abstractmethod
    def _feed(self, text: str, out: _Out) -> None: ...

    @abstractmethod
    def _finish(self, out: _Out) -> None: ...

    def _send_content(self, out: _Out, text: str) -> None:
        piece = self._content.push(text)
        if piece:
            out.content.append(piece)

    def _send_calls(self, out: _Out, calls: Iterable[tuple[str, str]]) -> None:
        for name, arguments in calls:
            index = self._sent_calls
            out.calls.append(ToolCallDelta(index, self._new_id(), name, ""))
            out.calls.append(ToolCallDelta(index, arguments=arguments))
            self._sent_calls += 1


class _Region(ABC):
    """The text of one call region after its marker, fed until the call is complete."""

    def __init__(self) -> None:
        self.text = ""  # everything fed so far (sent as content if the call is malformed)

    @abstractmethod
    def feed(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        """The region's calls and the text after it once it is complete, None until then;
        raises _Malformed."""

    @abstractmethod
    def finish(self) -> list[tuple[str, str]]:
        """The calls of a region the output ended in; raises _Malformed."""


class _MarkerStream(_Stream):
    """Content with call regions, each beginning with `marker` (hermes, mistral).

    State: outside a region, `_tail` is the end of the content that might begin the marker (held
    back); inside one, `_region` collects its text until it is complete."""

    def __init__(
        self, new_id: Callable[[], str], marker: str, new_region: Callable[[], _Region]
    ) -> None:
        super().__init__(new_id)
        self._marker = marker
        self._new_region = new_region
        self._tail = ""
        self._region: _Region | None = None

    def _feed(self, text: str, out: _Out) -> None:
        while not self.malformed:
            if self._region is None:
                after = self._content_until_marker(self._tail + text, out)
                if after is None:
                    return
                self._region, text = self._new_region(), after
            try:
                done = self._region.feed(text)
            except _Malformed:
                self._fall_back(out)
                return
            if done is None:
                return
            calls, text = done
            self._send_calls(out, calls)
            self._region = None
        self._send_content(out, text)

    def _content_until_marker(self, text: str, out: _Out) -> str | None:
        """Sends the content before the marker and returns the text after it; without a marker,
        sends all but a tail that may begin one, and returns None."""
        start = text.find(self._marker)
        if start < 0:
            keep = held_suffix_len(text, (self._marker,), len(self._marker) - 1)
            self._send_content(out, text[: len(text) - keep])
            self._tail = text[len(text) - keep :]
            return None
        self._send_content(out, text[:start])
        self._tail = ""
        return text[start + len(self._marker) :]

    def _finish(self, out: _Out) -> None:
        if self._region is None:
            self._send_content(out, self._tail)
            self._tail = ""
            return
        try:
            calls = self._region.finish()
        except _Malformed:
            self._fall_back(out)
            return
        self._send_calls(out, calls)
        self._region = None

    def _fall_back(self, out: _Out) -> None:
        assert self._region is not None
        self.malformed = True
        self._send_content(out, self._marker + self._region.text)
        self._region = None


class _StreamingParser(ToolParser):
    """A parser whose extract() is its stream run over the whole text at once."""

    @staticmethod
    def _new_id() -> str:
        return openai_call_id()

    @abstractmethod
    def _stream(self) -> _Stream: ...

    def stream(self) -> ToolCallStream:
        return self._stream()

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self._stream()
        deltas = (stream.feed(text), stream.finish())
        if stream.malformed:
            return ExtractedToolCalls(text.strip() or None, [])
        content = "".join(d.content for d in deltas)
        fragments = [f for d in deltas for f in d.tool_calls]
        # _send_calls sends each call as two fragments: (id, name) then the whole arguments.
        calls = [
            ToolCall(head.id or "", head.name or "", body.arguments)
            for head, body in zip(fragments[::2], fragments[1::2], strict=True)
        ]
        return ExtractedToolCalls(content or None, calls)


# --- hermes -------------------------------------------------------------------------------------


class _HermesRegion(_Region):
    END: ClassVar[str] = "</tool_call>"

    def feed(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        searched = max(0, len(self.text) - len(self.END) + 1)  # an end can straddle the pieces
        self.text += text
        end = self.text.find(self.END, searched)
        if end < 0:
            return None
        return [self._parse(self.text[:end])], self.text[end + len(self.END) :]

    def finish(self) -> list[tuple[str, str]]:
        return [self._parse(self.text)]

    @staticmethod
    def _parse(body: str) -> tuple[str, str]:
        return _call(_loads(body), ("arguments",), required=False)


class HermesToolParser(_StreamingParser):
    """Hermes 2 Pro, Qwen2.5 and Qwen3: each call is a JSON object in a `<tool_call>` block.

        I'll check both.
        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Zürich"}}
        </tool_call>

    gives content "I'll check both." and two calls, the second with arguments
    '{"city": "Zürich"}'. Content is the text outside the blocks, wherever it is. A block's JSON
    is `{"name": str, "arguments": object}`; without "arguments" the call has none (`{}`). A
    block left open at the end of the output (the model stopped before `</tool_call>`) is parsed
    all the same.
    """

    name = "hermes"

    def _stream(self) -> _Stream:
        return _MarkerStream(self._new_id, "<tool_call>", _HermesRegion)


# --- mistral ------------------------------------------------------------------------------------

# The name part of `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`: [CALL_ID] is tokenizer v11's, [ARGS]
# is absent when the text was decoded without control tokens (vLLM accepts `name{...}` too).
_MISTRAL_NAME = re.compile(
    r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*"
)
_MAX_NAME_PART = 256  # longer without a `{`: not a call (the text is then content, not held)


class _MistralRegion(_Region):
    """After `[TOOL_CALLS]`: a JSON array of calls (first non-space character `[`), or a name
    part (see _MISTRAL_NAME) and the arguments object."""

    def __init__(self) -> None:
        super().__init__()
        self._value: _JsonValue | None = None
        self._name: str | None = None  # None: the array form

    def feed(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        self.text += text
        if self._value is None:
            start = self._value_start()
            if start is None:
                return None
            self._value, text = _JsonValue(), self.text[start:]
        rest = self._value.feed(text)
        if rest is None:
            return None
        return self._calls(_loads(self._value.text)), rest

    def finish(self) -> list[tuple[str, str]]:
        raise _Malformed("the output ended inside a call")

    def _value_start(self) -> int | None:
        head = self.text.lstrip()
        if head.startswith("["):
            return len(self.text) - len(head)
        brace = self.text.find("{")
        if brace < 0:
            if len(head) > _MAX_NAME_PART:
                raise _Malformed("no arguments after the name")
            return None
        name_part = self.text[:brace]
        match = _MISTRAL_NAME.fullmatch(name_part)
        if match is None or len(name_part.lstrip()) > _MAX_NAME_PART:
            raise _Malformed(f"not a function name: {name_part!r}")
        self._name = match.group(1)
        return brace

    def _calls(self, value: object) -> list[tuple[str, str]]:
        if self._name is not None:
            return [(self._name, _arguments(value))]
        if not isinstance(value, list) or not value:
            raise _Malformed("not a list of calls")
        return [_call(item, ("arguments",), required=False) for item in value]


class MistralToolParser(_StreamingParser):
    """Mistral: calls follow `[TOOL_CALLS]`, in either of mistral_common's encodings.

        Let me look.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", ...}]
        Let me look.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{...}

    both give content "Let me look." and the calls f and g. The first is the older tokenizers'
    (v3, v7: one JSON array of `{"name", "arguments"}` objects); the second v13's (one
    `[TOOL_CALLS]name[ARGS]{json}` per call; v11 puts `[CALL_ID]id` before `[ARGS]`, and without
    control tokens in the text only `name{json}` is left: both accepted). Text before, between or
    after the calls is content. The markers are control tokens: decode with
    `skip_special_tokens=False`.

    Call ids are 9 alphanumerics, not OpenAI's `call_...`: Mistral's chat templates and
    mistral_common refuse any other id when the call comes back in the history.
    """

    name = "mistral"

    @staticmethod
    def _new_id() -> str:
        return uuid.uuid4().hex[:9]

    def _stream(self) -> _Stream:
        return _MarkerStream(self._new_id, "[TOOL_CALLS]", _MistralRegion)


# --- llama3_json --------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


class _LlamaStream(_Stream):
    """States: "head" (deciding whether the output is calls), "call" (inside an object), "sep"
    (after a call: whitespace, `;`, whitespace), "content" (plain text: no call at the start,
    text after the calls, or the rest after a malformed call)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._state = "head"
        self._buf = ""  # text received and not yet consumed by the state
        self._raw = ""  # the current call's text from its start (sent as content if malformed)
        self._value = _JsonValue()

    def _feed(self, text: str, out: _Out) -> None:
        self._buf += text
        if self._state != "content":
            self._raw += text
        while self._state != "content" and self._step(out):
            pass
        if self._state == "content":
            self._send_content(out, self._buf)
            self._buf = ""

    def _step(self, out: _Out) -> bool:
        """Consumes what the state can; True when it moved to a state that may consume more."""
        if self._state == "head":
            return self._head()
        if self._state == "call":
            return self._in_call(out)
        return self._sep()

    def _head(self) -> bool:
        s = self._buf.lstrip()
        if s.startswith(_PYTHON_TAG):
            s = s[len(_PYTHON_TAG) :].lstrip()
        elif _PYTHON_TAG.startswith(s):  # nothing yet, or part of the tag
            return False
        if not s:
            return False
        return self._start_call(s) if s[0] == "{" else self._to_content()

    def _sep(self) -> bool:
        s = self._buf.lstrip()
        if not s:
            return False
        if s[0] != ";":
            return self._to_content()
        s = s[1:].lstrip()
        if not s:
            return False
        return self._start_call(s) if s[0] == "{" else self._to_content()

    def _in_call(self, out: _Out) -> bool:
        rest = self._value.feed(self._buf)
        self._buf = ""
        if rest is None:
            return False
        try:
            call = _call(_loads(self._value.text), ("parameters", "arguments"), required=True)
        except _Malformed:
            self.malformed = True
            self._buf = self._raw
            return self._to_content()
        self._send_calls(out, [call])
        self._state, self._buf, self._raw = "sep", rest, rest
        return True

    def _start_call(self, text: str) -> bool:
        self._state, self._buf, self._value = "call", text, _JsonValue()
        return True

    def _to_content(self) -> bool:
        self._state = "content"
        return False

    def _finish(self, out: _Out) -> None:
        if self._state == "call":  # the output ended inside an object: not a call
            self.malformed = True
            self._send_content(out, self._raw)
        elif self._state == "head":  # whitespace or part of the python tag: content
            self._send_content(out, self._buf)
        # "sep": whitespace and at most a dangling `;` after the last call, dropped
        self._buf = ""


class Llama3JsonToolParser(_StreamingParser):
    """Llama 3.1/3.2 JSON tool calling: the output *is* the calls, JSON objects separated by `;`.

        <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

    The python tag is optional (it is a special token, often decoded away). Arguments are under
    "parameters" (Meta's prompt format) or "arguments"; one of the two is required, since without
    markers any JSON answer with a "name" would otherwise pass for a call. An output that does not
    start (after whitespace and the tag) with `{` is plain content, tag included. After the last
    call, whitespace and a dangling `;` are dropped and any other text is content.
    """

    name = "llama3_json"

    def _stream(self) -> _Stream:
        return _LlamaStream(self._new_id)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name` (vLLM's `--tool-call-parser` names)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}") from None
