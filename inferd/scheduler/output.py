"""What one `Scheduler.schedule()` decides: the chunks of tokens the next engine step computes.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler.update_from_output

A leaf module (it imports only the Request it points at), so the executor and the shared types
can name a step's plan without importing the scheduler.
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
