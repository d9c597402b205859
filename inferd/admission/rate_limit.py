"""Per-API-key limits: requests per minute, tokens per minute, requests at once.

Pure logic with an injectable clock (tests drive time by hand):

    limiter = KeyLimiter(KeyLimits(requests_per_minute=60, tokens_per_minute=1000), clock)
    decision = limiter.acquire()            # at arrival: one request, one concurrency slot
    if not decision.allowed: ...            # 429, Retry-After = ceil(decision.retry_after_s)
    ...
    limiter.release(tokens=57)              # at the end: the slot back, the tokens charged

Both per-minute limits are token buckets holding at most one minute's allowance, refilled
continuously (limit / 60 per second), so a client may burst up to the limit and then proceeds
at the steady rate. A request takes one unit from the request bucket when it is admitted. The
tokens a request uses (prompt + completion) are only known when it ends, so they are charged
then and may drive the token bucket below zero; while it is below zero (in debt) the key's new
requests are refused until the refill pays the debt. OpenAI estimates from `max_tokens` up
front instead; charging what was used never refuses a request for tokens it would not have
spent, at the price of one request's overshoot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Clock = Callable[[], float]
LimitKind = Literal["requests", "tokens", "concurrency"]
_MINUTE = 60.0
# Retry-After for a key at its concurrency cap: no refill time to compute, a slot frees when
# one of its requests ends.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class KeyLimits:
    """None: that limit is off."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )


class TokenBucket:
    """`capacity` units, refilled at capacity/60 per second; the level may go negative (debt).

    >>> b = TokenBucket(60, now=0.0)       # 60 per minute: one unit a second
    >>> b.take(60, 0.0), b.take(1, 0.0), b.seconds_until(1, 0.0)
    (True, False, 1.0)
    """

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / _MINUTE
        self._level = float(capacity)
        self._at = now

    def level(self, now: float) -> float:
        self._level = min(self.capacity, self._level + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)
        return self._level

    def take(self, n: float, now: float) -> bool:
        """Takes `n` units when the bucket holds them; False (nothing taken) otherwise."""
        if self.level(now) < n:
            return False
        self._level -= n
        return True

    def charge(self, n: float, now: float) -> None:
        """Takes `n` units unconditionally (the level may go below zero)."""
        self._level = self.level(now) - n

    def seconds_until(self, n: float, now: float) -> float:
        """Seconds until the bucket holds `n` units (0 when it does now)."""
        return max(0.0, (n - self.level(now)) / self.rate)

    def remaining(self, now: float) -> int:
        return max(0, math.floor(self.level(now)))

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return self.seconds_until(self.capacity, now)


@dataclass(frozen=True)
class BucketState:
    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class LimitState:
    """What the x-ratelimit-* headers report; None for a limit that is off."""

    requests: BucketState | None
    tokens: BucketState | None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limit: LimitKind | None = None  # the limit that refused
    retry_after_s: float = 0.0


class KeyLimiter:
    """One key's limits. Not thread-safe: used from the event loop only."""

    def __init__(self, limits: KeyLimits, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        now = clock()
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self._requests = TokenBucket(rpm, now) if rpm is not None else None
        self._tokens = TokenBucket(tpm, now) if tpm is not None else None
        self.inflight = 0

    def acquire(self) -> Decision:
        """Admits one request (taking a request unit and a slot) or says which limit refused
        it and when to retry. Checks that refuse take nothing."""
        now = self._clock()
        cap = self.limits.max_concurrent
        if cap is not None and self.inflight >= cap:
            return Decision(False, "concurrency", CONCURRENCY_RETRY_S)
        if self._tokens is not None and self._tokens.level(now) <= 0:
            # In debt (or exactly empty): wait until at least one token is back.
            return Decision(False, "tokens", self._tokens.seconds_until(1, now))
        if self._requests is not None and not self._requests.take(1, now):
            return Decision(False, "requests", self._requests.seconds_until(1, now))
        self.inflight += 1
        return Decision(True)

    def release(self, tokens: int = 0) -> None:
        """Ends an admitted request: its slot back, the tokens it used charged."""
        self.inflight = max(0, self.inflight - 1)
        if self._tokens is not None and tokens > 0:
            self._tokens.charge(tokens, self._clock())

    def state(self) -> LimitState:
        now = self._clock()
        return LimitState(_bucket_state(self._requests, now), _bucket_state(self._tokens, now))


def _bucket_state(bucket: TokenBucket | None, now: float) -> BucketState | None:
    if bucket is None:
        return None
    return BucketState(int(bucket.capacity), bucket.remaining(now), bucket.reset_s(now))


def openai_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: `1s`, `6m0s`, `1h2m3s`, `120ms`.

    >>> openai_duration(0.12), openai_duration(1.0), openai_duration(360.0)
    ('120ms', '1s', '6m0s')
    """
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(state: LimitState) -> list[tuple[str, str]]:
    """The x-ratelimit-* headers OpenAI sends, for the limits that are on."""
    headers: list[tuple[str, str]] = []
    for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is None:
            continue
        headers += [
            (f"x-ratelimit-limit-{kind}", str(bucket.limit)),
            (f"x-ratelimit-remaining-{kind}", str(bucket.remaining)),
            (f"x-ratelimit-reset-{kind}", openai_duration(bucket.reset_s)),
        ]
    return headers
