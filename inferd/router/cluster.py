"""The router's view of its replicas: membership, health, load, prefix index, and the decision.

Pure bookkeeping, no I/O: the app calls `route` for a decision, `dispatch` (then the ticket's
`first_byte`/`finish`) around each forwarded request, `failed` on a connect error or 5xx (passive
health), and `set_health`/`report`/`set_members`/`digest` from the active checker. A replica that
fails or turns unready leaves the rotation at once and its prefix index is forgotten: whatever comes
back at that address may be a restarted process with an empty cache (unless the index follows
its KV events, router/kv_events.py: those show a restart as a gap).

A request under a LoRA adapter (`lora_name`, from its `model`: router/adapters.py) is hashed
under it, as the replica's prefix cache keys it, and its dispatch records where the adapter ran
(the policy's adapter affinity).

An image request (`route_image`) has no prompt to match: it goes to the replica with the fewest
latent pixel-steps in flight (router/image_cost.py), ties in turn, and holds its cost there until
it finishes.

    cluster = Cluster(RouterConfig(replicas=("http://a", "http://b")))
    for url in cluster.names(): cluster.set_health(url, ready=True)
    routed = cluster.route(token_ids, lora_name=cluster.adapters.lora_name(model))
    ticket = cluster.dispatch(routed.decision.replica, routed)
    ...; ticket.first_byte(); ...; ticket.finish()
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inferd.kv_cache.block_hash import block_hashes
from inferd.router.adapters import AdapterCatalog, AdapterPlacement
from inferd.router.config import RouterConfig
from inferd.router.index import PrefixIndex
from inferd.router.load import ReplicaLoad, ReplicaReport, Ticket
from inferd.router.policy import (
    Candidate,
    Decision,
    LeastLoad,
    Policy,
    make_policy,
    rendezvous,
)


class NoReplicaError(Exception):
    """No replica is ready (the app answers 503 with Retry-After)."""


@dataclass
class Replica:
    url: str
    ready: bool = False
    # Why it is out of rotation (`unready`, `connect_error`, `5xx`, `draining`...), for logs.
    reason: str = "not checked yet"
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    routed: int = 0
    ejections: int = 0


@dataclass(frozen=True)
class Routed:
    decision: Decision
    hashes: tuple[int, ...]
    prompt_tokens: int
    # The LoRA adapter the prompt runs under (its hashes are the adapter's); None: the base.
    lora_name: str | None = None
    # An image request's latent pixel-steps; 0 for every other request.
    image_cost: int = 0


class Cluster:
    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(config.index_capacity_blocks)
        self.policy: Policy = make_policy(
            config.policy,
            rng or random.Random(config.seed),
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            config.cold_margin_tokens,
            config.block_size,
        )
        self.image_policy = LeastLoad()
        self.replicas: dict[str, Replica] = {}
        self.adapters = AdapterCatalog()
        self.placement = AdapterPlacement()
        self.set_members(config.replicas)
        for url in config.kv_event_endpoints():
            self.index.follow_events(url)

    # -- membership and health ------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.replicas)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready]

    def set_members(self, urls: Iterable[str]) -> None:
        """The replica set now; new ones start unready (until checked), gone ones are dropped."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for url in wanted:
            self.replicas.setdefault(url, Replica(url))
        for url in [u for u in self.replicas if u not in wanted]:
            del self.replicas[url]
            self.index.forget(url)
            self.adapters.forget(url)

    def set_health(self, url: str, ready: bool, reason: str = "unready") -> bool:
        """Active check result; True when this took the replica out of rotation."""
        replica = self.replicas.get(url)
        if replica is None:
            return False
        if ready:
            replica.ready, replica.reason = True, ""
            return False
        return self._eject(replica, reason)

    def failed(self, url: str, reason: str) -> bool:
        """Passive check: a connect error or 5xx. True when this ejected the replica."""
        replica = self.replicas.get(url)
        return False if replica is None else self._eject(replica, reason)

    def _eject(self, replica: Replica, reason: str) -> bool:
        was_ready = replica.ready
        replica.ready, replica.reason = False, reason
        self.index.forget(replica.url)
        if was_ready:
            replica.ejections += 1
        return was_ready

    def report(self, url: str, report: ReplicaReport) -> None:
        """A replica's scraped gauges; its KV capacity, when given, bounds its index."""
        if url in self.replicas:
            self.replicas[url].load.report = report
            if report.num_blocks:
                self.index.set_capacity(url, report.num_blocks)

    def digest_since(self, url: str) -> int:
        """Asked right before a replica's block digest is requested: the stamp after which the
        index's blocks there may not show in it yet (the dispatch stamp of the oldest request
        still prefilling there, or now)."""
        replica = self.replicas.get(url)
        stamp = self.index.stamp
        return stamp if replica is None else replica.load.settled(stamp)

    def digest(self, url: str, hashes: Sequence[int], since: int, num_recent: int) -> int:
        """The replica's block digest (`digest_since` taken before asking; the last
        `num_recent` hashes in use lately): its index becomes what the replica holds
        (router/index.py, `snapshot`). Returns the claimed blocks it lacked; 0 for a replica
        gone meanwhile or out of rotation (its index was forgotten)."""
        replica = self.replicas.get(url)
        if replica is None or not replica.ready:
            return 0
        return self.index.snapshot(url, hashes, since, num_recent)

    # -- decisions and load ----------------------------------------------------------------------

    def load_tokens(self, replica: Replica) -> int:
        return replica.load.tokens(self.config.decode_weight)

    def route(
        self,
        token_ids: Sequence[int],
        exclude: Iterable[str] = (),
        lora_name: str | None = None,
    ) -> Routed:
        """The decision for a prompt run under adapter `lora_name` (None: the base model) among
        the ready replicas not in `exclude`."""
        ready = self._ready_except(exclude)
        cfg = self.config
        hashes = tuple(block_hashes(token_ids, cfg.block_size, cfg.max_match_blocks, lora_name))
        warm = self.placement.last(lora_name)
        candidates = [
            Candidate(
                r.url,
                self.load_tokens(r),
                self._usable(r, hashes) * cfg.block_size,
                self.index.owned(r.url),
                self.index.home(r.url, hashes) * cfg.block_size,
                rendezvous(hashes[0], r.url) if hashes else 0,
                r.url == warm,
            )
            for r in ready
        ]
        decision = self.policy.choose(candidates, len(token_ids))
        return Routed(decision, hashes, len(token_ids), lora_name)

    def route_image(self, cost: int, exclude: Iterable[str] = ()) -> Routed:
        """The decision for an image request of `cost` latent pixel-steps."""
        candidates = [Candidate(r.url, r.load.image_work) for r in self._ready_except(exclude)]
        return Routed(self.image_policy.choose(candidates, 0), (), 0, image_cost=cost)

    def _ready_except(self, exclude: Iterable[str]) -> list[Replica]:
        skip = set(exclude)
        ready = [r for r in self.ready() if r.url not in skip]
        if not ready:
            raise NoReplicaError("no replica is ready")
        return ready

    def dispatch(self, url: str, routed: Routed) -> Ticket:
        """The request goes to `url` (the decision's choice, or a retry's): count its uncached
        prompt tokens as load there and record that `url` will hold its prompt's blocks."""
        replica = self.replicas[url]
        cached = self.cached_tokens(url, routed)
        stamp = self.index.stamp
        claim = self._claim(replica, routed, stamp)
        uncached = max(routed.prompt_tokens - cached, 0)
        # Blocks the index does not hold there yet: this request brings them (load.py's births;
        # none tracked where the index follows KV events, or where no first byte is seen).
        brings: tuple[int, ...] = ()
        if self.config.sees_first_byte and not self.index.is_exact(url):
            brings = routed.hashes[self.index.match(url, routed.hashes) :]
        ticket = Ticket.dispatch(
            url, replica.load, uncached, stamp, claim, brings, routed.image_cost
        )
        replica.routed += 1
        self.index.insert(url, routed.hashes)
        if routed.lora_name is not None:
            self.placement.ran(routed.lora_name, url)
        return ticket

    def _claim(self, replica: Replica, routed: Routed, stamp: int) -> tuple[int, ...]:
        """The stamps of the prompt's leading blocks the index says `replica` holds, as far as
        the replica can report them: settled blocks only (one stamped by a request still
        prefilling may not be computed yet, and its absence says nothing of eviction), and not
        the block of the prompt's last token (the engine always computes that one)."""
        reportable = max(routed.prompt_tokens - 1, 0) // self.config.block_size
        settled = replica.load.settled(stamp)
        claim = self.index.stamps(replica.url, routed.hashes[:reportable])
        return tuple(itertools.takewhile(lambda s: s <= settled, claim))

    def reported(
        self, ticket: Ticket, routed: Routed, prompt_tokens: int, cached_tokens: int
    ) -> int:
        """The replica answered the ticket's request saying `cached_tokens` of its prompt were
        cached (usage.prompt_tokens_details). Fewer than the index claimed: the replica evicted
        the first claimed block it did not report, and with it everything the index had touched
        no later; those leave the index (router/index.py). Returns the blocks dropped.
        `prompt_tokens` (the replica's count) guards against a body that is not this prompt's
        (batched prompts, another tokenizer): the claim stands then."""
        if prompt_tokens != routed.prompt_tokens or ticket.replica not in self.replicas:
            return 0
        held = cached_tokens // self.config.block_size
        if held >= len(ticket.claim):
            return 0
        return self.index.drop_through(ticket.replica, ticket.claim[held])

    def cached_tokens(self, url: str, routed: Routed) -> int:
        """Prompt tokens a request sent to `url` now would find cached there (`_usable`)."""
        replica = self.replicas[url]
        return self._usable(replica, routed.hashes) * self.config.block_size

    def _usable(self, replica: Replica, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the index says the replica holds, short of any still
        being brought by a request queued behind another's prefill (load.py: the engine would
        admit this one with it and compute them again)."""
        return replica.load.usable(hashes[: self.index.match(replica.url, hashes)])
