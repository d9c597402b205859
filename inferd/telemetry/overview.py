"""The dashboard's live overview: rates, percentiles and stage shares of the recent window.

Computed only when someone reads it (each tick of an open dashboard), from the RequestLog's
records of the last `window_s` seconds plus the engine gauges, the classic models' batch
histograms and the image engines' counters; nothing here runs on the request path.

    {"window_s": 60, "llm": {"rps": 3.2, "output_tps": 410.0, "ttft": {"p50": ...}, ...,
     "stage_seconds": {"queue": 0.4, "prefill": 1.1, "decode": 9.8, "other": 0.02}},
     "classic": {"rps": ..., "models": {"fraud": {"batch_rows": 6.1, "padding_ratio": 0.0,
                                                  "queue_s": 0.3, "compute_s": 0.1}}},
     "image": {"rps": 0.4, "images_per_s": 0.8, "steps_per_s": 12.0, "rows_per_forward": 6.5,
               "queue": {"p50": ...}, "engine": {"running": 2, "waiting": 0}, ...}}

`stage_seconds` sums each record's exclusive path (RequestRecord.path), so the stages of a lane
add up to the summed e2e of its requests and read directly as shares of where the time went.

Each lane's `series` is its throughput and latency over the window, for the page's small plots
(`lane_series`): the window cut into `BUCKETS` buckets, oldest first, a request counted in the
bucket it finished in. Built from the records when read, so a page opened now shows the whole
window at once; gauges (queue depth, running) have no history here and the page keeps its own.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import Histogram

from inferd.telemetry.image_metrics import ImageEngineStats
from inferd.telemetry.metrics import EngineGauges
from inferd.telemetry.request_log import LANE_STAGES, OTHER, Lane, RequestLog, RequestRecord
from inferd.telemetry.stages import STAGE_HELP, Stage

PERCENTILES = (50, 90, 99)
BUCKETS = 30  # points of each lane's time series
# Inter-token gaps are one sample per token: the newest this many are enough for percentiles.
_MAX_GAP_SAMPLES = 20_000
_QUEUE_STAGES = (Stage.QUEUE, Stage.BATCH)
_COMPUTE_STAGES = (Stage.COMPUTE_INPUT, Stage.INFER, Stage.COMPUTE_OUTPUT)


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """Nearest-rank p50/p90/p99 in seconds; None without samples.

    >>> percentiles([0.1, 0.2, 0.3, 0.4])
    {'p50': 0.2, 'p90': 0.4, 'p99': 0.4}
    """
    if not values:
        return None
    ordered = sorted(values)
    return {f"p{p}": _nearest_rank(ordered, p) for p in PERCENTILES}


def _nearest_rank(ordered: Sequence[float], p: int) -> float:
    return round(ordered[max(-(-p * len(ordered) // 100) - 1, 0)], 6)


def lane_series(
    records: Sequence[RequestRecord],
    window_s: float,
    now: float,
    amount: Callable[[RequestRecord], float],
    latency: Callable[[RequestRecord], float | None],
) -> dict[str, object]:
    """`rate`: `amount` (requests, output tokens, images) per second in each bucket; `p50` and
    `p99`: of `latency` there (None: no request finished in it)."""
    bucket_s = window_s / BUCKETS
    start = now - window_s
    totals = [0.0] * BUCKETS
    latencies: list[list[float]] = [[] for _ in range(BUCKETS)]
    for r in records:
        i = min(max(int((r.arrival + r.e2e - start) / bucket_s), 0), BUCKETS - 1)
        totals[i] += amount(r)
        value = latency(r)
        if value is not None:
            latencies[i].append(value)
    for values in latencies:
        values.sort()
    return {
        "bucket_s": round(bucket_s, 6),
        "rate": [round(t / bucket_s, 3) for t in totals],
        "p50": [_nearest_rank(v, 50) if v else None for v in latencies],
        "p99": [_nearest_rank(v, 99) if v else None for v in latencies],
    }


def stage_seconds(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Exclusive seconds per stage (and `other`) summed over `records`."""
    out: dict[str, float] = {}
    for record in records:
        for name, a, b in record.path():
            out[name] = out.get(name, 0.0) + (b - a)
    return {k: round(v, 6) for k, v in out.items()}


