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

Blocks still being brought (`births`): a prompt's blocks a request is the first to bring to a
replica exist there only once that request's prefill step has run. The engine looks a request's
prefix up when it admits it and registers blocks after the step that computed them
(kv_cache/block_manager.py), so a request sent now finds such a block only if the request
bringing it is already being computed; if that one still waits behind another request's prefill,
both are admitted in the same step and the block is computed twice. `usable` counts a prompt's
indexed blocks up to the first of those.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    # Latent pixel-steps of the image requests in flight there (router/image_cost.py).
    image_work: int = 0
    report: ReplicaReport = ReplicaReport()
    # Requests still prefilling, by the prefix index's stamp when each was dispatched: a block
    # stamped later may not be computed yet (router/index.py's correction leaves it alone).
    prefilling: dict[int, int] = field(default_factory=dict)
    # Block hash -> the stamp of the request still prefilling that brought it here first.
    births: dict[int, int] = field(default_factory=dict)

    def tokens(self, decode_weight: int) -> int:
        r = self.report
        prefill = max(self.prefill_tokens, r.queued_prompt_tokens)
        seqs = max(self.in_flight, r.running + r.waiting + r.queued)
        return prefill + decode_weight * seqs

    def settled(self, stamp: int) -> int:
        """Blocks stamped no later than this were stamped by requests already past their
        prefill (`stamp`: the index's newest, the answer when nothing is prefilling)."""
        return min(self.prefilling, default=stamp)

    def ahead(self, stamp: int) -> int:
        """Requests still prefilling here that were dispatched before the one stamped `stamp`."""
        return sum(n for s, n in self.prefilling.items() if s < stamp)

    def usable(self, hashes: Sequence[int]) -> int:
        """How many of these leading indexed blocks a request sent now would find: all, up to
        the first one brought by a request still queued behind another's prefill."""
        queued: dict[int, bool] = {}
        for i, h in enumerate(hashes):
            stamp = self.births.get(h)
            if stamp is None:
                continue
            if stamp not in queued:
                queued[stamp] = self.ahead(stamp) > 0
            if queued[stamp]:
                return i
        return len(hashes)


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
    # The block hashes this request is the first to bring to the replica (`births`).
    brings: tuple[int, ...] = ()
    # Its latent pixel-steps when it is an image request, held until it finishes.
    image_work: int = 0
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
        brings: tuple[int, ...] = (),
        image_work: int = 0,
    ) -> Ticket:
        load.prefill_tokens += prefill_tokens
        load.in_flight += 1
        load.image_work += image_work
        load.prefilling[stamp] = load.prefilling.get(stamp, 0) + 1
        for h in brings:
            load.births.setdefault(h, stamp)
        return cls(replica, load, prefill_tokens, stamp, claim, brings, image_work)

    def first_byte(self) -> None:
        """The replica answered: its prefill for this request is done."""
        if not self.started and not self.done:
            self.started = True
            self.load.prefill_tokens -= self.prefill_tokens
            if (left := self.load.prefilling.pop(self.stamp) - 1) > 0:
                self.load.prefilling[self.stamp] = left
            for h in self.brings:
                if self.load.births.get(h) == self.stamp:
                    del self.load.births[h]

    def finish(self) -> None:
        """Finished, failed or cancelled: the request holds nothing any more (idempotent)."""
        if self.done:
            return
        self.first_byte()
        self.done = True
        self.load.in_flight -= 1
        self.load.image_work -= self.image_work
