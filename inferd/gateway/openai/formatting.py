"""RequestOutputs -> OpenAI JSON: choices, stream chunks, logprobs in both APIs' shapes, usage.

One `ChoiceState` per returned choice accumulates what a non-streaming response needs and
remembers what a stream has already sent (the role delta, the finish chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from inferd.types import CompletionOutput, SampleLogprobs

if TYPE_CHECKING:
    from inferd.gateway.openai.tools import OutputRules

Kind = Literal["completion", "chat"]
Decode = Callable[[int], str]
Json = dict[str, Any]


@dataclass
class ChoiceState:
    index: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_role: bool = False
    sent_finish: bool = False
    # Completions' text_offset runs over the whole choice's text.
    text_offset: int = 0
    logprobs: list[Json] = field(default_factory=list)  # chat "content" entries
    completion_logprobs: Json | None = None  # completions' column-wise lists

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(frozen=True)
class Delta:
    """What one RequestOutput brought for one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None


def take_delta(c: CompletionOutput) -> Delta:
    # A delta carries logprobs for its new tokens; keep only those if an older producer sends
    # the whole history (aligned at the end).
    lps = list(c.logprobs or [])
    if len(lps) > len(c.token_ids):
        lps = lps[len(lps) - len(c.token_ids) :]
    return Delta(c.text, list(c.token_ids), lps, c.finish_reason, c.stop_reason)


def apply_delta(state: ChoiceState, d: Delta) -> None:
    if d.text:
        state.text_parts.append(d.text)
    state.num_tokens += len(d.token_ids)
    if d.finish_reason is not None:
        state.finish_reason = d.finish_reason
        state.stop_reason = d.stop_reason


# -- logprobs ------------------------------------------------------------------------------------


def _token_text(tid: int, lp: SampleLogprobs, decode: Decode) -> str:
    entry = lp.get(tid)
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(tid)


def _top(lp: SampleLogprobs, n: int) -> list[tuple[int, float]]:
    ranked = sorted(lp.items(), key=lambda kv: kv[1].rank)
    return [(tid, e.logprob) for tid, e in ranked if e.rank <= n]


def chat_logprobs(d: Delta, num: int, decode: Decode) -> list[Json]:
    """Chat shape: one {"token", "logprob", "bytes", "top_logprobs": [...]} per token."""
    out = []
    for tid, lp in zip(d.token_ids, d.logprobs, strict=False):
        token = _token_text(tid, lp, decode)
        entry = lp.get(tid)
        top = []
        for alt, value in _top(lp, num):
            alt_text = _token_text(alt, lp, decode)
            top.append({"token": alt_text, "logprob": value, "bytes": list(alt_text.encode())})
        out.append(
            {
                "token": token,
                "logprob": entry.logprob if entry is not None else None,
                "bytes": list(token.encode()),
                "top_logprobs": top,
            }
        )
    return out


def completion_logprobs(d: Delta, num: int, decode: Decode, offset: int) -> Json:
    """Completions shape: column-wise tokens / token_logprobs / top_logprobs / text_offset.
    `top_logprobs` holds the top `num` plus the sampled token (so up to num + 1 entries)."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, lp in zip(d.token_ids, d.logprobs, strict=False):
        token = _token_text(tid, lp, decode)
        entry = lp.get(tid)
        tokens.append(token)
        values.append(entry.logprob if entry is not None else None)
        top = {_token_text(alt, lp, decode): v for alt, v in _top(lp, num)}
        if entry is not None:
            top.setdefault(token, entry.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def merge_completion_logprobs(acc: Json | None, new: Json) -> Json:
    if acc is None:
        return {k: list(v) for k, v in new.items()}
    for key, values in new.items():
        acc[key].extend(values)
    return acc


def record_logprobs(state: ChoiceState, kind: Kind, d: Delta, num: int, decode: Decode) -> Json:
    """Adds this delta's logprobs to the choice; returns the delta's own logprobs object."""
    if kind == "chat":
        entries = chat_logprobs(d, num, decode)
        state.logprobs.extend(entries)
        return {"content": entries}
    part = completion_logprobs(d, num, decode, state.text_offset)
    state.completion_logprobs = merge_completion_logprobs(state.completion_logprobs, part)
    state.text_offset += sum(len(t) for t in part["tokens"])
    return part


# -- bodies --------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Json:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache already held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def final_choice(
    kind: Kind, s: ChoiceState, want_logprobs: bool, rules: OutputRules | None = None
) -> Json:
    logprobs: Json | None = None
    if want_logprobs:
        logprobs = {"content": s.logprobs} if kind == "chat" else s.completion_logprobs
    common = {
        "index": s.index,
        "logprobs": logprobs,
        "finish_reason": s.finish_reason,
        "stop_reason": s.stop_reason,
    }
    if kind == "chat" and rules is not None:
        message, common["finish_reason"] = rules.message(s.text, s.finish_reason)
        return {**common, "message": message}
    if kind == "chat":
        return {**common, "message": {"role": "assistant", "content": s.text}}
    return {**common, "text": s.text}


def stream_choice(kind: Kind, s: ChoiceState, d: Delta, logprobs: Json | None, first: bool) -> Json:
    finish = d.finish_reason
    common = {"index": s.index, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        common["stop_reason"] = d.stop_reason
    if kind == "chat":
        delta: Json = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        return {**common, "delta": delta}
    return {**common, "text": d.text}


@dataclass(frozen=True)
class Envelope:
    """The fields every body and chunk of one request repeats."""

    id: str
    created: int
    model: str
    kind: Kind

    def response(self, choices: list[Json], use: Json) -> Json:
        """The non-streaming body; serving.encode_response appends `timings`."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._body(obj, choices) | {"usage": use}

    def chunk(self, choices: list[Json]) -> Json:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._body(obj, choices)

    def _body(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
