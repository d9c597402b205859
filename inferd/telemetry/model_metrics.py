"""Prometheus metrics of classic (repository) models, labelled by model.

The same stage vocabulary as the LLM path where the concept is the same (`receive`, `validate`,
`preprocess`, `queue`, `stream`), plus the dynamic batcher's own stages:

    receive -> validate -> preprocess -> queue -> batch -> compute_input -> infer
            -> compute_output -> postprocess -> stream

`batch` is batch formation: the part of a request's wait inside its batch's window (the
max_queue_delay that starts with the batch's oldest request); `queue` is the rest of the wait
(every instance busy). The three `compute_*` stages are Triton's (concatenate/pad, backend
call, split back). Batch size and padding ratio are histograms per executed batch; requests are
counted by outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferd.telemetry.metrics import LATENCY_BUCKETS

MODEL_STAGES = (
    "receive",
    "validate",
    "preprocess",
    "queue",
    "batch",
    "compute_input",
    "infer",
    "compute_output",
    "postprocess",
    "stream",
)
OUTCOMES = ("success", "invalid", "queue_full", "queue_timeout", "unavailable", "error")

_STAGE_HELP = {
    "receive": "HTTP/gRPC body receive and tensor decode",
    "validate": "Input tensors checked against the model config",
    "preprocess": "Preprocessing steps (tokenize, image decode/resize, audio features)",
    "queue": "Waiting for a free model instance (the wait beyond the batching window)",
    "batch": "Batch formation: the wait inside the batching window (max_queue_delay)",
    "compute_input": "Concatenating and padding the batch's inputs",
    "infer": "The backend's forward pass over the whole batch",
    "compute_output": "Splitting the batch's outputs back per request",
    "postprocess": "Postprocessing steps (softmax, pooling, NMS, classification labels)",
    "stream": "Encoding and sending the response",
}
# The latency buckets of the LLM stages, plus 50 µs for tiny tabular models.
_BUCKETS = (0.00005, *LATENCY_BUCKETS)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ModelObserver(Protocol):
    """What the per-model pipeline reports (inferd.batching.pipeline.ServedModel)."""

    def observe_request(self, model: str, timings: Mapping[str, float], outcome: str) -> None: ...

    def observe_batch(self, model: str, size: int, padding_ratio: float) -> None: ...


def model_stage_metric_name(stage: str) -> str:
    """`infer` -> `inferd_model_infer_seconds`."""
    return f"inferd_model_{stage}_seconds"


class ModelMetrics:
    """Registers its metrics in the server's registry (one /metrics for LLM and classic models)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stages = {
            s: Histogram(
                model_stage_metric_name(s),
                _STAGE_HELP[s],
                ["model"],
                registry=registry,
                buckets=_BUCKETS,
            )
            for s in MODEL_STAGES
        }
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

    def observe_request(self, model: str, timings: Mapping[str, float], outcome: str) -> None:
        for stage, seconds in timings.items():
            hist = self.stages.get(stage)
            if hist is not None:
                hist.labels(model).observe(seconds)
        self.requests.labels(model, outcome if outcome in OUTCOMES else "error").inc()

    def observe_batch(self, model: str, size: int, padding_ratio: float) -> None:
        self.batch_size.labels(model).observe(size)
        self.padding.labels(model).observe(padding_ratio)

    def observe_gateway(self, model: str, receive_s: float, stream_s: float) -> None:
        """The protocol layer's own stages (the pipeline measures everything in between)."""
        self.stages["receive"].labels(model).observe(receive_s)
        self.stages["stream"].labels(model).observe(stream_s)
