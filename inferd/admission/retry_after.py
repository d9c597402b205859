"""The Retry-After hint of a full queue, from the recent completion rate.

    rate = CompletionRate(window=256)
    rate.record(time.monotonic())                  # one request (or `n` rows) finished
    raise QueueFullError(..., retry_after=rate.retry_after(num_queued))

The hint is the time the recent rate needs to work off the queue, clamped to [1, 60] s; 1 s
while fewer than two completions are known. Both lanes use it (the LLM front counts requests,
the dynamic batcher counts rows).
"""

from __future__ import annotations

import math
from collections import deque

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60


class CompletionRate:
    """The last `window` completions as (monotonic time, count)."""

    def __init__(self, window: int = 256) -> None:
        self._done: deque[tuple[float, int]] = deque(maxlen=window)

    def record(self, now: float, count: int = 1) -> None:
        self._done.append((now, count))

    def per_second(self) -> float | None:
        """Completions per second over the window; None with fewer than two records.

        The first record only opens the window: its count finished before the span began."""
        done = self._done
        if len(done) < 2:
            return None
        span = done[-1][0] - done[0][0]
        count = sum(n for _, n in done) - done[0][1]
        return count / span if span > 0 else math.inf

    def retry_after(self, num_queued: int) -> float:
        """Seconds until `num_queued` requests have likely drained, in [1, 60]."""
        rate = self.per_second()
        if rate is None:
            return float(RETRY_AFTER_MIN_S)
        wait = math.ceil(num_queued / rate) if rate > 0 else RETRY_AFTER_MAX_S
        return float(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, wait)))
