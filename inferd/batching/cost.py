"""What a backend call costs, and the length ranges that make a queue cheapest to run.

    overhead = calibrate(run, max_rows=64)   # at load: a call's fixed cost in padded elements
    cost = FixedCallCost(overhead)           # what the batcher asks (None: unknown)
    cheapest_ranges({10: 2, 12: 1, 40: 1}, overhead=20.0, max_rows=64)  # [(10, 12), (40, 40)]
    lead_range({10: 2, 12: 1, 40: 1}, 12, overhead=20.0, max_rows=64)   # (10, 12)

The model: one call on a batch padded to its longest length costs `overhead + rows x longest`
(in units of one padded element's compute). Padding a short request to a long one's length
wastes compute; running it in a call of its own pays the overhead again. The dynamic batcher
cuts a group's queued requests, ordered by length, into the contiguous length ranges that
minimize the sum of their calls' costs, and sends the range that holds the request first in
line (inferd.batching.batcher).

Measured once, at load, not configured and not fitted under traffic: `calibrate` times the
backend on zero-filled batches of 1 and `max_rows` rows (at most 8) at lengths 16 and 64, takes
each shape's fastest of 5 (the least disturbed by other work on the machine), and fits
`seconds = a + b x elements`; the overhead is `a / b`. Under traffic the same fit is confounded:
the load on the machine changes with the size of the batch (a large batch runs while the
clients wait, a small one while they send): fitted over windows of 32 calls, the overhead swung
between 5 and 82 tokens, and cutting by it ran 3-12 % slower (bench/NOTES.md). On 2 CPU cores,
MiniLM on ONNX Runtime's batch session (threads that do not spin between ops) costs ~2 ms a
call and ~0.07 ms a token: an overhead of ~31 tokens (~13 where the threads spin). A model whose
synthetic batch fails, takes longer than `_MAX_CALL_S`, or shows no cost per call or per element
has no known overhead, and the batcher keeps to its length buckets; so has one with an input of
two variable dims (an image of any size), whose cost is not rows x longest.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Protocol

# Calibration: lengths and rows of the synthetic batches, timings per shape, and the longest
# first call for which a model is calibrated at all (a slow model would delay its load).
_LENGTHS = (16, 64)
_MAX_ROWS = 8
_REPEATS = 5
_MAX_CALL_S = 0.25

# The cut considers at most this many distinct lengths around the lead's (the dynamic program
# is quadratic in them; it runs on the event loop at every dispatch).
_MAX_LENGTHS = 48


class CallCost(Protocol):
    """A backend call's fixed cost in padded elements (None: unknown)."""

    def overhead_elements(self) -> float | None: ...


class FixedCallCost:
    """A known overhead (None: unknown), e.g. from `calibrate`."""

    def __init__(self, overhead_elements: float | None) -> None:
        self._overhead = overhead_elements

    def overhead_elements(self) -> float | None:
        return self._overhead


def calibrate(
    run: Callable[[int, int], object],
    max_rows: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """A call's overhead in padded elements, timed with `clock` around `run(rows, length)`
    (one backend call on a synthetic batch of that shape); None when it cannot be known."""
    rows_big = max(1, min(max_rows, _MAX_ROWS))
    start = clock()
    run(1, _LENGTHS[0])  # the first call allocates; it is not timed
    if clock() - start > _MAX_CALL_S:
        return None
    xs, ys = [], []
    for length in _LENGTHS:
        for rows in sorted({1, rows_big}):
            seconds = []
            for _ in range(_REPEATS):
                t0 = clock()
                run(rows, length)
                seconds.append(clock() - t0)
            xs.append(float(rows * length))
            ys.append(min(seconds))
    slope, intercept = statistics.linear_regression(xs, ys)
    # Both parts must show, each at least 1 % of the other: the elements' cost of the largest
    # batch against the call's, the call's against the elements' of the smallest batch.
    if slope * max(xs) <= 0.01 * intercept or intercept <= 0.01 * slope * min(xs):
        return None
    return intercept / slope


def cheapest_ranges(
    rows_by_length: Mapping[int, int], overhead: float, max_rows: int
) -> list[tuple[int, int]]:
    """The contiguous length ranges [shortest, longest], ascending, that cover every length
    and minimize the sum over ranges of `calls x overhead + rows x longest`, where a range of
    more than `max_rows` rows takes ceil(rows / max_rows) calls. Dynamic programming over the
    sorted distinct lengths: O(lengths^2)."""
    lengths = sorted(rows_by_length)
    n = len(lengths)
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + rows_by_length[length])
    best = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[j - 1]
        for i in range(j):
            rows = prefix[j] - prefix[i]
            cost = best[i] + -(-rows // max_rows) * overhead + rows * longest
            if cost < best[j]:
                best[j], start[j] = cost, i
    ranges = []
    j = n
    while j > 0:
        ranges.append((lengths[start[j]], lengths[j - 1]))
        j = start[j]
    return ranges[::-1]


def lead_range(
    rows_by_length: Mapping[int, int], lead: int, overhead: float, max_rows: int
) -> tuple[int, int]:
    """The range of `cheapest_ranges` that holds the length `lead`, cut among the
    `_MAX_LENGTHS` distinct lengths nearest to it in order."""
    lengths = sorted(rows_by_length)
    at = lengths.index(lead)
    lo = max(0, min(at - _MAX_LENGTHS // 2, len(lengths) - _MAX_LENGTHS))
    near = {n: rows_by_length[n] for n in lengths[lo : lo + _MAX_LENGTHS]}
    return next(r for r in cheapest_ranges(near, overhead, max_rows) if r[0] <= lead <= r[1])
