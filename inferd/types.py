"""Typed messages between the engine's stages.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler.update_from_output
engine --RequestOutput--> the caller (offline API, later the server).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.scheduler.request import Request


@dataclass
class ScheduledChunk:
    """Tokens of one request computed in one step: request.all_token_ids[start:start+num_tokens]."""

    request: Request
    start: int
    num_tokens: int
    # The request's whole block table after this step's allocation (covers start + num_tokens).
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the known tokens: its last position samples."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Requests preempted (freed, back to waiting) while making this step.
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, the sampled token plus the top-N alternatives.
SampleLogprobs = dict[int, Logprob]


@dataclass
class ModelRunnerOutput:
    """One sampled token per chunk that samples, in the order of SchedulerOutput.chunks."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    # Aligned with req_ids; None where the request asked for no logprobs.
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What generate() returns per prompt, and what a stream yields as it grows (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
