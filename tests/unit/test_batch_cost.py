"""The cost of a backend call (inferd.batching.cost): the cheapest cut of a queue by length,
checked against every contiguous partition, and the overhead calibrated on a simulated backend
(its own fake clock, so no timing of this machine enters)."""

from __future__ import annotations

import itertools
import random

import pytest

from inferd.batching.cost import FixedCallCost, calibrate, cheapest_ranges, lead_range


def cost_of(
    ranges: list[tuple[int, int]], rows_by_length: dict[int, int], overhead: float, max_rows: int
) -> float:
    total = 0.0
    for shortest, longest in ranges:
        rows = sum(r for n, r in rows_by_length.items() if shortest <= n <= longest)
        total += -(-rows // max_rows) * overhead + rows * longest
    return total


def every_cut(lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Every partition of the sorted lengths into contiguous ranges."""
    cuts = []
    for mask in itertools.product((False, True), repeat=len(lengths) - 1):
        ranges, start = [], 0
        for i, cut in enumerate(mask, start=1):
            if cut:
                ranges.append((lengths[start], lengths[i - 1]))
                start = i
        ranges.append((lengths[start], lengths[-1]))
        cuts.append(ranges)
    return cuts


def test_the_cut_is_the_cheapest_of_every_contiguous_partition() -> None:
    rng = random.Random(7)
    for _ in range(300):
        lengths = sorted(rng.sample(range(1, 80), rng.randint(1, 7)))
        rows_by_length = {n: rng.randint(1, 5) for n in lengths}
        overhead = rng.choice([0.0, 5.0, 13.0, 40.0, 500.0])
        max_rows = rng.choice([1, 3, 8, 64])
        ranges = cheapest_ranges(rows_by_length, overhead, max_rows)
        # The ranges cover every length once, in order.
        assert [n for lo, hi in ranges for n in lengths if lo <= n <= hi] == lengths
        best = min(cost_of(c, rows_by_length, overhead, max_rows) for c in every_cut(lengths))
        assert cost_of(ranges, rows_by_length, overhead, max_rows) == pytest.approx(best)


def test_no_overhead_runs_every_length_alone_and_a_large_one_runs_one_call() -> None:
    rows_by_length = {10: 2, 12: 1, 40: 1}
    assert cheapest_ranges(rows_by_length, 0.0, 64) == [(10, 10), (12, 12), (40, 40)]
    assert cheapest_ranges(rows_by_length, 20.0, 64) == [(10, 12), (40, 40)]
    assert cheapest_ranges(rows_by_length, 1e6, 64) == [(10, 40)]
    # More rows than a call takes: the range pays for every call it needs.
    assert cheapest_ranges({10: 5, 11: 5}, 1e6, 4) == [(10, 11)]


def test_the_lead_range_holds_the_lead_among_many_lengths() -> None:
    rows_by_length = {n: 1 for n in range(1, 200)}
    for lead in (1, 57, 199):
        shortest, longest = lead_range(rows_by_length, lead, 13.0, 64)
        assert shortest <= lead <= longest
    assert lead_range({10: 2, 12: 1, 40: 1}, 12, 20.0, 64) == (10, 12)
    assert lead_range({10: 2, 12: 1, 40: 1}, 40, 20.0, 64) == (40, 40)


class SimulatedBackend:
    """A backend whose call costs `overhead + per_element x rows x length` seconds of a fake
    clock: the clock moves only when it runs."""

    def __init__(self, overhead_s: float, per_element_s: float, fail: bool = False) -> None:
        self.t = 0.0
        self.overhead_s, self.per_element_s, self.fail = overhead_s, per_element_s, fail
        self.shapes: list[tuple[int, int]] = []

    def now(self) -> float:
        return self.t

    def run(self, rows: int, length: int) -> None:
        self.shapes.append((rows, length))
        if self.fail:
            raise ValueError("this model rejects zeros")
        self.t += self.overhead_s + self.per_element_s * rows * length


def test_calibration_times_batches_of_two_sizes_at_two_lengths() -> None:
    backend = SimulatedBackend(0.9e-3, 0.068e-3)
    assert calibrate(backend.run, 64, clock=backend.now) == pytest.approx(0.9 / 0.068)
    # One untimed first call, then 5 timings each of 1 and 8 rows at lengths 16 and 64.
    shapes = [(1, 16)] + [s for s in [(1, 16), (8, 16), (1, 64), (8, 64)] for _ in range(5)]
    assert backend.shapes == shapes
    # A model that batches at most 2 rows is timed at 1 and 2.
    small = SimulatedBackend(1e-3, 1e-4)
    assert calibrate(small.run, 2, clock=small.now) == pytest.approx(10.0)
    assert {rows for rows, _ in small.shapes} == {1, 2}


def test_no_overhead_is_known_for_a_slow_model_or_a_line_that_says_nothing() -> None:
    slow = SimulatedBackend(0.3, 0.0)  # its first call alone passes the time allowed
    assert calibrate(slow.run, 64, clock=slow.now) is None
    assert slow.shapes == [(1, 16)]
    flat = SimulatedBackend(1e-3, 0.0)  # no cost per element: the slope is 0
    assert calibrate(flat.run, 64, clock=flat.now) is None
    free = SimulatedBackend(0.0, 1e-4)  # no cost per call: the intercept is 0
    assert calibrate(free.run, 64, clock=free.now) is None


def test_a_fixed_cost_is_what_it_states() -> None:
    assert FixedCallCost(None).overhead_elements() is None
    assert FixedCallCost(13.0).overhead_elements() == 13.0
