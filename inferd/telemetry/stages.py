"""The one stage vocabulary of every request lane, and the typed carrier of a request's stage times.

Every place that names a stage uses `Stage`: the LLM lane's `RequestTimeline`, the classic lane's
pipeline, the Prometheus histograms (`inferd_request_<stage>_seconds` for the LLM lane,
`inferd_model_<stage>_seconds` for classic models), the OTel span names (`inferd.<stage>`) and
the `timings` object of every response. `Stage` is a `StrEnum`, so a member *is* its name
(`Stage.QUEUE == "queue"`) and serializes as one.

    router:        route (in `inferd router`, before the replica's own stages)
    LLM lane:      receive -> validate -> tokenize -> lora_load -> queue -> prefill -> decode
                   -> grammar -> detokenize -> stream
    classic lane:  receive -> validate -> preprocess -> queue -> batch -> compute_input -> infer
                   -> compute_output -> postprocess -> stream
    image lane:    receive -> validate -> lora_load -> queue -> text_encode -> denoise
                   -> vae_decode -> image_encode -> stream

    t = StageTimings()
    with t.measure(Stage.VALIDATE):
        check(request)
    t.add(Stage.QUEUE, 0.004, start=enqueued_at)
    t.as_dict()   # {"validate": 1.2e-05, "queue": 0.004} in lifecycle order

Times are CLOCK_MONOTONIC seconds (`time.monotonic()`), system-wide, so instants taken in the
engine process compare directly with the front's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum


class Stage(StrEnum):
    # First: the router's decision happens before a replica receives the request.
    ROUTE = "route"
    RECEIVE = "receive"
    VALIDATE = "validate"
    TOKENIZE = "tokenize"
    PREPROCESS = "preprocess"
    LORA_LOAD = "lora_load"
    QUEUE = "queue"
    TEXT_ENCODE = "text_encode"
    BATCH = "batch"
    PREFILL = "prefill"
    DECODE = "decode"
    DENOISE = "denoise"
    VAE_DECODE = "vae_decode"
    GRAMMAR = "grammar"
    COMPUTE_INPUT = "compute_input"
    INFER = "infer"
    COMPUTE_OUTPUT = "compute_output"
    DETOKENIZE = "detokenize"
    POSTPROCESS = "postprocess"
    IMAGE_ENCODE = "image_encode"
    STREAM = "stream"


# Stages in the order a request of each lane lives through them.
LLM_STAGES: tuple[Stage, ...] = (
    Stage.RECEIVE,
    Stage.VALIDATE,
    Stage.TOKENIZE,
    # A wait before scheduling, as the grammar's compile is, but the request's alone: only a
    # request naming a LoRA adapter not yet in host memory has it.
    Stage.LORA_LOAD,
    Stage.QUEUE,
    Stage.PREFILL,
    Stage.DECODE,
    # Ranked after decode, as detokenize: its per-step part runs inside prefill and decode, so an
    # exclusive tiling of the request (request_log.exclusive_path) shows only the compile wait.
    Stage.GRAMMAR,
    Stage.DETOKENIZE,
    Stage.STREAM,
)
CLASSIC_STAGES: tuple[Stage, ...] = (
    Stage.RECEIVE,
    Stage.VALIDATE,
    Stage.PREPROCESS,
    Stage.QUEUE,
    Stage.BATCH,
    Stage.COMPUTE_INPUT,
    Stage.INFER,
    Stage.COMPUTE_OUTPUT,
    Stage.POSTPROCESS,
    Stage.STREAM,
)
IMAGE_STAGES: tuple[Stage, ...] = (
    Stage.RECEIVE,
    Stage.VALIDATE,
    Stage.LORA_LOAD,
    Stage.QUEUE,
    # At admission, batched across the requests admitted together.
    Stage.TEXT_ENCODE,
    Stage.DENOISE,
    Stage.VAE_DECODE,
    Stage.IMAGE_ENCODE,
    Stage.STREAM,
)
# The router in front of replicas (`inferd router`), added to the replica's `timings`.
ROUTER_STAGES: tuple[Stage, ...] = (Stage.ROUTE,)
# Not stages: spans over several stages, reported after the stages in `timings`.
SUMMARIES = ("ttft", "e2e")
_ORDER = {stage: i for i, stage in enumerate(Stage)}

# One line per stage: the Prometheus HELP text and the dashboard's legend.
STAGE_HELP: dict[Stage, str] = {
    Stage.ROUTE: "The router choosing a replica (tokenize, prefix match, load) before forwarding",
    Stage.RECEIVE: "Receiving and decoding the request body (HTTP/gRPC, JSON or tensors)",
    Stage.VALIDATE: "Semantic checks (model, parameters, shapes, context window)",
    Stage.TOKENIZE: "Chat template and tokenizer",
    Stage.PREPROCESS: "Preprocessing steps (tokenize, image decode/resize, audio features)",
    Stage.TEXT_ENCODE: "Image lane: the prompt and negative prompt through the text encoder(s)",
    Stage.LORA_LOAD: "Waiting for the request's LoRA adapter to load from disk (a cold adapter)",
    Stage.QUEUE: "Waiting in the admission queue until scheduled (or a free model instance)",
    Stage.GRAMMAR: "Structured outputs: waiting for the grammar to compile, and masking logits",
    Stage.BATCH: "Batch formation: the wait inside the batching window (max_queue_delay)",
    Stage.PREFILL: "First scheduled to first token (prompt processing)",
    Stage.DECODE: "First token to last token",
    Stage.DENOISE: "Image lane: first denoising step scheduled to the last one done",
    Stage.VAE_DECODE: "Image lane: latents to pixels through the VAE decoder (batched)",
    Stage.COMPUTE_INPUT: "Concatenating and padding the batch's inputs",
    Stage.INFER: "The backend's forward pass over the whole batch",
    Stage.COMPUTE_OUTPUT: "Splitting the batch's outputs back per request",
    Stage.DETOKENIZE: "Engine-side incremental detokenization, summed over steps",
    Stage.POSTPROCESS: "Postprocessing steps (softmax, pooling, NMS, classification labels)",
    Stage.IMAGE_ENCODE: "Image lane: pixels to PNG, JPEG or WebP bytes",
    Stage.STREAM: "Serializing and sending the response or its chunks",
}


@dataclass
class StageTimings:
    """Seconds per stage of one request (a stage measured in pieces, such as `stream`, sums
    them), and the first start instant of each stage that has one (for spans and waterfalls)."""

    seconds: dict[Stage, float] = field(default_factory=dict)
    starts: dict[Stage, float] = field(default_factory=dict)

    def add(self, stage: Stage, seconds: float, start: float | None = None) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + max(seconds, 0.0)
        if start is not None:
            self.starts.setdefault(stage, start)

    def set(self, stage: Stage, seconds: float, start: float | None = None) -> None:
        """Replaces the stage's seconds (a stage derived from instants, not summed)."""
        self.seconds[stage] = max(seconds, 0.0)
        if start is not None:
            self.starts.setdefault(stage, start)

    @contextmanager
    def measure(self, stage: Stage) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(stage, time.monotonic() - t0, t0)

    def get(self, stage: Stage) -> float | None:
        return self.seconds.get(stage)

    def __contains__(self, stage: object) -> bool:
        return stage in self.seconds

    def merge(self, other: StageTimings) -> None:
        """Sums `other` into this one (several backend requests serving one API request)."""
        for stage, seconds in other.seconds.items():
            self.add(stage, seconds, other.starts.get(stage))

    def as_dict(self, digits: int | None = 6) -> dict[str, float]:
        """`{stage: seconds}` in lifecycle order, rounded to microseconds (the `timings` form of
        a response body); `digits=None` leaves them unrounded (the access log's form)."""
        stages = ordered(self.seconds)
        if digits is None:
            return {str(s): self.seconds[s] for s in stages}
        return {str(s): round(self.seconds[s], digits) for s in stages}

    @classmethod
    def from_mapping(cls, seconds: Mapping[str, float]) -> StageTimings:
        """From a `timings` object; unknown keys are refused with ValueError."""
        return cls(seconds={Stage(k): float(v) for k, v in seconds.items()})


def ordered(stages: Iterable[Stage]) -> list[Stage]:
    return sorted(stages, key=_ORDER.__getitem__)
