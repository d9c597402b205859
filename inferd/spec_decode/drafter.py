"""The engine's side of speculative decoding: drafts before a step, counters after it.

    drafter.propose(scheduler.running_requests())   # before schedule(): Request.draft_token_ids
    ... schedule -> execute (the runner verifies, executor/spec_verify.py) -> update ...
    drafter.observe(sched, runner_out)               # acceptance counters and the k policy

A request drafts when it is in steady decode (one known token to compute) and its grammar, if it
has one, applies (structured outputs: not while the model is still reasoning). Its k comes from
`AdaptiveK` (policy.py), from its own measured acceptance; the scheduler may verify fewer drafts
than proposed (budget, max_tokens). The drafts come from a `Proposer`, all decoding requests in
one call: n-gram lookup (ngram.py) or a draft model (draft_model.py). A grammar request's drafts
are proposed as any other's: the grammar masks every draft row, so a draft it refuses is rejected
at verification (sampling/grammar.py, `fill_draft_masks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inferd.config import SpeculativeConfig
from inferd.scheduler.output import SchedulerOutput
from inferd.scheduler.request import Request
from inferd.spec_decode.ngram import NgramProposer
from inferd.spec_decode.policy import AdaptiveK, recovered_acceptance, updated_acceptance
from inferd.types import ModelRunnerOutput


class Proposer(Protocol):
    """Where drafts come from: `propose_batch` gives each request up to its k drafts (k = 0:
    none; the proposer may give fewer); `release` forgets finished requests' state."""

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]: ...

    def release(self, request_ids: Sequence[str]) -> None: ...


@dataclass
class SpecDecodeCounters:
    """Since start (vLLM's spec_decode_* counters): chunks that verified drafts, their draft
    tokens, the drafts accepted, and accepted drafts by position (0 = the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """`proposer`: None for `config`'s n-gram lookup."""
        self.proposer = proposer or NgramProposer(config.lookup_min, config.lookup_max)
        self.policy = AdaptiveK(config.num_speculative_tokens, config.adaptive)
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: Sequence[Request]) -> None:
        """Sets each decoding request's drafts for the next step (policy.py chooses its k)."""
        decoding = [
            r
            for r in running
            if r.num_tokens - r.num_computed_tokens == 1 and (r.grammar is None or r.grammar.active)
        ]
        ks = [self.policy.choose(r.draft_acceptance, len(decoding)) for r in decoding]
        drafts = self.proposer.propose_batch(decoding, ks)
        for r, draft in zip(decoding, drafts, strict=True):
            r.draft_token_ids = draft
            if not draft:
                r.draft_acceptance = recovered_acceptance(r.draft_acceptance)

    def observe(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> tuple[int, int]:
        """Counts the step's verified and accepted drafts; returns (drafts, accepted)."""
        tokens = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        c = self.counters
        proposed = accepted = 0
        for chunk in sched.chunks:
            new = tokens.get(chunk.request.request_id)
            if not chunk.num_drafts or new is None:
                continue
            n = len(new) - 1  # the last new token was sampled, not drafted
            r = chunk.request
            r.draft_acceptance = updated_acceptance(r.draft_acceptance, chunk.num_drafts, n)
            c.num_drafts += 1
            proposed += chunk.num_drafts
            accepted += n
            for pos in range(n):
                c.accepted_per_pos[pos] += 1
        c.num_draft_tokens += proposed
        c.num_accepted_tokens += accepted
        return proposed, accepted
