"""Prometheus metrics of classic (repository) models, labelled by model.

The classic lane's stages from the one vocabulary (`inferd.telemetry.stages.CLASSIC_STAGES`): the
LLM lane's names where the concept is the same, plus the dynamic batcher's own stages:

    receive -> validate -> preprocess -> queue -> batch -> compute_input -> infer
            -> compute_output -> postprocess -> stream

`batch` is batch formation: the part of a request's wait inside its batch's window (the
max_queue_delay that starts with the batch's oldest request); `queue` is the rest of the wait
(every instance busy). The three `compute_*` stages are Triton's (concatenate/pad, backend
call, split back). Batch size and padding ratio are histograms per executed batch; requests are
counted by outcome.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferd.telemetry.metrics import LATENCY_BUCKETS, stage_histograms
from inferd.telemetry.request_log import RequestLog
from inferd.telemetry.stages import CLASSIC_STAGES, Stage, StageTimings

OUTCOMES = ("success", "invalid", "queue_full", "queue_timeout", "unavailable", "error")

# The latency buckets of the LLM stages, plus 50 µs for tiny tabular models.
_BUCKETS = (0.00005, *LATENCY_BUCKETS)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ModelObserver(Protocol):
    """What the per-model pipeline reports (inferd.batching.pipeline.ServedModel)."""

    def observe_request(
        self, model: str, timings: StageTimings, outcome: str, batch: Sequence[str] = ()
    ) -> None: ...

    def observe_batch(self, model: str, size: int, padding_ratio: float) -> None: ...


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


# Triton's inference_stats fields -> the stages each one sums.
_TRITON_DURATIONS = {
    "queue": (Stage.QUEUE, Stage.BATCH),
    "compute_input": (Stage.COMPUTE_INPUT,),
    "compute_infer": (Stage.INFER,),
    "compute_output": (Stage.COMPUTE_OUTPUT,),
}
# The protocol layer's stages, outside the model pipeline's success/fail durations.
_OUTSIDE_PIPELINE = (Stage.RECEIVE, Stage.STREAM)


@dataclass
class ModelStats:
    """Triton's statistics extension for one model: cumulative counts and nanoseconds.

    `success`/`fail`: requests and their time inside the model pipeline (validate through
    postprocess); `queue` includes batch formation; the compute durations count each request
    with its batch's time, as Triton does. `inference_count` is rows executed,
    `execution_count` batches executed."""

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    durations: dict[str, _Duration] = field(
        default_factory=lambda: {k: _Duration() for k in _TRITON_DURATIONS}
    )
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0

    def on_request(self, timings: StageTimings, outcome: str) -> None:
        seconds = timings.seconds
        total = sum(v for k, v in seconds.items() if k not in _OUTSIDE_PIPELINE)
        (self.success if outcome == "success" else self.fail).add(total)
        if outcome != "success":
            return
        for name, stages in _TRITON_DURATIONS.items():
            self.durations[name].add(sum(seconds.get(s, 0.0) for s in stages))

    def on_batch(self, size: int) -> None:
        self.execution_count += 1
        self.inference_count += size
        self.last_inference_ms = int(time.time() * 1000)

    def as_triton(self, name: str, version: str) -> dict[str, Any]:
        inference_stats: dict[str, Any] = {
            "success": self.success.as_dict(),
            "fail": self.fail.as_dict(),
        }
        inference_stats |= {k: d.as_dict() for k, d in self.durations.items()}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": inference_stats,
            # Per-batch-size compute times are not kept (batch sizes are in the
            # inferd_model_batch_rows histogram), so none are claimed here.
            "batch_stats": [],
        }


def model_stage_metric_name(stage: Stage) -> str:
    """`infer` -> `inferd_model_infer_seconds`."""
    return f"inferd_model_{stage}_seconds"


class ModelMetrics:
    """Registers its metrics in the server's registry (one /metrics for LLM and classic models)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stages = stage_histograms(
            registry, CLASSIC_STAGES, model_stage_metric_name, ["model"], _BUCKETS
        )
        self.batch_size = Histogram(
            "inferd_model_batch_rows",
            "Rows (batch entries) in each executed batch",
            ["model"],
            registry=registry,
            buckets=_BATCH_BUCKETS,
        )
        self.padding = Histogram(
            "inferd_model_padding_ratio",
            "Padded elements / all elements of an executed batch's variable-length inputs",
            ["model"],
            registry=registry,
            buckets=_RATIO_BUCKETS,
        )
        self.requests = Counter(
            "inferd_model_requests",
            "Inference requests to repository models by outcome",
            ["model", "outcome"],
            registry=registry,
        )
        self._stats: dict[str, ModelStats] = {}
        self._children: dict[str, _ModelChildren] = {}
        # Where finished requests are also recorded for the dashboard; None: nowhere.
        self.request_log: RequestLog | None = None

    def _of(self, model: str) -> _ModelChildren:
        children = self._children.get(model)
        if children is None:
            stats = self._stats.setdefault(model, ModelStats())
            children = self._children[model] = _ModelChildren(self, model, stats)
        return children

    def observe_request(
        self, model: str, timings: StageTimings, outcome: str, batch: Sequence[str] = ()
    ) -> None:
        """One finished request: its stages, outcome, and the ids of the batch it ran in."""
        children = self._of(model)
        for stage, seconds in timings.seconds.items():
            children.stage(stage).observe(seconds)
        children.requests(outcome if outcome in OUTCOMES else "error").inc()
        children.stats.on_request(timings, outcome)
        if self.request_log is not None:
            self.request_log.add_classic(model, timings, outcome, batch)

    def observe_batch(self, model: str, size: int, padding_ratio: float) -> None:
        self.batch_size.labels(model).observe(size)  # once a batch: not worth a cache
        self.padding.labels(model).observe(padding_ratio)
        self._of(model).stats.on_batch(size)

    def statistics(self, models: Iterable[tuple[str, str]]) -> dict[str, Any]:
        """Triton's statistics JSON (`GET /v2/models[/{m}]/stats`, gRPC ModelStatistics) for
        (name, version) pairs; a model that has served nothing reports zeros."""
        return {
            "model_stats": [
                self._stats.get(name, ModelStats()).as_triton(name, version)
                for name, version in models
            ]
        }

    def observe_gateway(self, model: str, receive_s: float, stream_s: float) -> None:
        """The protocol layer's own stages (the pipeline measures everything in between)."""
        children = self._of(model)
        children.stage(Stage.RECEIVE).observe(receive_s)
        children.stage(Stage.STREAM).observe(stream_s)
        if self.request_log is not None:
            self.request_log.finish_classic(receive_s, stream_s)


class _ModelChildren:
    """One model's labelled metrics and statistics, each child looked up once, when first
    used (a series appears in /metrics only once observed): `labels()` on every observation
    (a lock, a tuple, a dict) cost the event loop several percent of its time at load."""

    def __init__(self, metrics: ModelMetrics, model: str, stats: ModelStats) -> None:
        self._metrics = metrics
        self._model = model
        self._stages: dict[Stage, Histogram] = {}
        self._requests: dict[str, Counter] = {}
        self.stats = stats

    def stage(self, stage: Stage) -> Histogram:
        child = self._stages.get(stage)
        if child is None:
            child = self._stages[stage] = self._metrics.stages[stage].labels(self._model)
        return child

    def requests(self, outcome: str) -> Counter:
        child = self._requests.get(outcome)
        if child is None:
            child = self._requests[outcome] = self._metrics.requests.labels(self._model, outcome)
        return child
