"""The recent finished requests of every lane, bounded and tail-sampled: what the dashboard reads.

    log = RequestLog()
    log.add(record)                     # O(log K): a deque append and a push on a K-heap
    log.get("3f2a...")                  # by the response's X-Request-Id
    log.recent(model="tiny", status="failed", slowest=True)

Three bounded stores, so the requests an operator needs stay even after the recent list has
rolled over (tail sampling):

- `recent`: the last `capacity` records, whatever they were;
- `failed`: the last `keep_failed` failed records;
- `slowest`: per lane, the `keep_slowest` slowest of the current window and of the one before
  (a window is `window_s` long; two generations so the slowest of a minute ago do not vanish the
  instant a window turns over).

Memory is bounded by `capacity + keep_failed + 4 * keep_slowest` records. Appending copies nothing
large: a record keeps references to the finished request's stage timings and token gaps, and the
waterfall JSON (`RequestRecord.timeline()`) is built only when someone asks for it, so a server
whose dashboard nobody opens pays one small object per request.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from inferd.telemetry.stages import (
    CLASSIC_STAGES,
    IMAGE_STAGES,
    LLM_STAGES,
    STAGE_HELP,
    Stage,
    StageTimings,
)
from inferd.telemetry.timeline import RequestTimeline

Lane = Literal["llm", "classic", "image"]
LANE_STAGES: dict[Lane, tuple[Stage, ...]] = {
    "llm": LLM_STAGES,
    "classic": CLASSIC_STAGES,
    "image": IMAGE_STAGES,
}
# Outcomes that are not failures: LLM finish reasons and the classic lane's success.
OK_STATUSES = frozenset({"ok", "stop", "length", "success"})
OTHER = "other"  # the waterfall's name for time no stage covers


@dataclass
class RequestContext:
    """The HTTP request being served, as the middleware set it: the classic pipeline reports
    its timings without a request id, so the log reads it from here, and keeps the record it
    made for the gateway's receive/stream report that follows."""

    request_id: str
    arrival: float  # time.monotonic()
    record: RequestRecord | None = None


current_request: ContextVar[RequestContext | None] = ContextVar("inferd_request", default=None)


