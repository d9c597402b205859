"""Prometheus metrics of the image lane, labelled by model (the served image model, not a style).

The image lane's stages from the one vocabulary (`inferd.telemetry.stages.IMAGE_STAGES`):

    receive -> validate -> text_encode -> lora_load -> queue -> denoise -> vae_decode
            -> image_encode -> stream

Per finished request (`ImageMetrics.observe`): `inferd_image_<stage>_seconds`,
`inferd_image_e2e_seconds` and `inferd_image_requests_total{model,outcome}`. The engine's
counters and gauges are read from `ImageEngineStats` when /metrics is scraped
(`ImageEngineCollector`): running and waiting requests, images, UNet forwards and the rows they
ran (rows per forward = rate(rows) / rate(forwards)), and request-steps (steps/s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.telemetry.metrics import LATENCY_BUCKETS, stage_histograms
from inferd.telemetry.request_log import RequestLog, RequestRecord
from inferd.telemetry.stages import IMAGE_STAGES, Stage
from inferd.telemetry.timeline import RequestTimeline

# "ok", or why the request did not finish: the client left ("abort"), a refusal the engine made
# ("invalid", "not_found", "queue_full", "queue_timeout"), or a failure ("error").
IMAGE_OUTCOMES = ("ok", "abort", "invalid", "not_found", "queue_full", "queue_timeout", "error")


def image_stage_metric_name(stage: Stage) -> str:
    """`denoise` -> `inferd_image_denoise_seconds`."""
    return f"inferd_image_{stage}_seconds"


class ImageEngineStats(Protocol):
    """What the collector reads of `inferd.diffusion.request.ImageEngineStats` (named here as
    a protocol: the diffusion package imports telemetry, not the other way round)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def images_total(self) -> int: ...
    @property
    def requests_total(self) -> int: ...
    @property
    def unet_forwards_total(self) -> int: ...
    @property
    def unet_rows_total(self) -> int: ...
    @property
    def denoise_steps_total(self) -> int: ...


# (metric name, help, ImageEngineStats attribute): gauges, then counters (without _total).
_GAUGES = (
    ("inferd_image_requests_running", "Image requests denoising now", "running"),
    ("inferd_image_requests_waiting", "Image requests in the admission queue", "waiting"),
)
_COUNTERS = (
    ("inferd_image_images", "Images the engine finished", "images_total"),
    (
        "inferd_image_engine_requests",
        "Requests the engine finished (any outcome)",
        "requests_total",
    ),
    (
        "inferd_image_unet_forwards",
        "UNet forwards (one per engine step and resolution bucket)",
        "unet_forwards_total",
    ),
    (
        "inferd_image_unet_rows",
        "Rows the UNet forwards ran (a guided request of n images: 2n rows a step)",
        "unet_rows_total",
    ),
    (
        "inferd_image_denoise_steps",
        "Request-steps advanced (each request once per forward it is in)",
        "denoise_steps_total",
    ),
)


class ImageEngineCollector(Collector):
    """Reads every image engine's stats when Prometheus scrapes."""

    def __init__(self, read: Callable[[], Mapping[str, ImageEngineStats]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        stats = sorted(self._read().items())
        for name, doc, attr in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            for model, s in stats:
                gauge.add_metric([model], getattr(s, attr))
            yield gauge
        for name, doc, attr in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["model"])
            for model, s in stats:
                counter.add_metric([model], getattr(s, attr))
            yield counter

    def describe(self) -> Iterable[Metric]:
        return []


class ImageMetrics:
    """Registers the image lane's metrics in the server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stages = stage_histograms(registry, IMAGE_STAGES, image_stage_metric_name, ["model"])
        self.e2e = Histogram(
            "inferd_image_e2e_seconds",
            "Image request arrival (HTTP/gRPC) to its last byte sent",
            ["model"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "inferd_image_requests",
            "Image requests the gateway finished, by outcome",
            ["model", "outcome"],
            registry=registry,
        )
        self._registry = registry
        # Where finished requests are also recorded for the dashboard; None: nowhere.
        self.request_log: RequestLog | None = None

    def watch_engines(self, read: Callable[[], Mapping[str, ImageEngineStats]]) -> None:
        self._registry.register(ImageEngineCollector(read))

    def observe(
        self,
        model: str,
        timeline: RequestTimeline,
        outcome: str,
        lora: str | None,
        images: int,
        preview: Callable[[], str] | None = None,
    ) -> None:
        """One finished request: its stages, e2e and outcome (and its dashboard record, with
        `preview`: a data URL of its first image, made when the waterfall is read)."""
        for stage, seconds in timeline.stages.seconds.items():
            hist = self.stages.get(stage)
            if hist is not None:
                hist.labels(model).observe(seconds)
        if timeline.e2e is not None:
            self.e2e.labels(model).observe(timeline.e2e)
        self.requests.labels(model, outcome if outcome in IMAGE_OUTCOMES else "error").inc()
        if self.request_log is not None:
            record = image_record(timeline, model, outcome, lora, images)
            record.preview = preview
            self.request_log.add(record)


def image_record(
    timeline: RequestTimeline, model: str, outcome: str, lora: str | None, images: int
) -> RequestRecord:
    """The dashboard's record of a finished image request: one tick per denoising step (the
    timeline counts steps as its `num_output_tokens`, the front's instant of each)."""
    now = time.monotonic()
    end = timeline.finished if timeline.finished is not None else now
    stages = timeline.all_stages()
    return RequestRecord(
        request_id=timeline.request_id,
        lane="image",
        model=model,
        status=outcome,
        arrival=timeline.arrival,
        arrival_unix=time.time() - (now - timeline.arrival),
        e2e=max(end - timeline.arrival, 0.0),
        stages=stages,
        error=None if outcome == "ok" else outcome,
        output_tokens=timeline.num_output_tokens,
        token_gaps=timeline.token_gaps,
        last_token_at=timeline.last_token_at,
        lora=lora,
        images=images,
        source=timeline,
    )
