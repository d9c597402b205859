"""One request's life, stage by stage, with the same stage names as the Prometheus histograms.

    tl = RequestTimeline("req-1", arrival=t_http_start)
    tl.add(Stage.RECEIVE, t_handler - t_http_start)
    with tl.measure(Stage.TOKENIZE):
        ids = tokenizer.encode(prompt)
    tl.mark_enqueued()                         # handed to the admission queue
    ...
    tl.update_from_engine(output.metrics)      # lora_load / queue / prefill / decode / detokenize
    tl.finish()
    tl.as_dict()  # {"receive": 0.0004, "tokenize": 0.0001, ..., "ttft": 0.021, "e2e": 0.35}

Times are CLOCK_MONOTONIC seconds (`time.monotonic()`), which is system-wide, so the engine
process's timestamps in RequestOutput.metrics compare directly with the front's.

Engine stages are derived from four instants, merged over every engine request that serves one
HTTP request (several prompts, or `n` choices): the earliest first-scheduled and first-token times
and the latest finish time. So `queue` ends when the first of them is scheduled, and `decode`
ends when the last one finishes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from inferd.telemetry.stages import Stage, StageTimings
from inferd.types import RequestMetrics


@dataclass
class RequestTimeline:
    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    # Front-side stages (receive, validate, tokenize, stream) with the first start of each (for
    # spans and waterfalls); a stage measured in pieces keeps the first start and sums the pieces.
    stages: StageTimings = field(default_factory=StageTimings)
    enqueued: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    engine_finished: float | None = None
    finished: float | None = None
    # Seconds between successive token deliveries seen by the front, per token.
    token_gaps: list[float] = field(default_factory=list)
    last_token_at: float | None = None
    num_output_tokens: int = 0
    # Engine request id -> its cumulative detokenization seconds (the latest value reported).
    detokenize_by_request: dict[str, float] = field(default_factory=dict)
    # Engine request id -> (grammar compile wait, its share of mask work), structured outputs.
    grammar_by_request: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Engine request id -> times the scheduler preempted it (the latest value reported).
    preemptions_by_request: dict[str, int] = field(default_factory=dict)
    # Engine request id -> seconds it waited for its LoRA adapter to load.
    lora_load_by_request: dict[str, float] = field(default_factory=dict)
    # The LoRA adapter the request named (its metrics' `lora` label); None: the base model.
    lora_name: str | None = None
    # The OTel trace of this request, once the tracer exported it (None with tracing off).
    trace_id: str | None = None
    # The W3C `traceparent` the request arrived with (a router's span): the request's own span
    # becomes its child.
    traceparent: str | None = None

    def add(self, stage: Stage, seconds: float, start: float | None = None) -> None:
        """Adds `seconds` to `stage` (stages such as `stream` are measured in many pieces)."""
        self.stages.add(stage, seconds, start)

    @contextmanager
    def measure(self, stage: Stage) -> Iterator[None]:
        with self.stages.measure(stage):
            yield

    def mark_enqueued(self, now: float | None = None) -> None:
        if self.enqueued is None:
            self.enqueued = time.monotonic() if now is None else now

    def on_tokens(self, num_new: int, now: float | None = None) -> None:
        """Records the arrival of `num_new` tokens in the front (one delivery may coalesce
        several engine steps: the gap is shared evenly among its tokens)."""
        if num_new <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.last_token_at is not None:
            gap = (now - self.last_token_at) / num_new
            self.token_gaps.extend([gap] * num_new)
        elif num_new > 1:
            self.token_gaps.extend([0.0] * (num_new - 1))
        self.last_token_at = now
        self.num_output_tokens += num_new

    def update_from_engine(self, metrics: RequestMetrics, engine_request_id: str = "") -> None:
        """Merges one RequestOutput.metrics (engine monotonic instants, and the request's
        cumulative `detokenize_s`) into the engine stages.

        Idempotent: calling it again with the same metrics changes nothing."""
        self.first_scheduled = _min(self.first_scheduled, metrics.first_scheduled_time)
        self.first_token = _min(self.first_token, metrics.first_token_time)
        self.engine_finished = _max(self.engine_finished, metrics.finished_time)
        self.detokenize_by_request[engine_request_id] = metrics.detokenize_s
        self.grammar_by_request[engine_request_id] = (
            metrics.grammar_compile_s,
            metrics.grammar_mask_s,
        )
        self.preemptions_by_request[engine_request_id] = metrics.num_preemptions
        self.lora_load_by_request[engine_request_id] = metrics.lora_load_s

    def finish(self, now: float | None = None) -> None:
        self.finished = time.monotonic() if now is None else now

    # -- derived ---------------------------------------------------------------------------------

    def engine_stages(self) -> StageTimings:
        """queue / prefill / decode from the engine's instants, detokenize from its sums."""
        out = StageTimings()
        compile_s = max((c for c, _ in self.grammar_by_request.values()), default=0.0)
        lora_s = max(self.lora_load_by_request.values(), default=0.0)
        if self.enqueued is not None and self.first_scheduled is not None:
            # The grammar's compile and the adapter's load are stages of their own, not
            # queueing; the engine waits on both at once, so the longer one is what they cost.
            queue_s = self.first_scheduled - self.enqueued - max(compile_s, lora_s)
            out.set(Stage.QUEUE, queue_s, self.enqueued)
        if lora_s:
            # It ends when the request could first be scheduled.
            start = None if self.first_scheduled is None else self.first_scheduled - lora_s
            out.set(Stage.LORA_LOAD, lora_s, start)
        if any(c or m for c, m in self.grammar_by_request.values()):
            mask_s = sum(m for _, m in self.grammar_by_request.values())
            # It starts with the compile wait, just before the first scheduling.
            start = None if self.first_scheduled is None else self.first_scheduled - compile_s
            out.set(Stage.GRAMMAR, compile_s + mask_s, start)
        if self.first_scheduled is not None and self.first_token is not None:
            out.set(Stage.PREFILL, self.first_token - self.first_scheduled, self.first_scheduled)
        if self.first_token is not None and self.engine_finished is not None:
            out.set(Stage.DECODE, self.engine_finished - self.first_token, self.first_token)
        if self.detokenize_by_request:
            detokenize_s = sum(self.detokenize_by_request.values())
            out.set(Stage.DETOKENIZE, detokenize_s, self.first_token)
        return out

    def all_stages(self) -> StageTimings:
        """The front's stages merged with the engine's (an engine stage replaces a front one)."""
        merged = StageTimings(dict(self.stages.seconds), dict(self.stages.starts))
        merged.starts.setdefault(Stage.RECEIVE, self.arrival)
        engine = self.engine_stages()
        merged.seconds.update(engine.seconds)
        for stage, start in engine.starts.items():
            merged.starts.setdefault(stage, start)
        return merged

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions_by_request.values())

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else max(self.first_token - self.arrival, 0.0)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else max(self.finished - self.arrival, 0.0)

    @property
    def time_per_output_token(self) -> float | None:
        """Decode seconds per token after the first (vLLM's TPOT); None with < 2 tokens."""
        decode = self.engine_stages().get(Stage.DECODE)
        if decode is None or self.num_output_tokens < 2:
            return None
        return decode / (self.num_output_tokens - 1)

    def as_dict(self, now: float | None = None) -> dict[str, float]:
        """Stage seconds in lifecycle order, then `ttft` and `e2e` (up to `now` when the request
        has not finished yet). Stages that did not happen are left out."""
        out = self.all_stages().as_dict()
        if self.ttft is not None:
            out["ttft"] = round(self.ttft, 6)
        end = self.finished if self.finished is not None else now
        if end is not None:
            out["e2e"] = round(max(end - self.arrival, 0.0), 6)
        return out


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


class DisabledTimeline(RequestTimeline):
    """The timeline of a server started with telemetry off (`--disable-telemetry`): it records
    nothing, so requests pay no per-token bookkeeping and responses carry no `timings`."""

    def add(self, stage: str, seconds: float, start: float | None = None) -> None:
        return None

    def on_tokens(self, num_new: int, now: float | None = None) -> None:
        return None

    def update_from_engine(self, metrics: RequestMetrics, engine_request_id: str = "") -> None:
        return None

    def as_dict(self, now: float | None = None) -> dict[str, float]:
        return {}
