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
    """Tokens of one request computed in one step, positions start .. start + num_tokens - 1:
    request.all_token_ids[start:] followed by `draft_token_ids` (speculative decoding)."""

    request: Request
    start: int
    num_tokens: int  # drafts included
    # The request's whole block table after this step's allocation (covers start + num_tokens).
    block_ids: list[int]
    # Draft tokens verified in this step; only on a chunk that samples.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the known tokens: it samples at its last known
        position and at every draft position (num_drafts + 1 rows)."""
        return self.start + self.num_tokens - self.num_drafts == self.request.num_tokens

    def token_ids(self) -> list[int]:
        """The chunk's input ids: known tokens, then drafts."""
        end = self.start + self.num_tokens - self.num_drafts
        return self.request.all_token_ids[self.start : end] + self.draft_token_ids


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Requests preempted (freed, back to waiting) while making this step.
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
