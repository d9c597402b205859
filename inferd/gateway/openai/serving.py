"""One generation request from validated body to engine outputs, shared by HTTP and WebSocket.

    job = await prepare(state, body, "chat", request_id, arrival)   # 4xx before any queueing
    gen = await start(state, job)          # admission: 429/503 raised here, before any header
    async for chunk in stream_chunks(job, gen): ...        # or: await collect(job, gen)
    finalize(state, job)                   # metrics, trace (idempotent)

The first engine output is awaited before a response starts, so admission errors (queue full,
queue timeout, draining, dead engine) always get their own HTTP status; errors after that end a
stream with an error event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from inferd.admission.prompt_check import check_prompt
from inferd.engine.generate_request import GenerateRequest
from inferd.errors import ContextWindowError, InferdError, InvalidRequestError
from inferd.gateway.errors import APIError, bad_request, to_api_error
from inferd.gateway.openai.adapters import resolve_adapter
from inferd.gateway.openai.formatting import (
    ChoiceState,
    Decode,
    Envelope,
    Json,
    Kind,
    apply_delta,
    final_choice,
    record_logprobs,
    stream_choice,
    take_delta,
    usage,
)
from inferd.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferd.gateway.openai.tools import (
    ChoiceStream,
    OutputRules,
    ToolSettings,
    chat_constraint,
    merge_delta,
    skip_special_tokens,
)
from inferd.gateway.responses import Peeked
from inferd.gateway.state import EngineClient, GatewayState
from inferd.lora.request import LoRARequest
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams
from inferd.telemetry.stages import Stage
from inferd.telemetry.timeline import DisabledTimeline, RequestTimeline
from inferd.types import RequestOutput

Body = CompletionRequest | ChatCompletionRequest
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


@dataclass(frozen=True)
class Prompt:
    text: str | None
    ids: list[int]


@dataclass
class Job:
    """A validated, tokenized request and everything its response accumulates."""

    request_id: str
    kind: Kind
    body: Body
    prompts: list[Prompt]
    params: SamplingParams
    timeline: RequestTimeline
    envelope: Envelope
    num_logprobs: int | None
    # Chat answers read back with tools and/or a reasoning parser; None: plain text.
    rules: OutputRules | None = None
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    # Per choice index, while streaming with `rules`: its incremental reader.
    streams: dict[int, ChoiceStream] = field(default_factory=dict)
    # Completions with `echo`: per prompt, its text, which starts each of its choices.
    echo: list[str] | None = None
    # Per prompt index: its prompt tokens the prefix cache held (its `n` choices count it once).
    cached_tokens: dict[int, int] = field(default_factory=dict)
    finalized: bool = False
    # Non-streaming: when the encoded body was handed to the server to send.
    send_started: float | None = None
    # The adapter its `model` named; None: the served model.
    lora_request: LoRARequest | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())

    @property
    def all_finished(self) -> bool:
        n = len(self.prompts) * self.params.n
        done = sum(c.finish_reason is not None for c in self.choices.values())
        return done == n

    def finish_reasons(self) -> list[str]:
        """One per choice; a choice that never finished was aborted (client gone, error)."""
        n = len(self.prompts) * self.params.n
        return [
            (self.choices[i].finish_reason if i in self.choices else None) or "abort"
            for i in range(n)
        ]

    def usage(self) -> Json:
        return usage(self.prompt_tokens, self.completion_tokens, self.num_cached_tokens)


# -- prepare: everything that can fail with a 4xx, before the engine sees the request ----------


async def prepare(
    state: GatewayState, body: Body, kind: Kind, request_id: str, arrival: float
) -> Job:
    llm = state.engine()
    timeline = new_timeline(state, request_id, arrival)
    now = time.monotonic()
    timeline.add(Stage.RECEIVE, now - arrival, arrival)
    with timeline.measure(Stage.VALIDATE):
        lora = resolve_adapter(state, body.model)
        settings = tool_settings(state)
        params, num_logprobs = _params(body, settings)
        rules = None
        if isinstance(body, ChatCompletionRequest):
            rules = OutputRules.for_request(body, settings)
    t0 = time.monotonic()
    if _has_text(body):
        # Chat templates and tokenizers run in a thread: HF tokenizers releases the GIL.
        prompts = await asyncio.to_thread(tokenize_body, llm.tokenizer, body)
    else:
        # Token-id prompts need no tokenizer: a thread hop would cost more than the copy.
        prompts = tokenize_body(llm.tokenizer, body)
    timeline.add(Stage.TOKENIZE, time.monotonic() - t0, t0)
    with timeline.measure(Stage.VALIDATE):
        for p in prompts:
            _check_prompt(p.ids, params, llm)
    created = int(time.time())
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    model = state.model_name if lora is None else lora.lora_name
    envelope = Envelope(prefix + request_id, created, model, kind)
    job = Job(request_id, kind, body, prompts, params, timeline, envelope, num_logprobs, rules)
    job.lora_request = lora
    timeline.lora_name = None if lora is None else lora.lora_name
    if isinstance(body, CompletionRequest) and body.echo:
        job.echo = [p.text if p.text is not None else llm.tokenizer.decode(p.ids) for p in prompts]
    return job


def new_timeline(state: GatewayState, request_id: str, arrival: float) -> RequestTimeline:
    if state.server.telemetry:
        return RequestTimeline(request_id, arrival=arrival)
    return DisabledTimeline(request_id, arrival=arrival)


def tool_settings(state: GatewayState) -> ToolSettings:
    llm = state.llm
    return ToolSettings(
        enable_auto_tool_choice=state.server.enable_auto_tool_choice,
        tool_call_parser=state.server.tool_call_parser,
        reasoning_parser=None if llm is None else llm.info.reasoning_parser,
    )


def _params(body: Body, settings: ToolSettings) -> tuple[SamplingParams, int | None]:
    if isinstance(body, ChatCompletionRequest):
        max_tokens, num_logprobs = body.requested_max_tokens, body.num_logprobs
        structured = chat_constraint(body, settings)
        skip = skip_special_tokens(body, settings)
    else:
        max_tokens, num_logprobs = body.max_tokens, body.logprobs
        if not body.prompts():
            raise bad_request("prompt must not be empty", "prompt")
        structured, skip = body.structured_params(), None
    params = body.sampling_params(max_tokens, num_logprobs, structured, skip)
    return params, num_logprobs


def _has_text(body: Body) -> bool:
    if isinstance(body, ChatCompletionRequest):
        return True
    return any(isinstance(p, str) for p in body.prompts())


def tokenize_body(tok: Tokenizer, body: Body) -> list[Prompt]:
    if isinstance(body, ChatCompletionRequest):
        text = tok.apply_chat_template(
            [m.for_template() for m in body.messages], **_template_kwargs(body)
        )
        return [Prompt(text, tok.encode(text, add_special_tokens=False))]
    return [
        Prompt(p, tok.encode(p)) if isinstance(p, str) else Prompt(None, list(p))
        for p in body.prompts()
    ]


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The template's arguments from the body's fields; `chat_template_kwargs` overrides them
    (as vLLM's do), all but `messages`, which only the body's messages set."""
    extra = body.chat_template_kwargs or {}
    if "messages" in extra:
        raise bad_request(
            "chat_template_kwargs cannot set messages; send them as messages",
            "chat_template_kwargs",
        )
    tools = None
    if body.tools:
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
    return {
        "add_generation_prompt": body.add_generation_prompt and not body.continue_final_message,
        "tools": tools,
        "continue_final_message": body.continue_final_message,
        **extra,
    }


