"""Routing policies: which replica gets a request, given each ready replica's cached prefix and
load (both in tokens). Pure and deterministic: randomness comes from an injected `random.Random`,
ties rotate with a per-policy counter, nothing reads a clock.

Every policy returns a full ranking: the first replica is the choice, the rest are the order a
request that fails before streaming is retried in.

`cache_aware` (default) scores each replica with one cost in the engine's currency,

    cost = prompt tokens it would have to prefill (uncached) + its load in tokens

(Dynamo's and llm-d 2026's shape), so a warm replica keeps a prefix group until its load exceeds
a cold one's by more than the tokens its cache would save. On top, SGLang's guard: when the
cluster is imbalanced (`max - min > abs_threshold` and `max > rel_threshold * min`) only replicas
within `abs_threshold` of the least loaded may be chosen, and among those the cost still prefers
the one holding most of the prompt (sglang PR #32195: the fallback need not throw locality away).
A prompt no replica holds any of (a new prefix group) goes first to a replica that held the
prompt's prefix until it evicted it (`home_tokens`, from the replicas' own cached-token reports),
if that one is within one prompt's tokens of the least loaded: a group whose blocks were evicted
comes back to re-cache where it lived, instead of scattering over the cluster. Otherwise it goes
among the replicas within `cold_margin` tokens of the least loaded (a new prompt is least-load's
business: no cache to weigh), to those owning less than one prompt's blocks above the fewest
(SGLang's "smallest tree"; llm-d-router#346: new groups piled onto the replica that happened to be
idle, and evicted its groups), to the one with the highest rendezvous weight (`affinity`, a stable
hash of the prompt's first block and the replica's name): routers that share no state then place
a new group on the same replica whenever they see the same eligible replicas, without talking.
Prompts that share nothing need no agreement: once each of the last `unique_window` (32) prompts
found no replica holding or having held any of it (no cached tokens, no home), a new prompt goes
exactly where least-load would send it (the least loaded, ties in turn) until one is found again
(`sharing_seen`).
LoRA adapters: a prompt under an adapter is hashed under it (router/adapters.py), so it counts
only blocks cached under that adapter. Adapter affinity (LoRAX's and Dynamo's placement): a
replica the request's adapter was last sent to (`adapter_warm`) wins ties of cost, and takes a
prompt nobody holds ahead of the rendezvous winner and of least-load whenever it is within
`cold_margin` tokens of the least loaded (the former home still comes first: a home under the
adapter's hashes is where the adapter ran), so an adapter's requests and prefixes concentrate
where its weights are warm without ever passing the load bounds above. A base-model request has
no warm replica: nothing changes for it.
Worked example (cached 0/64/96 of a 128-token prompt, loads 10/200/40): costs 138/264/72 -> the
third replica.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

PolicyName = Literal["cache_aware", "least_load", "power_of_two", "round_robin"]
POLICIES: tuple[PolicyName, ...] = ("cache_aware", "least_load", "power_of_two", "round_robin")
# cache_hit: chose the replica holding most of the prompt; spill: another one held more but was
# too loaded; cold: nobody held any of it; the rest name the policy that chose.
Outcome = Literal["cache_hit", "spill", "cold", "least_load", "power_of_two", "round_robin"]


@dataclass(frozen=True)
class Candidate:
    """One ready replica as a policy sees it."""

    name: str
    load: int
    cached_tokens: int = 0
    # Blocks the router's index says it holds: how much cache it already "owns".
    held_blocks: int = 0
    # Prompt tokens it holds or held until it reported them evicted: the prompt's former home.
    home_tokens: int = 0
    # Rendezvous weight of this replica for the prompt (`rendezvous`); 0 for all: no preference.
    affinity: int = 0
    # The request's LoRA adapter was last sent here (always False for the base model).
    adapter_warm: bool = False


def rendezvous(key: int, replica: str) -> int:
    """Highest-random-weight hashing: a stable 64-bit weight of (`key`, `replica`), the same in
    every process (BLAKE2b, never Python's salted `hash`). The replica with the largest weight for
    a key wins; removing another replica never moves a key, adding one moves only the keys it
    now wins (about 1/N of them)."""
    digest = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8)
    digest.update(replica.encode())
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class Decision:
    ranking: tuple[str, ...]
    outcome: Outcome
    cached_tokens: int

    @property
    def replica(self) -> str:
        return self.ranking[0]


class Policy(Protocol):
    name: PolicyName

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
        """`candidates` is non-empty; `prompt_tokens` is the request's prompt length."""
        ...


class _Rotation:
    """Breaks ties in turn, so equal replicas share cold traffic instead of the first taking all."""

    def __init__(self) -> None:
        self._turn = 0

    def order(self, n: int) -> list[int]:
        """Each index's tie rank for this decision; advances the turn."""
        turn, self._turn = self._turn, self._turn + 1
        return [(i - turn) % n for i in range(n)]


def _decision(
    ranked: Sequence[Candidate], outcome: Outcome, chosen: Candidate | None = None
) -> Decision:
    first = chosen or ranked[0]
    rest = tuple(c.name for c in ranked if c.name != first.name)
    return Decision((first.name, *rest), outcome, first.cached_tokens)


class CacheAware:
    name: PolicyName = "cache_aware"

    def __init__(
        self,
        abs_threshold: int = 4096,
        rel_threshold: float = 1.5,
        cold_margin: int = 256,
        block_size: int = 16,
        unique_window: int = 32,
    ) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.cold_margin = cold_margin
        self.block_size = block_size
        self._ties = _Rotation()
        # Whether each of the last `unique_window` prompts was unknown to every replica.
        self._recent_unknown: deque[bool] = deque(maxlen=max(unique_window, 1))

    def imbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
        tie = self._ties.order(len(candidates))
        ranked = sorted(
            range(len(candidates)),
            key=lambda i: (
                prompt_tokens - candidates[i].cached_tokens + candidates[i].load,
                not candidates[i].adapter_warm,
                candidates[i].load,
                tie[i],
            ),
        )
        order = [candidates[i] for i in ranked]
        low = min(c.load for c in candidates)
        most = max(c.cached_tokens for c in candidates)
        sharing = self.sharing_seen()
        self._recent_unknown.append(most == 0 and not any(c.home_tokens for c in candidates))
        if most == 0:
            return _decision(order, "cold", self._cold(order, low, prompt_tokens, sharing))
        pool = order
        if self.imbalanced([c.load for c in candidates]):
            pool = [c for c in order if c.load <= low + self.abs_threshold]
        chosen = pool[0]
        outcome: Outcome = "cache_hit" if chosen.cached_tokens == most else "spill"
        return _decision(order, outcome, chosen)

    def sharing_seen(self) -> bool:
        """Whether a prompt nobody holds may be the first of a group that will follow: true
        unless each of the last `unique_window` prompts was unknown to every replica (no cached
        tokens and no home: none held any of it, or evicted it; and until that many were
        routed). A router serving prompts that share nothing gains nothing from placing them
        by hash (routers agreeing on a group's replica), and pays for it in queueing: such
        prompts go where least-load sends them (`order[0]`: the least loaded, ties in turn),
        until a prompt is known again. Evicted groups leave homes, so a thrashing cluster
        (misses, but on prompts seen before) never looks like one serving unique prompts."""
        window = self._recent_unknown
        return len(window) < (window.maxlen or 0) or not all(window)

    def _cold(
        self, order: Sequence[Candidate], low: int, prompt_tokens: int, sharing: bool = True
    ) -> Candidate:
        """A prompt nobody holds: its former home if load allows, else the replica its adapter
        ran on last if lightly loaded, else (`sharing`: prompts may start groups) the rendezvous
        winner among the lightly loaded replicas with room, or (no sharing seen) the least
        loaded. `order` is the cost order, whose rotating ties decide when no affinity does (a
        prompt shorter than one block has none)."""
        homes = [c for c in order if c.home_tokens and c.load <= low + prompt_tokens]
        if homes:
            return max(homes, key=lambda c: c.home_tokens)  # stable: the first of equals
        near = [c for c in order if c.load <= low + self.cold_margin]
        warm = [c for c in near if c.adapter_warm]
        if warm:
            return warm[0]
        if not sharing:
            return order[0]
        # Less than one more prompt's worth of blocks than the fewest: no replica takes a second
        # new group while another has room for its first.
        slack = max(prompt_tokens // self.block_size - 1, 0)
        fewest = min(c.held_blocks for c in near)
        room = [c for c in near if c.held_blocks <= fewest + slack]
        return max(room, key=lambda c: c.affinity)


class LeastLoad:
    name: PolicyName = "least_load"

    def __init__(self) -> None:
        self._ties = _Rotation()

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
        tie = self._ties.order(len(candidates))
        ranked = sorted(range(len(candidates)), key=lambda i: (candidates[i].load, tie[i]))
        return _decision([candidates[i] for i in ranked], "least_load")


class PowerOfTwo:
    """Two replicas drawn at random, the less loaded wins (the rest follow by load)."""

    name: PolicyName = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
        picks = self._rng.sample(range(len(candidates)), min(2, len(candidates)))
        best = min((candidates[i] for i in picks), key=lambda c: c.load)
        ranked = sorted(candidates, key=lambda c: c.load)
        return _decision(ranked, "power_of_two", best)


class RoundRobin:
    name: PolicyName = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
        start, self._next = self._next % len(candidates), self._next + 1
        ranked = [*candidates[start:], *candidates[:start]]
        return _decision(ranked, "round_robin")


def make_policy(
    name: PolicyName,
    rng: random.Random | None = None,
    abs_threshold: int = 4096,
    rel_threshold: float = 1.5,
    cold_margin: int = 256,
    block_size: int = 16,
) -> Policy:
    if name == "cache_aware":
        return CacheAware(abs_threshold, rel_threshold, cold_margin, block_size)
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(POLICIES)}")
