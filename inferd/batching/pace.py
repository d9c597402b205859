"""Whether waiting can grow a batch: how fast requests arrive against how long a batch runs.

    pace = MeasuredPace(max_delay_s=0.003)   # the default; FixedWindow() is Triton's rule
    pace.arrived(now)             # every accepted request, on the batcher's clock
    pace.ran(0.004)               # every finished batch: dispatch to finish, on that clock
    pace.batch_can_grow(1)        # True: a partial batch waits its window (max_delay_s)

The dynamic batcher asks this before holding a partial batch on a free instance. Waiting helps
only when more requests are expected during one batch's compute than there are instances to
run them one by one: then a request run alone now would make the next ones queue behind it
anyway, and one batch costs less than several. Otherwise (one client, or a trickle) the instance
would be idle again before the next request arrives, and every millisecond of wait is latency
for nothing.

Injectable so that tests can state "requests arrive faster than a batch runs" (FixedWindow)
instead of producing it with real time.
"""

from __future__ import annotations

import math
from typing import Protocol

# Weights of the newest sample in the two moving means: arrivals come in waves (a closed-loop
# client's requests return together), so the gap is averaged over about one wave of 8; a batch's
# compute follows the load quickly (a batch of 64 takes 10x a batch of 1).
_GAP_WEIGHT = 1 / 8
_COMPUTE_WEIGHT = 1 / 4
# A gap longer than this many batch windows (or computes) says "slow" as clearly as any longer
# one; capping it lets the mean follow a burst after an idle minute within a few arrivals.
_GAP_CAP = 4.0


class Pace(Protocol):
    """Arrivals and batch compute times in; whether a partial batch should wait out."""

    def arrived(self, now: float) -> None: ...

    def ran(self, seconds: float) -> None: ...

    def batch_can_grow(self, instances: int) -> bool: ...


class MeasuredPace:
    """Moving means of the gap between arrivals and of a batch's compute time.

    `batch_can_grow(n)`: mean gap x n < mean compute, i.e. more than `n` requests arrive while
    one batch runs. Before the first gap and the first batch are measured it is False: a
    server's first request runs at once.
    """

    def __init__(self, max_delay_s: float) -> None:
        self._max_delay_s = max_delay_s
        self._last: float | None = None
        self.gap_s = math.inf
        self.compute_s = 0.0

    def arrived(self, now: float) -> None:
        last, self._last = self._last, now
        if last is None:
            return
        gap = min(now - last, _GAP_CAP * max(self.compute_s, self._max_delay_s))
        if math.isinf(self.gap_s):
            self.gap_s = gap
        else:
            self.gap_s += _GAP_WEIGHT * (gap - self.gap_s)

    def ran(self, seconds: float) -> None:
        if self.compute_s == 0.0:
            self.compute_s = seconds
        else:
            self.compute_s += _COMPUTE_WEIGHT * (seconds - self.compute_s)

    def batch_can_grow(self, instances: int) -> bool:
        return self.gap_s * instances < self.compute_s


class FixedWindow:
    """Triton's rule: every partial batch waits out its window, whatever the pace."""

    def arrived(self, now: float) -> None:
        pass

    def ran(self, seconds: float) -> None:
        pass

    def batch_can_grow(self, instances: int) -> bool:
        return True
