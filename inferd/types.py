"""Typed messages between the engine's stages (a leaf module: it imports nothing of inferd).

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler.update_from_output
engine --RequestOutput (+ RequestMetrics)--> the caller (offline API, the server's front).

SchedulerOutput and ScheduledChunk live in inferd.scheduler.output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Where a request is in the scheduler; the FINISHED_* values also say why it ended."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is terminal.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # Past its deadline after its first output token: a generation timeout.
    FINISHED_TIMEOUT = 6
    # Past its deadline before its first output token (still queued, or in prefill): a queue
    # timeout, which the server answers with an error instead of an empty completion.
    FINISHED_EXPIRED_WAITING = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_EXPIRED_WAITING: "timeout",
}


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, the sampled token plus the top-N alternatives.
SampleLogprobs = dict[int, Logprob]


@dataclass
class ModelRunnerOutput:
    """The new tokens of each chunk that samples, in the order of SchedulerOutput.chunks: one
    sampled token, after the drafts it accepted when the chunk verified drafts."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Aligned with req_ids, one per new token; None where the request asked for no logprobs.
    logprobs: list[list[SampleLogprobs] | None] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "timeout"; None while running
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    cumulative_logprob: float | None = None
    # Why the choice ended, finer than finish_reason (a "timeout" is a generation timeout or an
    # expiry before the first token); None while running.
    status: RequestStatus | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request passed the engine's milestones, as of the output that carries it.

    Instants are CLOCK_MONOTONIC seconds (system-wide, so the engine process's values compare
    with the front's); None until the milestone is reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Preemptions (by recompute) of the request's choices so far, summed over its `n` choices.
    num_preemptions: int = 0
    # Wall seconds spent detokenizing and matching stop strings, all choices, cumulative.
    detokenize_s: float = 0.0
    # Structured outputs: seconds waiting for the grammar to compile before the request could be
    # scheduled, and the request's share of the steps' mask work (fill, apply, advance).
    grammar_compile_s: float = 0.0
    grammar_mask_s: float = 0.0
    # Seconds waiting for its LoRA adapter to load from disk before it could be scheduled.
    lora_load_s: float = 0.0
    # Prompt tokens found in the prefix cache when the request was first scheduled: the most any
    # of its `n` choices found (they share one prompt, so it counts once); 0 until scheduled.
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """What generate() returns per prompt, and what a stream yields as it grows (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