@dataclass(eq=False)
class RequestRecord:
    """One finished request. `stages.starts` are monotonic instants; `e2e` ends the request."""

    request_id: str
    lane: Lane
    model: str
    status: str  # "ok", or why it failed: "timeout", "error", "abort", "invalid", ...
    arrival: float  # time.monotonic()
    e2e: float
    stages: StageTimings
    arrival_unix: float = field(default_factory=time.time)
    error: str | None = None
    ttft: float | None = None
    prompt_tokens: int = 0
    # LLM lane: output tokens; image lane: denoising steps (each a tick on the denoise stretch).
    output_tokens: int = 0
    num_preemptions: int = 0
    # The front's gap before each output token (denoising step) after the first, and the last
    # one's instant: enough to place a tick per token on the decode stretch (shared, not copied).
    token_gaps: Sequence[float] = ()
    last_token_at: float | None = None
    batch_size: int | None = None
    # Classic models: the other requests of the batch it ran in (their log ids).
    batch_mates: tuple[str, ...] = ()
    # LLM and image lanes: the LoRA adapter (style) it ran under; None: the base model.
    lora: str | None = None
    # Image lane: the images it produced, and a small preview of the first as a data URL, made
    # only when the waterfall is read (the record holds a thumbnail, not the image).
    images: int = 0
    preview: Callable[[], str] | None = field(default=None, repr=False)
    # The LLM timeline the record came from: the tracer names its trace after the record is made.
    source: RequestTimeline | None = field(default=None, repr=False)
    seq: int = -1  # order of arrival in the log (set by RequestLog.add)
    _path: list[tuple[str, float, float]] | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        return self.status not in OK_STATUSES

    def summary(self) -> dict[str, object]:
        """The list row: small, no per-stage or per-token data."""
        return {
            "request_id": self.request_id,
            "lane": self.lane,
            "model": self.model,
            "lora": self.lora,
            "status": self.status,
            "failed": self.failed,
            "error": self.error,
            "arrival": _iso(self.arrival_unix),
            "e2e": round(self.e2e, 6),
            "ttft": None if self.ttft is None else round(self.ttft, 6),
            "output_tokens": self.output_tokens,
            "images": self.images,
        }

    def timeline(self) -> dict[str, object]:
        """The waterfall: each stage as (start offset from arrival, seconds), the exclusive
        `path` that tiles [0, e2e] exactly (so its bars sum to e2e), and the token ticks."""
        bars = self._bars()
        return {
            **self.summary(),
            "arrival_unix": self.arrival_unix,
            "prompt_tokens": self.prompt_tokens,
            "num_preemptions": self.num_preemptions,
            "batch_size": self.batch_size,
            "batch_mates": list(self.batch_mates),
            "trace_id": None if self.source is None else self.source.trace_id,
            "preview": None if self.preview is None else self.preview(),
            "stage_order": [str(s) for s in LANE_STAGES[self.lane]],
            "stages": [
                {
                    "stage": str(s),
                    "start": round(a, 6),
                    "seconds": round(b - a, 6),
                    "help": STAGE_HELP[s],
                }
                for s, a, b in bars
            ],
            "path": [
                {"stage": name, "start": round(a, 6), "seconds": round(b - a, 6)}
                for name, a, b in self.path()
            ],
            "token_ticks": [round(t, 6) for t in self.token_ticks()],
        }

    def path(self) -> list[tuple[str, float, float]]:
        """The exclusive path (`exclusive_path`), computed once, when first read."""
        if self._path is None:
            self._path = exclusive_path(self._bars(), self.e2e, LANE_STAGES[self.lane])
        return self._path

    def _bars(self) -> list[tuple[Stage, float, float]]:
        """(stage, start, end) offsets from arrival, clipped to [0, e2e], in lifecycle order.
        A stage without a start instant (never the case for stages both lanes record) is
        left out of the picture rather than guessed."""
        out = []
        order = LANE_STAGES[self.lane]
        for stage in sorted(self.stages.seconds, key=_rank(order)):
            start = self.stages.starts.get(stage)
            if start is None:
                continue
            a = min(max(start - self.arrival, 0.0), self.e2e)
            b = min(a + self.stages.seconds[stage], self.e2e)
            out.append((stage, a, b))
        return out

    def token_ticks(self) -> list[float]:
        """Offsets from arrival at which the front received each output token."""
        if self.last_token_at is None or self.output_tokens == 0:
            return []
        gaps = list(self.token_gaps)[-(self.output_tokens - 1) :] if self.output_tokens > 1 else []
        t = self.last_token_at - self.arrival - sum(gaps)
        ticks = [t]
        for gap in gaps:
            t += gap
            ticks.append(t)
        return ticks


def exclusive_path(
    bars: Sequence[tuple[Stage, float, float]], e2e: float, order: tuple[Stage, ...]
) -> list[tuple[str, float, float]]:
    """Tiles [0, e2e]: each instant belongs to the earliest (in lifecycle order) stage running
    then, or to `other` when none is. Nested stages (detokenize inside decode, stream chunks sent
    while decoding) thus show in their own rows but not twice here, so the tiles sum to e2e.

    >>> exclusive_path([(Stage.QUEUE, 0.0, 1.0), (Stage.DECODE, 2.0, 3.0)], 4.0, LLM_STAGES)
    [('queue', 0.0, 1.0), ('other', 1.0, 2.0), ('decode', 2.0, 3.0), ('other', 3.0, 4.0)]
    """
    rank = _rank(order)
    cuts = sorted({0.0, e2e, *(a for _, a, _ in bars), *(b for _, _, b in bars)})
    tiles: list[tuple[str, float, float]] = []
    for a, b in itertools.pairwise(cuts):
        active = [s for s, sa, sb in bars if sa <= a and b <= sb and sb > sa]
        name = str(min(active, key=rank)) if active else OTHER
        if tiles and tiles[-1][0] == name:
            tiles[-1] = (name, tiles[-1][1], b)
        else:
            tiles.append((name, a, b))
    return tiles


@functools.cache
def _rank(order: tuple[Stage, ...]) -> Callable[[Stage], int]:
    # A stage of the other lane (never expected) sorts last rather than failing a request.
    return {s: order.index(s) if s in order else len(order) for s in Stage}.__getitem__