def _lane(records: Sequence[RequestRecord], window_s: float, lane: Lane) -> dict[str, object]:
    ok = [r for r in records if not r.failed]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "rps": round(len(records) / window_s, 3),
        "e2e": percentiles([r.e2e for r in records]),
        "stage_order": [str(s) for s in LANE_STAGES[lane]] + [OTHER],
        "stage_help": {str(s): STAGE_HELP[s] for s in LANE_STAGES[lane]},
        "stage_seconds": stage_seconds(records),
    }


def _llm(records: Sequence[RequestRecord], window_s: float) -> dict[str, object]:
    gaps = list(itertools.islice(_newest_gaps(records), _MAX_GAP_SAMPLES))
    return {
        **_lane(records, window_s, "llm"),
        "output_tps": round(sum(r.output_tokens for r in records) / window_s, 3),
        "ttft": percentiles([r.ttft for r in records if r.ttft is not None]),
        "itl": percentiles(gaps),
    }


def _newest_gaps(records: Sequence[RequestRecord]) -> Iterable[float]:
    for record in reversed(records):
        yield from record.token_gaps


@dataclass(frozen=True)
class HistogramTotals:
    """Cumulative `_sum` and `_count` of one labelled histogram, per model."""

    sums: dict[str, float]
    counts: dict[str, float]

    @classmethod
    def read(cls, hist: Histogram) -> HistogramTotals:
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for family in hist.collect():
            for sample in family.samples:
                model = sample.labels.get("model", "")
                if sample.name.endswith("_sum"):
                    sums[model] = sample.value
                elif sample.name.endswith("_count"):
                    counts[model] = sample.value
        return cls(sums, counts)

    def mean_since(self, before: HistogramTotals | None, model: str) -> float | None:
        """The mean of the observations made since `before` (all of them when None)."""
        count = self.counts.get(model, 0.0)
        total = self.sums.get(model, 0.0)
        if before is not None:
            count -= before.counts.get(model, 0.0)
            total -= before.sums.get(model, 0.0)
        return None if count <= 0 else round(total / count, 4)


def _classic_models(
    records: Sequence[RequestRecord],
    rows: tuple[HistogramTotals, HistogramTotals | None],
    padding: tuple[HistogramTotals, HistogramTotals | None],
) -> dict[str, dict[str, object]]:
    models: dict[str, dict[str, object]] = {}
    names = sorted({r.model for r in records} | set(rows[0].counts))
    for model in names:
        mine = [r for r in records if r.model == model]
        models[model] = {
            "requests": len(mine),
            "failed": sum(r.failed for r in mine),
            "e2e": percentiles([r.e2e for r in mine]),
            "batch_rows": rows[0].mean_since(rows[1], model),
            "padding_ratio": padding[0].mean_since(padding[1], model),
            "queue_s": round(_stage_sum(mine, _QUEUE_STAGES), 6),
            "compute_s": round(_stage_sum(mine, _COMPUTE_STAGES), 6),
        }
    return models


def _stage_sum(records: Iterable[RequestRecord], stages: Sequence[Stage]) -> float:
    return sum(r.stages.seconds.get(s, 0.0) for r in records for s in stages)


@dataclass(frozen=True)
class ImageCounters:
    """Cumulative image-engine counters at one instant (see telemetry.image_metrics)."""

    steps: int = 0
    forwards: int = 0
    rows: int = 0
    running: int = 0
    waiting: int = 0

    @classmethod
    def read(cls, stats: Iterable[ImageEngineStats]) -> ImageCounters:
        out = cls()
        for s in stats:
            out = cls(
                out.steps + s.denoise_steps_total,
                out.forwards + s.unet_forwards_total,
                out.rows + s.unet_rows_total,
                out.running + s.running,
                out.waiting + s.waiting,
            )
        return out


@dataclass(frozen=True)
class BatchTotals:
    """Cumulative counters at one instant: the classic models' batch histograms and the LLM
    engine's prefix-cache tokens (a window's means and rates are differences of two)."""

    at: float
    rows: HistogramTotals
    padding: HistogramTotals
    prefix_queries: int = 0
    prefix_hits: int = 0
    # The image engines' counters, summed over the served image models.
    image: ImageCounters = ImageCounters()