def _check_prompt(ids: list[int], params: SamplingParams, llm: EngineClient) -> None:
    """The engine's own checks, done here so a bad request is refused before it is queued."""
    info = llm.info
    try:
        check_prompt(
            ids, params.max_tokens, max_model_len=info.max_model_len, vocab_size=info.vocab_size
        )
    except ContextWindowError as e:
        raise bad_request(str(e), e.param, "context_length_exceeded") from None
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None


# -- start: admission ----------------------------------------------------------------------------


async def start(state: GatewayState, job: Job) -> OutputStream:
    """Submits every prompt and waits for the first output, so admission errors raise here.

    The returned iterator must be closed (`aclose`) by the caller: closing aborts whatever is
    still running in the engine."""
    llm = state.engine()
    body = job.body
    timeout = body.timeout
    streams = []
    job.timeline.mark_enqueued()
    for i, p in enumerate(job.prompts):
        rid = job.request_id if len(job.prompts) == 1 else f"{job.request_id}-{i}"
        streams.append(
            llm.generate(
                GenerateRequest(
                    rid,
                    p.ids,
                    job.params,
                    prompt=p.text,
                    priority=body.priority,
                    timeout_s=timeout,
                    timeline=job.timeline,
                    lora_request=job.lora_request,
                )
            )
        )
    outputs = _merged(streams)
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        raise InferdError("the engine ended the request without output") from None
    except BaseException:
        await outputs.aclose()
        raise
    return OutputStream(first, outputs)


OutputStream = Peeked[tuple[int, RequestOutput]]