def _iso(unix: float) -> str:
    return (
        datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


class _SlowestWindow:
    """The K slowest records of the current and the previous window of one lane."""

    def __init__(self, k: int, window_s: float) -> None:
        self.k, self.window_s = k, window_s
        self.started = time.monotonic()
        self.current: list[tuple[float, int, RequestRecord]] = []  # min-heap on e2e
        self.previous: list[tuple[float, int, RequestRecord]] = []

    def add(self, record: RequestRecord, seq: int, now: float) -> None:
        if now - self.started >= self.window_s:
            # Two windows idle: nothing of the previous one is recent any more.
            self.previous = self.current if now - self.started < 2 * self.window_s else []
            self.current, self.started = [], now
        item = (record.e2e, seq, record)
        if self.k <= 0:
            return
        if len(self.current) < self.k:
            heapq.heappush(self.current, item)
        elif item > self.current[0]:
            heapq.heapreplace(self.current, item)

    def records(self) -> Iterator[RequestRecord]:
        for _, _, record in (*self.current, *self.previous):
            yield record


class RequestLog:
    """Bounded store of finished requests (see the module docstring). Single event loop only:
    records are added and read on the server's loop, so nothing here locks."""

    def __init__(
        self,
        capacity: int = 1000,
        keep_failed: int = 100,
        keep_slowest: int = 20,
        window_s: float = 300.0,
        llm_model: Callable[[], str] = lambda: "",
    ) -> None:
        """`llm_model`: the served LLM's name when a request finishes (it is known only once
        the engine has loaded)."""
        self.llm_model = llm_model
        self._recent: deque[RequestRecord] = deque(maxlen=capacity)
        self._failed: deque[RequestRecord] = deque(maxlen=keep_failed)
        self._slowest = {lane: _SlowestWindow(keep_slowest, window_s) for lane in LANE_STAGES}
        self._seq = itertools.count()
        self.total = 0  # records ever added (the dashboard's "requests seen")

    def add(self, record: RequestRecord) -> None:
        record.seq = next(self._seq)
        self._recent.append(record)
        if record.failed:
            self._failed.append(record)
        self._slowest[record.lane].add(record, record.seq, time.monotonic())
        self.total += 1

    def add_llm(
        self, timeline: RequestTimeline, prompt_tokens: int, finish_reasons: Sequence[str]
    ) -> None:
        self.add(llm_record(timeline, self.llm_model(), prompt_tokens, finish_reasons))

    def add_classic(
        self,
        model: str,
        timings: StageTimings,
        outcome: str,
        batch: Sequence[str] = (),
    ) -> None:
        record = classic_record(model, timings, outcome, batch)
        ctx = current_request.get()
        if ctx is not None:
            ctx.record = record
        self.add(record)

    def finish_classic(self, receive_s: float, stream_s: float) -> None:
        """The gateway's stages of the classic request being served (see `finish_classic`)."""
        ctx = current_request.get()
        if ctx is not None and ctx.record is not None:
            finish_classic(ctx.record, receive_s, stream_s)

    def __len__(self) -> int:
        return len(self._recent)

    def window(self, since: float) -> list[RequestRecord]:
        """Recent records that finished after monotonic instant `since`, oldest first."""
        out: list[RequestRecord] = []
        for record in reversed(self._recent):
            if record.arrival + record.e2e < since:
                break
            out.append(record)
        out.reverse()
        return out

    def retained(self) -> list[RequestRecord]:
        """Every record held (recent, failed and slowest), each once, newest first."""
        seen: dict[int, RequestRecord] = {}
        stores = (self._recent, self._failed, *(w.records() for w in self._slowest.values()))
        for store in stores:
            for record in store:
                seen.setdefault(id(record), record)
        return sorted(seen.values(), key=lambda r: r.seq, reverse=True)

    def get(self, request_id: str) -> RequestRecord | None:
        """The newest retained record with this id (a linear scan: only a reader pays it)."""
        for record in self.retained():
            if record.request_id == request_id:
                return record
        return None

    def recent(
        self,
        *,
        model: str | None = None,
        status: str | None = None,
        lane: str | None = None,
        slowest: bool = False,
        limit: int = 100,
    ) -> list[RequestRecord]:
        """Filtered rows, newest first (or slowest first). `status`: "ok", "failed" or one
        exact status ("timeout", "invalid", ...)."""
        rows = [
            r
            for r in self.retained()
            if (model is None or r.model == model)
            and (lane is None or r.lane == lane)
            and _status_matches(r, status)
        ]
        if slowest:
            rows.sort(key=lambda r: r.e2e, reverse=True)
        return rows[: max(limit, 0)]


def _status_matches(record: RequestRecord, status: str | None) -> bool:
    if status is None or status == "":
        return True
    if status == "failed":
        return record.failed
    if status == "ok":
        return not record.failed
    return record.status == status


# -- building records at the two places a request finishes ---------------------------------------

_LLM_ERRORS = {
    "timeout": "the request's generation timeout passed before it finished",
    "abort": "aborted: the client went away or the request was cancelled",
    "error": "the engine failed the request",
}


def llm_status(finish_reasons: Sequence[str]) -> str:
    """One status for a request of several choices: the first failing reason, else ok."""
    for reason in finish_reasons:
        if reason not in OK_STATUSES:
            return reason
    return "ok"


def llm_record(
    timeline: RequestTimeline, model: str, prompt_tokens: int, finish_reasons: Sequence[str]
) -> RequestRecord:
    """From a finished RequestTimeline (telemetry.timeline), at the moment metrics observe it."""
    status = llm_status(finish_reasons)
    now = time.monotonic()
    end = timeline.finished if timeline.finished is not None else now
    return RequestRecord(
        request_id=timeline.request_id,
        lane="llm",
        model=model,
        status=status,
        arrival=timeline.arrival,
        arrival_unix=time.time() - (now - timeline.arrival),
        e2e=max(end - timeline.arrival, 0.0),
        stages=timeline.all_stages(),
        error=_LLM_ERRORS.get(status, None if status == "ok" else status),
        ttft=timeline.ttft,
        prompt_tokens=prompt_tokens,
        output_tokens=timeline.num_output_tokens,
        num_preemptions=timeline.num_preemptions,
        token_gaps=timeline.token_gaps,
        last_token_at=timeline.last_token_at,
        lora=timeline.lora_name,
        source=timeline,
    )


def log_id(fallback: str) -> str:
    """The id the log will know the request being served by: the HTTP X-Request-Id the middleware
    set, else `fallback` (a gRPC request's own id)."""
    ctx = current_request.get()
    return ctx.request_id if ctx is not None else fallback


def classic_record(
    model: str,
    timings: StageTimings,
    outcome: str,
    batch: Sequence[str] = (),
) -> RequestRecord:
    """From the classic pipeline's report (ModelMetrics.observe_request), made at the moment the
    pipeline is done with the request; `finish_classic` adds the gateway's receive and stream.

    Stages without a start instant are laid end to end so that the last one ends now (they ran
    one after another: validate, preprocess, queue, batch, compute, postprocess). The request id
    and arrival come from the middleware's `current_request`; the error message from the
    exception the pipeline is raising, when it reports from its `finally` (Python keeps it in
    `sys.exc_info()` there)."""
    now = time.monotonic()
    ctx = current_request.get()
    stages = _classic_stages(timings, now)
    arrival = ctx.arrival if ctx is not None else min(stages.starts.values(), default=now)
    exc = sys.exc_info()[1]
    request_id = ctx.request_id if ctx is not None else f"classic-{next(_anonymous)}"
    return RequestRecord(
        request_id=request_id,
        lane="classic",
        model=model,
        status="ok" if outcome == "success" else outcome,
        arrival=arrival,
        arrival_unix=time.time() - (now - arrival),
        e2e=max(now - arrival, 0.0),
        stages=stages,
        error=None if outcome == "success" else (str(exc) if exc is not None else outcome),
        batch_size=len(batch) or None,
        batch_mates=tuple(i for i in batch if i != request_id),
    )


_anonymous = itertools.count(1)  # gRPC requests carry no X-Request-Id


def _classic_stages(timings: StageTimings, now: float) -> StageTimings:
    out = StageTimings(dict(timings.seconds), dict(timings.starts))
    end = now
    for stage in reversed(CLASSIC_STAGES):
        if stage in out.seconds and stage not in out.starts:
            end -= out.seconds[stage]
            out.starts[stage] = end
    return out


def finish_classic(record: RequestRecord, receive_s: float, stream_s: float) -> None:
    """The gateway's own stages, once the response is sent: receive from arrival, stream up to
    now; e2e now covers the whole HTTP exchange."""
    now = time.monotonic()
    record.stages.set(Stage.RECEIVE, receive_s, record.arrival)
    record.stages.set(Stage.STREAM, stream_s, now - stream_s)
    record.e2e = max(now - record.arrival, 0.0)
    record._path = None