def overview(
    log: RequestLog,
    window_s: float,
    engine: EngineGauges | None,
    batches: tuple[BatchTotals, BatchTotals | None],
    llm_model: str = "",
    image_models: Sequence[str] = (),
) -> dict[str, object]:
    """One overview snapshot. `batches`: now and the oldest snapshot inside the window."""
    now = time.monotonic()
    records = log.window(now - window_s)
    llm = [r for r in records if r.lane == "llm"]
    classic = [r for r in records if r.lane == "classic"]
    image = [r for r in records if r.lane == "image"]
    newest, oldest = batches
    return {
        "time": time.time(),
        "window_s": window_s,
        "requests_total": log.total,
        "llm": {
            "model": llm_model,
            **_llm(llm, window_s),
            "engine": None if engine is None else _engine(engine, newest, oldest),
            "series": lane_series(llm, window_s, now, lambda r: r.output_tokens, lambda r: r.ttft),
        },
        "classic": {
            **_lane(classic, window_s, "classic"),
            "series": lane_series(classic, window_s, now, lambda r: 1, lambda r: r.e2e),
            "models": _classic_models(
                classic,
                (newest.rows, None if oldest is None else oldest.rows),
                (newest.padding, None if oldest is None else oldest.padding),
            ),
        },
        "image": {
            "models": list(image_models),
            **_image(image, window_s, newest, oldest),
            "series": lane_series(image, window_s, now, lambda r: r.images, lambda r: r.e2e),
        },
    }


def _image(
    records: Sequence[RequestRecord],
    window_s: float,
    newest: BatchTotals,
    oldest: BatchTotals | None,
) -> dict[str, object]:
    """Images/s from the finished requests; steps/s and rows per UNet forward from the engines'
    counters over the window (since start until the window has an older snapshot)."""
    now = newest.image
    then = ImageCounters() if oldest is None else oldest.image
    seconds = window_s if oldest is None else max(newest.at - oldest.at, 1e-9)
    forwards = now.forwards - then.forwards
    return {
        **_lane(records, window_s, "image"),
        "images_per_s": round(sum(r.images for r in records) / window_s, 3),
        "steps_per_s": round((now.steps - then.steps) / seconds, 3) if oldest else None,
        "rows_per_forward": round((now.rows - then.rows) / forwards, 3) if forwards else None,
        "queue": percentiles([r.stages.seconds.get(Stage.QUEUE, 0.0) for r in records]),
        "denoise": percentiles([r.stages.seconds.get(Stage.DENOISE, 0.0) for r in records]),
        "engine": {"running": now.running, "waiting": now.waiting},
    }


def _engine(g: EngineGauges, newest: BatchTotals, oldest: BatchTotals | None) -> dict[str, object]:
    return {
        "running": g.running,
        "waiting": g.waiting,
        "queued": g.queued,
        "queue_depth": g.waiting + g.queued,
        "kv_cache_usage": round(g.kv_cache_usage, 4),
        "preemptions_total": g.preemptions_total,
        "spec_decode_acceptance_rate": _acceptance(g),
        "prefix_cache_hit_rate": _hit_rate(newest, oldest),
    }


def _acceptance(g: EngineGauges) -> float | None:
    """Speculative decoding's draft tokens accepted / verified since start; None (the page's
    "n/a") before any draft, and without speculation."""
    drafted = g.spec_decode_num_draft_tokens_total
    return None if drafted == 0 else round(g.spec_decode_num_accepted_tokens_total / drafted, 4)


def _hit_rate(newest: BatchTotals, oldest: BatchTotals | None) -> float | None:
    """Prompt tokens found in the prefix cache / prompt tokens looked up, over the window (since
    start until the window has an older snapshot); None (the page's "n/a") before any lookup."""
    queries, hits = newest.prefix_queries, newest.prefix_hits
    if oldest is not None and queries > oldest.prefix_queries:
        queries, hits = queries - oldest.prefix_queries, hits - oldest.prefix_hits
    return round(hits / queries, 4) if queries > 0 else None
