"""Turns scheduler updates into RequestOutputs: detokenize, apply stop strings, gather logprobs.

One RequestState per caller request; each of its `n` choices is one scheduler Request (a child).
Stop strings are found here, on text, so the engine tells the scheduler to finish those children.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import tokenizers

from inferd.postprocess.text_stream import TextStream
from inferd.scheduler.request import Request, RequestStatus
from inferd.types import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds everything so far
    DELTA = "delta"  # every output holds only what is new since the last one (streaming)
    FINAL_ONLY = "final_only"  # one output when the request ends (offline generate)


@dataclass
class Choice:
    index: int
    request: Request
    stream: TextStream
    num_seen_tokens: int = 0
    text: str = ""
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    status: RequestStatus | None = None  # why it finished
    # Text and token ids not yet handed out (DELTA mode).
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    num_emitted_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[Choice]
    output_kind: OutputKind
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Wall seconds spent detokenizing and matching stop strings for this request, all choices.
    detokenize_s: float = 0.0
    # Structured outputs: the wait for the grammar, and this request's share of mask work.
    grammar_compile_s: float = 0.0
    grammar_mask_s: float = 0.0
    # The wait for its LoRA adapter to load (0: it was in host memory, or none).
    lora_load_s: float = 0.0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.choice_of: dict[str, tuple[RequestState, Choice]] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        children: list[Request],
        output_kind: OutputKind,
        grammar_compile_s: float = 0.0,
        lora_load_s: float = 0.0,
    ) -> None:
        choices = []
        for i, child in enumerate(children):
            params = child.sampling_params
            stream = TextStream(
                self.tokenizer,
                child.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            choice = Choice(index=i, request=child, stream=stream)
            choice.logprobs = [] if params.logprobs is not None else None
            choices.append(choice)
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            choices=choices,
            output_kind=output_kind,
            arrival_time=children[0].arrival_time,
            grammar_compile_s=grammar_compile_s,
            lora_load_s=lora_load_s,
        )
        self.states[request_id] = state
        for choice in choices:
            self.choice_of[choice.request.request_id] = (state, choice)

    def add_grammar_time(self, child_ids: list[str], seconds_each: float) -> None:
        for cid in child_ids:
            entry = self.choice_of.get(cid)
            if entry is not None:
                entry[0].grammar_mask_s += seconds_each

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        for cid in child_ids:
            entry = self.choice_of.get(cid)
            if entry is not None and entry[0].first_scheduled_time is None:
                entry[0].first_scheduled_time = now

    def process(
        self, updated: list[Request], logprobs: dict[str, list[SampleLogprobs] | None]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns outputs for callers and the child ids a stop string has finished."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for req in updated:
            entry = self.choice_of.get(req.request_id)
            if entry is None:
                continue
            state, choice = entry
            if state.first_token_time is None:
                state.first_token_time = now
            t0 = time.perf_counter()
            if self._advance(choice, req, logprobs.get(req.request_id)):
                stopped.append(req.request_id)
            state.detokenize_s += time.perf_counter() - t0
            touched[state.request_id] = state
        return self._emit(touched.values(), now), stopped

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[str]:
        """Finishes every unfinished choice with `status`; returns their child ids to free."""
        state = self.states.get(request_id)
        if state is None:
            return []
        ids = []
        t0 = time.perf_counter()
        for choice in state.choices:
            if choice.finish_reason is None:
                self._finish(choice, status)
                ids.append(choice.request.request_id)
        state.detokenize_s += time.perf_counter() - t0
        return ids

    def finish_children(self, children: list[Request]) -> list[str]:
        """Finishes the choices of children the scheduler already finished (their deadline
        passed) with each child's status; returns the ids of the requests they belong to."""
        touched: dict[str, None] = {}
        for child in children:
            entry = self.choice_of.get(child.request_id)
            if entry is None or entry[1].finish_reason is not None:
                continue
            state, choice = entry
            t0 = time.perf_counter()
            self._finish(choice, child.status)
            state.detokenize_s += time.perf_counter() - t0
            touched[state.request_id] = None
        return list(touched)

    def drain_aborted(self, request_ids: list[str]) -> list[RequestOutput]:
        # dict.fromkeys: one id may be listed twice (aborted, and expired in the same step).
        states = [self.states[r] for r in dict.fromkeys(request_ids) if r in self.states]
        return self._emit(states, time.monotonic())

    def _advance(self, choice: Choice, req: Request, lps: list[SampleLogprobs] | None) -> bool:
        """Takes the request's new tokens (more than one after a speculative step). A stop
        string is looked for after each token, as without speculation; the tokens after the one
        that completed it are dropped from the request."""
        if choice.finish_reason is not None:
            return False
        new_ids = req.output_token_ids[choice.num_seen_tokens :]
        if choice.logprobs is not None and lps is not None:
            choice.logprobs.extend(lps[: len(new_ids)])
        for i in range(len(new_ids)):
            delta = choice.stream.push(new_ids[i : i + 1])
            self._append_text(choice, delta.text)
            if delta.stop is not None:
                req.discard_outputs_after(choice.num_seen_tokens + i + 1)
                if choice.logprobs is not None:
                    del choice.logprobs[req.num_output_tokens :]
                self._take_ids(choice, new_ids[: i + 1])
                self._finish(choice, RequestStatus.FINISHED_STOPPED, delta.stop)
                return True
        self._take_ids(choice, new_ids)
        if req.status.finished:
            self._finish(choice, req.status, req.stop_reason)
        return False

    @staticmethod
    def _take_ids(choice: Choice, ids: list[int]) -> None:
        choice.num_seen_tokens += len(ids)
        choice.pending_ids.extend(ids)

    def _finish(
        self, choice: Choice, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        self._append_text(choice, choice.stream.finish())
        choice.finish_reason = status.finish_reason
        choice.stop_reason = stop_reason
        choice.status = status

    @staticmethod
    def _append_text(choice: Choice, text: str) -> None:
        if text:
            choice.text += text
            choice.pending_text += text

    def _emit(self, states: Iterable[RequestState], now: float) -> list[RequestOutput]:
        outputs = []
        for state in states:
            finished = state.finished
            if finished:
                state.finished_time = now
                self._forget(state)
            if state.output_kind is OutputKind.FINAL_ONLY and not finished:
                continue
            outputs.append(self._make_output(state, finished))
        return outputs

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.output_kind is OutputKind.DELTA
        completions = []
        for c in state.choices:
            completions.append(
                CompletionOutput(
                    index=c.index,
                    text=c.pending_text if delta else c.text,
                    token_ids=list(c.pending_ids) if delta else list(c.request.output_token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=_delta_logprobs(c) if delta else c.logprobs,
                    cumulative_logprob=_cumulative(c),
                    status=c.status,
                )
            )
            c.pending_text, c.pending_ids = "", []
            c.num_emitted_logprobs = len(c.logprobs or ())
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=_metrics(state),
        )

    def _forget(self, state: RequestState) -> None:
        self.states.pop(state.request_id, None)
        for c in state.choices:
            self.choice_of.pop(c.request.request_id, None)


def _delta_logprobs(c: Choice) -> list[SampleLogprobs] | None:
    # DELTA outputs carry only the new tokens' logprobs, so a stream sends each one once.
    return None if c.logprobs is None else c.logprobs[c.num_emitted_logprobs :]


def _cumulative(c: Choice) -> float | None:
    if not c.logprobs:
        return None
    ids = c.request.output_token_ids
    return sum(lp[t].logprob for lp, t in zip(c.logprobs, ids, strict=False) if t in lp)


def _metrics(state: RequestState) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=state.arrival_time,
        first_scheduled_time=state.first_scheduled_time,
        first_token_time=state.first_token_time,
        finished_time=state.finished_time,
        num_preemptions=sum(c.request.num_preemptions for c in state.choices),
        detokenize_s=state.detokenize_s,
        grammar_compile_s=state.grammar_compile_s,
        grammar_mask_s=state.grammar_mask_s,
        lora_load_s=state.lora_load_s,
        num_cached_tokens=max(c.request.num_cached_tokens or 0 for c in state.choices),
    )
