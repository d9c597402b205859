"""How often a router applies each replica's block digest.

Applying one is O(its blocks) in the router's event loop (router/index.py's `snapshot`: 26-68 ms
for 65k blocks on a 2-core VM, bench/router_digest.py), so a replica whose digests take long is
read less often than every check: all digests together take at most `time_share` (5 %) of the
router's time. A replica's period is the check interval, or `cost * replicas / time_share` when
that is more; `recent_s` (the digest's "used lately" window) is two periods. The caller gives
the clock.

    pacer = DigestPacer(interval_s=2.0)
    pacer.due("a", now=0.0)                          # True
    pacer.applied("a", now=0.0, cost_s=0.05, replicas=8)   # period 8 s
    pacer.due("a", now=2.0), pacer.due("a", now=7.5)       # False, True
"""

from __future__ import annotations


class DigestPacer:
    def __init__(self, interval_s: float, time_share: float = 0.05) -> None:
        self.interval_s = interval_s
        self.time_share = time_share
        self._period: dict[str, float] = {}
        # Only for replicas paced slower than the interval: when the next digest is due.
        self._due: dict[str, float] = {}

    def due(self, replica: str, now: float) -> bool:
        return now >= self._due.get(replica, now)

    def recent_s(self, replica: str) -> float:
        """The window a digest's blocks count as used lately in: two periods."""
        return 2 * self._period.get(replica, self.interval_s)

    def applied(self, replica: str, now: float, cost_s: float, replicas: int) -> float:
        """A digest took `cost_s` to apply at `now`; returns the replica's period."""
        period = max(self.interval_s, cost_s * replicas / self.time_share)
        self._period[replica] = period
        if period > self.interval_s:
            # Due a little early: checks come every interval plus their own duration.
            self._due[replica] = now + period - 0.5 * self.interval_s
        else:
            self._due.pop(replica, None)
        return period

    def forget(self, replica: str) -> None:
        self._period.pop(replica, None)
        self._due.pop(replica, None)
