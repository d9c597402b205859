"""A replica's load in tokens: the router's own in-flight accounting, corrected by what the
replica reports.

Counted at dispatch, not when a response starts (a router that counts late sends a burst of long
prompts all to one replica). Two parts, in the engine's currency:

    load = pending prefill tokens + decode_weight * sequences in flight

Pending prefill: the uncached prompt tokens of requests sent but not yet answering (first byte),
the work standing between a new request and its first token. Sequences in flight: each costs
`decode_weight` tokens of batch capacity until it finishes. The replica's own gauges
(`inferd_queued_prompt_tokens`, `inferd_num_requests_running` + `_waiting`) cover traffic other
routers sent; the larger of the two views wins, so a stale scrape can only raise the estimate
between scrapes, never hide the router's own fresh dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica's /metrics said at the last scrape."""

    running: int = 0
    waiting: int = 0
    queued: int = 0
    queued_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0
    # The replica's own prefix-cache counters (totals since it started), for the estimated vs
    # real hit rate, and its cache settings (`inferd_cache_config_info`), None when not exposed.
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    block_size: int | None = None
    num_blocks: int | None = None


@dataclass
class ReplicaLoad:
    prefill_tokens: int = 0
    in_flight: int = 0
    report: ReplicaReport = ReplicaReport()
    # Requests still prefilling, by the prefix index's stamp when each was dispatched: a block
    # stamped later may not be computed yet (router/index.py's correction leaves it alone).
    prefilling: dict[int, int] = field(default_factory=dict)

    def tokens(self, decode_weight: int) -> int:
        r = self.report
        prefill = max(self.prefill_tokens, r.queued_prompt_tokens)
        seqs = max(self.in_flight, r.running + r.waiting + r.queued)
        return prefill + decode_weight * seqs

    def settled(self, stamp: int) -> int:
        """Blocks stamped no later than this were stamped by requests already past their
        prefill (`stamp`: the index's newest, the answer when nothing is prefilling)."""
        return min(self.prefilling, default=stamp)


@dataclass(eq=False)
class Ticket:
    """One dispatched request's share of a replica's load, so it is undone exactly once (it
    holds the load object itself: a replica removed and re-added is a new one)."""

    replica: str
    load: ReplicaLoad
    prefill_tokens: int
    # The prefix index's newest stamp at dispatch, and the stamps of the prompt's leading blocks
    # the index then claimed the replica held, as far as they were settled (router/index.py).
    stamp: int = 0
    claim: tuple[int, ...] = ()
    started: bool = False
    done: bool = False

    @classmethod
    def dispatch(
        cls,
        replica: str,
        load: ReplicaLoad,
        prefill_tokens: int,
        stamp: int = 0,
        claim: tuple[int, ...] = (),
    ) -> Ticket:
        load.prefill_tokens += prefill_tokens
        load.in_flight += 1
        load.prefilling[stamp] = load.prefilling.get(stamp, 0) + 1
        return cls(replica, load, prefill_tokens, stamp, claim)

    def first_byte(self) -> None:
        """The replica answered: its prefill for this request is done."""
        if not self.started and not self.done:
            self.started = True
            self.load.prefill_tokens -= self.prefill_tokens
            if (left := self.load.prefilling.pop(self.stamp) - 1) > 0:
                self.load.prefilling[self.stamp] = left

    def finish(self) -> None:
        """Finished, failed or cancelled: the request holds nothing any more (idempotent)."""
        if self.done:
            return
        self.first_byte()
        self.done = True
        self.load.in_flight -= 1