async def _aclose(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> Outputs:
    """(prompt index, output) from every stream, as they come."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is not None:
                yield i, item
            else:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    i: int,
    stream: AsyncIterator[RequestOutput],
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]],
) -> None:
    try:
        async for out in stream:
            queue.put_nowait((i, out, None))
        queue.put_nowait((i, None, None))
    except Exception as e:
        queue.put_nowait((i, None, e))
    finally:
        await _aclose(stream)


# -- consume: outputs -> choices -------------------------------------------------------------


def consume(job: Job, decode: Decode, i: int, out: RequestOutput) -> list[Json]:
    """Folds one output into the job; returns the stream choices it produced."""
    now = time.monotonic()
    job.timeline.update_from_engine(out.metrics, out.request_id)
    job.cached_tokens[i] = max(job.cached_tokens.get(i, 0), out.metrics.num_cached_tokens)
    job.timeline.on_tokens(sum(len(c.token_ids) for c in out.outputs), now)
    produced = []
    for c in out.outputs:
        index = i * job.params.n + c.index
        st = job.choices.get(index)
        if st is None:
            st = job.choices[index] = ChoiceState(index)
        if st.sent_finish:
            continue
        d = take_delta(c)
        st_first = not st.sent_role
        if st_first and job.echo is not None:
            d = replace(d, text=job.echo[i] + d.text)
        if not (d.text or d.token_ids or d.finish_reason or st_first):
            continue
        lp = None
        if job.num_logprobs is not None:
            lp = record_logprobs(st, job.kind, d, job.num_logprobs, decode)
        apply_delta(st, d)
        choice = stream_choice(job.kind, st, d, lp, st_first)
        if job.rules is not None:
            _read_back(job, job.rules, index, choice, d.text)
        produced.append(choice)
        st.sent_role = True
        st.sent_finish = d.finish_reason is not None
    return produced


def _read_back(job: Job, rules: OutputRules, index: int, choice: Json, text: str) -> None:
    """Replaces a stream chunk's plain `content` with what the rules read from it (reasoning,
    content, tool-call fragments); the finish chunk flushes what the reader held back."""
    reader = job.streams.get(index)
    if reader is None:
        reader = job.streams[index] = rules.stream()
    delta = choice["delta"]
    delta.pop("content", None)
    fields = reader.feed(text)
    if choice["finish_reason"] is not None:
        fields = merge_delta(fields, reader.finish())
        choice["finish_reason"] = reader.finish_reason(choice["finish_reason"])
    delta.update(fields)
    if "content" not in delta and "role" in delta:
        delta["content"] = ""


async def collect(job: Job, decode: Decode, outputs: OutputStream) -> Json:
    """The whole non-streaming response body."""
    try:
        async for i, out in outputs:
            consume(job, decode, i, out)
    finally:
        await outputs.aclose()
    want_lp = job.num_logprobs is not None
    choices = [
        final_choice(job.kind, job.choices[k], want_lp, job.rules) for k in sorted(job.choices)
    ]
    return job.envelope.response(choices, job.usage())


def encode_response(job: Job, result: Json) -> bytes:
    """The non-streaming body with `timings` last, its `stream` stage being this encoding (the
    send that follows is added to the metric once it is done, see `Job.send_started`)."""
    t0 = time.monotonic()
    encoded = orjson.dumps(result)
    t1 = time.monotonic()
    job.timeline.add(Stage.STREAM, t1 - t0, t0)
    timings = job.timeline.as_dict(t1)
    job.send_started = time.monotonic()
    if not timings:
        return encoded
    # Splice rather than re-encode: the body is already bytes, and `timings` must be measured
    # after the encode it reports.
    return encoded[:-1] + b',"timings":' + orjson.dumps(timings) + b"}"


async def stream_chunks(job: Job, decode: Decode, outputs: OutputStream) -> AsyncIterator[Json]:
    """Stream chunk objects; the last one carries `timings` (and `usage` when asked for).
    An error after the stream started becomes one final {"error": {...}} object."""
    timeline = job.timeline
    include_usage = job.body.include_usage
    try:
        async for i, out in outputs:
            choices = consume(job, decode, i, out)
            if not choices:
                continue
            chunk = job.envelope.chunk(choices)
            if job.all_finished and not include_usage:
                _add_timings(chunk, timeline)
            t0 = time.monotonic()
            yield chunk
            timeline.add(Stage.STREAM, time.monotonic() - t0, t0)
        if include_usage:
            chunk = job.envelope.chunk([])
            chunk["usage"] = job.usage()
            _add_timings(chunk, timeline)
            yield chunk
    except (InferdError, APIError) as e:
        yield to_api_error(e).body()
    finally:
        await outputs.aclose()


def _add_timings(chunk: Json, timeline: RequestTimeline) -> None:
    timings = timeline.as_dict(time.monotonic())
    if timings:
        chunk["timings"] = timings


def finalize(state: GatewayState, job: Job) -> None:
    """Records the finished request in metrics and traces; safe to call more than once."""
    if job.finalized:
        return
    job.finalized = True
    if not state.server.telemetry:
        return
    timeline = job.timeline
    timeline.finish()
    state.metrics.observe_request(timeline, job.prompt_tokens, job.finish_reasons())
    if state.tracer is not None:
        attrs = {
            "inferd.kind": job.kind,
            "inferd.prompt_tokens": job.prompt_tokens,
            "inferd.cached_tokens": job.num_cached_tokens,
            "inferd.completion_tokens": job.completion_tokens,
        }
        with suppress(Exception):
            state.tracer.export(timeline, attrs)


def token_decoder(tok: Tokenizer) -> Decode:
    def decode(tid: int) -> str:
        return tok.decode([tid], skip_special_tokens=False)

    return decode
