"""DynamicBatcher: batch formation, priorities, deadlines, bounds, workers (faked backends).

The fake backend's `run` records each batch it is given; a request named "gate" blocks its
worker until the test opens the gate, which makes "the worker is busy" deterministic instead
of a matter of sleeps. Time is a FakeClock the test advances by hand: batch delays and queue
deadlines fire exactly when the clock passes them, whatever the machine's load.

Whether a partial batch waits its window on a free worker depends on the pace of arrivals
(inferd.batching.pace). Most tests here are about the window itself, so their harness states
"requests arrive faster than a batch runs" (`FixedWindow`); the tests of the idle rule at the end
use the measured pace, fed by the fake clock. Likewise the cost of a backend call: the harness
states it unknown (`FixedCallCost(None)`: a batch is its bucket, filled by the padding ratio);
the tests of the cut by cost state an overhead.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import threading
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any

import pytest

from inferd.batching.batcher import BatchPolicy, DynamicBatcher, Queued
from inferd.batching.cost import CallCost, FixedCallCost
from inferd.batching.pace import FixedWindow, MeasuredPace, Pace
from inferd.errors import QueueFullError, QueueTimeoutError

LONG = 30.0  # a batch delay no test waits for: a batch sent anyway was sent by another rule


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))

    return run


@dataclass(eq=False)
class FakeTimer:
    """No when(): a loop's handle need not have one (uvloop's call_soon handle, for a call_at
    less than half a millisecond ahead, has not)."""

    callback: Callable[[], None]
    done: bool = False

    def cancel(self) -> None:
        self.done = True

    def cancelled(self) -> bool:
        return self.done


class FakeClock:
    """A clock that moves only in `advance`, firing the timers it passes in time order (each
    with the clock set to its instant, as a real timer would see it)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        target = self.t + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.done:
                self.t = max(self.t, when)
                timer.done = True
                timer.callback()
        self.t = target


async def settle() -> None:
    """Lets the loop run what is ready now (the scheduling pass an arrival queued)."""
    for _ in range(3):
        await asyncio.sleep(0)


@dataclass(eq=False)
class FakeBackend:
    closed: bool = False
    active: int = 0
    max_active: int = 0

    def close(self) -> None:
        self.closed = True


@dataclass
class Ran:
    names: list[str]
    started: float
    thread: str
    queue_s: list[float]
    batch_s: list[float]


@dataclass
class Harness:
    policy: BatchPolicy
    workers: int = 1
    fail_on: str | None = None
    meet: threading.Barrier | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    ran: list[Ran] = field(default_factory=list)
    futures: dict[str, asyncio.Future[list[str]]] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)
    handles: dict[str, Queued[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    clock: FakeClock = field(default_factory=FakeClock)
    pace: Pace | None = field(default_factory=FixedWindow)  # None: the batcher's measured pace
    paced: threading.Semaphore | None = None  # when set, each batch takes one permit to finish
    cost: CallCost = field(default_factory=lambda: FixedCallCost(None))

    def __post_init__(self) -> None:
        self.backends = [FakeBackend() for _ in range(self.workers)]
        self.batcher: DynamicBatcher[str, FakeBackend, list[str]] = DynamicBatcher(
            self.policy,
            self.backends,
            run=self.run,
            done=self.done,
            expired=self.expired,
            clock=self.clock,
            pace=self.pace,
            cost=self.cost,
        )
        self.batcher.start()

    # Worker thread.
    def run(self, backend: FakeBackend, batch: list[Queued[str]]) -> list[str]:
        names = [q.item for q in batch]
        with self.lock:
            backend.active += 1
            backend.max_active = max(backend.max_active, backend.active)
            self.ran.append(
                Ran(
                    names,
                    self.clock.now(),
                    threading.current_thread().name,
                    [q.queue_s for q in batch],
                    [q.batch_s for q in batch],
                )
            )
        try:
            if any(n.startswith("gate") for n in names):
                assert self.gate.wait(10)
            if self.meet is not None:
                self.meet.wait(10)
            if self.paced is not None:
                assert self.paced.acquire(timeout=10)
            if self.fail_on in names:
                raise RuntimeError("poisoned batch")
            return names
        finally:
            with self.lock:
                backend.active -= 1

    # Event loop.
    def done(self, batch: list[Queued[str]], result: list[str] | BaseException) -> None:
        for queued in batch:
            future = self.futures[queued.item]
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def expired(self, name: str) -> None:
        self.futures[name].set_exception(QueueTimeoutError(name))

    def submit(
        self,
        name: str,
        *,
        rows: int = 1,
        key: Hashable = 0,
        length: int = 0,
        group: Hashable = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> asyncio.Future[list[str]]:
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self.futures[name] = future
        self.submitted[name] = self.clock.now()
        self.handles[name] = self.batcher.submit(
            name,
            rows=rows,
            key=key,
            length=length,
            group=group,
            priority=priority,
            deadline=deadline,
        )
        return future

    async def wait_running(self, name: str) -> None:
        while not any(name in r.names for r in self.ran):
            await asyncio.sleep(0.005)

    def batches(self) -> list[list[str]]:
        return [r.names for r in self.ran]

    def submit_len(self, name: str, length: int, **kw: Any) -> asyncio.Future[list[str]]:
        """A request whose longest variable dim is `length`, in its power-of-two bucket."""
        return self.submit(name, key=1 << (length - 1).bit_length(), length=length, **kw)

    async def hold(self) -> asyncio.Future[list[str]]:
        """Occupies the (single) worker until `gate` opens, so requests pile up meanwhile.
        The clock moves past gate's batch delay (a lone request waits that long)."""
        gate = self.submit("gate")
        await settle()
        self.clock.advance(self.policy.max_delay_s if self.policy.dynamic else 0.0)
        await self.wait_running("gate")
        return gate

    async def release(self, gate: asyncio.Future[list[str]], *rest: Any) -> None:
        self.gate.set()
        await asyncio.gather(gate, *rest)


def dynamic(max_batch_size: int = 8, delay: float = LONG, **kw: Any) -> BatchPolicy:
    return BatchPolicy(max_batch_size=max_batch_size, dynamic=True, max_delay_s=delay, **kw)


@async_test
async def test_full_batch_is_sent_at_once() -> None:
    h = Harness(dynamic(4))
    results = await asyncio.gather(*(h.submit(n) for n in "abcd"))
    assert h.batches() == [["a", "b", "c", "d"]]
    assert results[0] == ["a", "b", "c", "d"]


@async_test
async def test_largest_preferred_size_is_sent_at_once() -> None:
    h = Harness(dynamic(8, preferred_batch_sizes=(2, 4)), workers=2)
    futures = [h.submit(n) for n in "abcdefg"]  # 7 rows: 4 (largest <= 7), then 2 of the 3 left
    await asyncio.gather(*futures[:6])
    assert h.batches() == [["a", "b", "c", "d"], ["e", "f"]]
    assert h.batcher.num_queued == 1 and not futures[6].done()
    # One more request makes 2 rows: a preferred size again.
    await asyncio.gather(futures[6], h.submit("h"))
    assert h.batches()[-1] == ["g", "h"]


@async_test
async def test_partial_batch_waits_for_the_oldest_requests_delay() -> None:
    h = Harness(dynamic(8, delay=0.3))
    first = h.submit("a")
    await settle()
    h.clock.advance(0.1)
    second = h.submit("b")
    await settle()
    h.clock.advance(0.2 - 1e-3)
    await settle()
    assert h.batches() == [] and h.batcher.num_queued == 2  # not a hair early
    h.clock.advance(1e-3)
    await asyncio.gather(first, second)
    assert h.batches() == [["a", "b"]]
    waited = h.ran[0].started - h.submitted["a"]
    assert waited == pytest.approx(0.3)
    # The time went to batch formation (a worker was free all along), not to the queue.
    assert h.ran[0].queue_s[0] == pytest.approx(0.0, abs=1e-9)
    assert h.ran[0].batch_s[0] == pytest.approx(0.3)


@async_test
async def test_wait_for_a_busy_instance_is_queue_not_batch() -> None:
    h = Harness(dynamic(8, delay=0.05))
    gate = await h.hold()
    waiting = h.submit("a")
    await settle()
    h.clock.advance(0.3)  # far past the 50 ms window: the instance is the hold-up
    await h.release(gate, waiting)
    batch_s, queue_s = h.ran[1].batch_s[0], h.ran[1].queue_s[0]
    assert batch_s == pytest.approx(0.05)
    assert queue_s == pytest.approx(0.25)
    unbatched = Harness(BatchPolicy(max_batch_size=8, dynamic=False))
    await unbatched.submit("b")
    assert unbatched.ran[0].batch_s == [0.0]


@async_test
async def test_the_oldest_request_not_the_first_in_line_sets_the_delay() -> None:
    h = Harness(dynamic(8, delay=0.6))
    low = h.submit("low", priority=2)
    await settle()
    h.clock.advance(0.5)
    high = h.submit("high", priority=1)  # first in line now, but 0.5 s younger
    await settle()
    h.clock.advance(0.1)
    await asyncio.gather(low, high)
    assert h.batches() == [["high", "low"]]
    # Sent when "low" had waited 0.6 s; waiting on "high" would have taken until 1.1 s.
    assert h.ran[0].started - h.submitted["low"] == pytest.approx(0.6)


@async_test
async def test_without_dynamic_batching_each_request_runs_alone() -> None:
    h = Harness(BatchPolicy(max_batch_size=8, dynamic=False))
    await asyncio.gather(*(h.submit(n, rows=2) for n in "abc"))
    assert h.batches() == [["a"], ["b"], ["c"]]


@async_test
async def test_rows_count_and_a_batch_stops_at_the_first_request_that_does_not_fit() -> None:
    h = Harness(dynamic(4, delay=0.0))
    gate = h.submit("gate")
    await h.wait_running("gate")
    rest = [h.submit("r3", rows=3), h.submit("r2", rows=2), h.submit("r1", rows=1)]
    rest.append(h.submit("s1", rows=1))
    await settle()
    h.gate.set()
    await asyncio.gather(gate, *rest)
    assert h.batches() == [["gate"], ["r3"], ["r2", "r1", "s1"]]


@async_test
async def test_priority_first_then_fifo() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False))
    gate = h.submit("gate")
    await h.wait_running("gate")
    order = [("lo1", 2), ("hi1", 1), ("lo2", 2), ("hi2", 1)]
    rest = [h.submit(n, priority=p) for n, p in order]
    await settle()
    h.gate.set()
    await asyncio.gather(gate, *rest)
    assert h.batches() == [["gate"], ["hi1"], ["hi2"], ["lo1"], ["lo2"]]


@async_test
async def test_deadline_fires_while_no_batch_runs() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False))
    gate = h.submit("gate")
    await h.wait_running("gate")
    late = h.submit("late", deadline=h.clock.now() + 0.1)
    await settle()
    h.clock.advance(0.1 - 1e-3)
    await settle()
    assert not late.done()
    h.clock.advance(1e-3)
    with pytest.raises(QueueTimeoutError):
        await late  # the only worker is still blocked: a timer, not a dispatch, failed it
    assert not gate.done() and h.batcher.num_queued == 0
    h.gate.set()
    await gate
    assert h.batches() == [["gate"]]


@async_test
async def test_an_earlier_deadline_re_arms_the_pending_wake_up() -> None:
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    h = Harness(dynamic(delay=0.01))
    waits = h.submit("waits", key=1)
    await settle()  # a wake-up is armed for its window's end
    late = h.submit("late", key=2, deadline=h.clock.now() + 0.005)
    await settle()  # the earlier deadline replaces that wake-up
    h.clock.advance(0.005)
    with pytest.raises(QueueTimeoutError):
        await late
    assert not waits.done() and h.batches() == []
    h.clock.advance(0.005)
    assert await waits == ["waits"]
    assert errors == []


@async_test
async def test_full_queue_rejects_with_a_retry_hint() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False, max_queue_size=2))
    gate = h.submit("gate")
    await h.wait_running("gate")
    queued = [h.submit("a"), h.submit("b")]
    with pytest.raises(QueueFullError) as info:
        h.submit("c")
    assert info.value.retry_after >= 1
    h.gate.set()
    await asyncio.gather(gate, *queued)
    await h.submit("c")  # room again


@async_test
async def test_the_retry_hint_is_the_queue_over_the_recent_completion_rate() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False, max_queue_size=2))
    for name in "abc":  # one completion per second of the fake clock
        await h.submit(name)
        h.clock.advance(1.0)
    gate = await h.hold()
    queued = [h.submit("d"), h.submit("e")]
    with pytest.raises(QueueFullError) as info:
        h.submit("f")
    assert info.value.retry_after == 2.0  # 2 queued at 1 request/s
    await h.release(gate, *queued)


@async_test
async def test_instances_run_batches_concurrently_one_backend_each() -> None:
    h = Harness(BatchPolicy(max_batch_size=4, dynamic=False), workers=3)
    h.meet = threading.Barrier(3)  # only passes if three batches run at the same time
    await asyncio.gather(*(h.submit(n) for n in "abc"))
    assert len({r.thread for r in h.ran}) == 3
    assert all(b.max_active == 1 for b in h.backends)


@async_test
async def test_length_buckets_are_batched_separately() -> None:
    h = Harness(dynamic(2), workers=2)
    await asyncio.gather(
        h.submit("a", key=4), h.submit("b", key=8), h.submit("c", key=4), h.submit("d", key=8)
    )
    assert sorted(h.batches()) == [["a", "c"], ["b", "d"]]


@async_test
async def test_removed_request_never_runs() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False))
    gate = h.submit("gate")
    await h.wait_running("gate")
    h.submit("gone")
    assert h.batcher.remove(h.handles["gone"])
    assert not h.batcher.remove(h.handles["gone"]) and h.batcher.num_queued == 0
    h.gate.set()
    await gate
    # The one worker takes batches in queue order: once a later request has run, a (wrongly)
    # dispatched "gone" would have run before it.
    await h.submit("probe")
    assert h.batches() == [["gate"], ["probe"]]


@async_test
async def test_a_failing_run_reaches_done() -> None:
    h = Harness(dynamic(2), fail_on="b")
    with pytest.raises(RuntimeError, match="poisoned"):
        await asyncio.gather(h.submit("a"), h.submit("b"))


@async_test
async def test_close_returns_the_queue_and_closes_every_backend() -> None:
    h = Harness(BatchPolicy(max_batch_size=1, dynamic=False), workers=2)
    gates = [h.submit("gate1"), h.submit("gate2")]
    await h.wait_running("gate1")
    await h.wait_running("gate2")
    h.submit("q1")
    h.submit("q2")
    assert await h.batcher.close() == ["q1", "q2"]
    with pytest.raises(RuntimeError):
        h.submit("late")
    assert not any(b.closed for b in h.backends)  # both are running a batch
    h.gate.set()
    await asyncio.gather(*gates)  # a running batch still completes
    for _ in range(500):
        if all(b.closed for b in h.backends):
            break
        await asyncio.sleep(0.01)
    assert all(b.closed for b in h.backends)
    assert h.batches() == [["gate1"], ["gate2"]]


# -- when a batch is sent, on the fake clock -------------------------------------------------


@async_test
async def test_a_preferred_size_reached_inside_the_window_is_sent_without_waiting() -> None:
    h = Harness(dynamic(8, delay=1.0, preferred_batch_sizes=(3,)))
    futures = [h.submit("a"), h.submit("b")]
    await settle()
    h.clock.advance(0.25)
    assert h.batcher.num_queued == 2  # 2 rows: no preferred size, the window is still open
    futures.append(h.submit("c"))
    await asyncio.gather(*futures)
    assert h.batches() == [["a", "b", "c"]]
    assert h.ran[0].started - h.submitted["a"] == pytest.approx(0.25)


@async_test
async def test_rows_beyond_a_full_batch_wait_their_own_window() -> None:
    h = Harness(dynamic(3, delay=0.5))
    first = [h.submit(n) for n in "abce"]
    await asyncio.gather(*first[:3])  # max_batch_size rows: sent at once
    assert h.batches() == [["a", "b", "c"]] and h.batcher.num_queued == 1
    h.clock.advance(0.2)
    d = h.submit("d")
    await settle()
    h.clock.advance(0.3 - 1e-3)
    await settle()
    assert h.batcher.num_queued == 2  # e arrived at 0: due at 0.5, not before
    h.clock.advance(1e-3)
    await asyncio.gather(first[3], d)
    # The window of the oldest request left (e) sent e and d together at 0.5.
    assert h.batches()[1] == ["e", "d"]
    assert h.ran[1].started - h.submitted["e"] == pytest.approx(0.5)
    assert h.ran[1].batch_s == pytest.approx([0.5, 0.3])


@async_test
async def test_a_due_bucket_goes_even_while_another_waits_for_its_window() -> None:
    h = Harness(dynamic(4, delay=0.4), workers=2)
    young = h.submit("young", key=16)
    await settle()
    h.clock.advance(0.1)
    full = [h.submit(n, key=8) for n in ("p", "q", "r", "s")]
    await asyncio.gather(*full)
    assert h.batches() == [["p", "q", "r", "s"]] and h.batcher.num_queued == 1
    h.clock.advance(0.3)
    await young
    assert h.batches()[1] == ["young"]
    assert h.ran[1].started - h.submitted["young"] == pytest.approx(0.4)


@async_test
async def test_a_bucket_due_by_delay_fills_from_others_within_the_padding_bound() -> None:
    h = Harness(filling(8, ratio=0.4, delay=0.2))
    a = h.submit_len("a30", 30)
    await settle()
    h.clock.advance(0.1)
    b = h.submit_len("b14", 14)  # another bucket; its own window would end at 0.3
    await settle()
    h.clock.advance(0.1)  # a30's window ends: it goes, and b14 fills (ratio 0.27)
    await asyncio.gather(a, b)
    assert h.batches() == [["a30", "b14"]]
    assert h.ran[0].batch_s == pytest.approx([0.2, 0.1])
    assert h.ran[0].queue_s == pytest.approx([0.0, 0.0], abs=1e-9)


# -- cross-bucket filling ------------------------------------------------------------------------


def filling(max_batch_size: int = 8, ratio: float = 0.4, delay: float = 0.0) -> BatchPolicy:
    return dynamic(max_batch_size, delay=delay, max_padding_ratio=ratio)


@async_test
async def test_a_batch_with_room_takes_other_buckets_while_padding_stays_under_the_bound() -> None:
    h = Harness(filling(8, ratio=0.4))
    gate = await h.hold()
    rest = [h.submit_len("a30", 30), h.submit_len("b14", 14), h.submit_len("c12", 12)]
    # a30 alone: 0; + b14: 1 - 44/60 = 0.27; + c12: 1 - 56/90 = 0.38 <= 0.4.
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a30", "b14", "c12"]]
    assert h.batcher.num_queued == 0 and not h.batcher.remove(h.handles["b14"])


@async_test
async def test_no_request_joins_when_padding_would_pass_the_bound() -> None:
    h = Harness(filling(8, ratio=0.4))
    gate = await h.hold()
    # a30 + s5 would be 1 - 35/60 = 0.42: s5 stays, and m7 behind it in its bucket waits too
    # (a bucket is taken in its own order, up to the first request that does not fit).
    rest = [h.submit_len("a30", 30), h.submit_len("s5", 5), h.submit_len("m7", 7)]
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a30"], ["s5", "m7"]]


@async_test
async def test_max_padding_ratio_zero_keeps_each_bucket_alone() -> None:
    h = Harness(filling(8, ratio=0.0))
    gate = await h.hold()
    rest = [h.submit_len("a30", 30), h.submit_len("b29", 29), h.submit_len("c14", 14)]
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a30", "b29"], ["c14"]]


@async_test
async def test_the_closest_bucket_fills_first_and_groups_never_mix() -> None:
    h = Harness(filling(2, ratio=0.45))
    gate = await h.hold()
    rest = [
        h.submit_len("a32", 32),
        # Closest, but with other inputs: its own bucket and group (as the pipeline keys it).
        h.submit("x30", key=(32, "other inputs"), length=30, group="other inputs"),
        h.submit_len("far60", 60),  # 1 - 92/120 = 0.23 would fit, but is farther than 16
        h.submit_len("near16", 16),  # 1 - 48/64 = 0.25
    ]
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a32", "near16"], ["x30"], ["far60"]]


@async_test
async def test_filling_keeps_priority_order_within_a_bucket() -> None:
    h = Harness(filling(2, ratio=0.4))
    gate = await h.hold()
    rest = [
        h.submit_len("a30", 30, priority=1),
        h.submit_len("lo14", 14, priority=2),
        h.submit_len("hi13", 13, priority=1),  # later, but first in its bucket's order
    ]
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a30", "hi13"], ["lo14"]]


@async_test
async def test_a_filled_request_splits_its_wait_from_its_own_arrival() -> None:
    h = Harness(filling(8, ratio=0.4, delay=0.05))
    gate = await h.hold()
    old = h.submit_len("old14", 14, priority=2)
    await settle()
    h.clock.advance(0.1)
    new = h.submit_len("new30", 30, priority=1)  # ranks first: its bucket goes, old14 fills
    await settle()
    h.clock.advance(0.2)
    await h.release(gate, old, new)
    ran = h.ran[1]
    assert ran.names == ["new30", "old14"]
    # The batch's window opened when old14 (its oldest request) arrived and closed 50 ms
    # later, before new30 even arrived: new30's whole wait was for the instance.
    batch_s = dict(zip(ran.names, ran.batch_s, strict=True))
    queue_s = dict(zip(ran.names, ran.queue_s, strict=True))
    assert batch_s["old14"] == pytest.approx(0.05)
    assert batch_s["new30"] == 0.0
    assert queue_s["old14"] == pytest.approx(0.25) and queue_s["new30"] == pytest.approx(0.2)


# -- the cut by cost (a measured call overhead) ---------------------------------------------------


@async_test
async def test_close_lengths_of_two_buckets_share_a_call_and_far_ones_run_apart() -> None:
    h = Harness(dynamic(8, delay=0.0), cost=FixedCallCost(20.0))
    gate = await h.hold()
    rest = [
        h.submit_len("a30", 30),  # bucket 32, first in line
        h.submit_len("b33", 33),  # bucket 64
        h.submit_len("c10", 10),  # bucket 16
        h.submit_len("d60", 60),  # bucket 64
    ]
    # Cheapest cut of {10, 30, 33, 60} at overhead 20: [10] [30, 33] [60] = 30 + 86 + 80 = 196
    # (padding 10 to 33 instead: 99 + 20 + 80 = 199). The lead a30's range goes first; then
    # c10 leads (first in line of what is left), alone: 30 + 80 < 20 + 2 x 60.
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["a30", "b33"], ["c10"], ["d60"]]
    assert h.batcher.num_queued == 0 and not h.batcher.remove(h.handles["b33"])


@async_test
async def test_a_large_call_overhead_puts_every_length_in_one_call() -> None:
    h = Harness(dynamic(8, delay=0.0), cost=FixedCallCost(1000.0))
    gate = await h.hold()
    rest = [h.submit_len(f"r{n}", n) for n in (30, 5, 100, 17)]
    await h.release(gate, *rest)
    assert h.batches() == [["gate"], ["r30", "r5", "r100", "r17"]]


@async_test
async def test_the_cut_takes_its_range_in_priority_order_and_never_mixes_groups() -> None:
    h = Harness(dynamic(8, delay=0.0), cost=FixedCallCost(1000.0))
    gate = await h.hold()
    rest = [
        h.submit_len("lead30", 30, priority=1),
        h.submit_len("lo33", 33, priority=2),  # bucket 64, older than hi34
        h.submit_len("hi34", 34, priority=1),
        h.submit("x30", key=(32, "other inputs"), length=30, group="other inputs", priority=1),
    ]
    await h.release(gate, *rest)
    # One range (the overhead dwarfs any padding): the lead, then hi34 before lo33 (priority
    # first); x30 has other inputs (another group) and runs on its own.
    assert h.batches() == [["gate"], ["lead30", "hi34", "lo33"], ["x30"]]


# -- no wait when waiting cannot help (the measured pace) ----------------------------------------


async def drive(h: Harness, arrivals: list[tuple[float, str]], compute: float) -> None:
    """Runs a timeline on the fake clock in 5 ms steps: each request is submitted at its
    instant (seconds from now) and each batch finishes `compute` seconds after it started."""
    h.paced = threading.Semaphore(0)
    t0, step, finished, i = h.clock.now(), 0.005, 0, 0
    running: Ran | None = None
    while True:
        now = h.clock.now()
        while i < len(arrivals) and t0 + arrivals[i][0] <= now + 1e-9:
            h.submit(arrivals[i][1])
            i += 1
        await settle()
        # Requests neither queued nor finished are on the (single) worker.
        pending = sum(not f.done() for f in h.futures.values())
        if running is None and pending > h.batcher.num_queued:
            while len(h.ran) <= finished:  # the worker records the batch it took
                await asyncio.sleep(0.001)
            running = h.ran[-1]
        if running is not None and now + 1e-9 >= running.started + compute:
            h.paced.release()
            await asyncio.gather(*(h.futures[n] for n in running.names))
            finished, running = finished + 1, None
            continue  # the freed worker may take the next batch at this very instant
        if i == len(arrivals) and running is None and not h.batcher.num_queued:
            return
        h.clock.advance(step)


def waited(h: Harness) -> dict[str, float]:
    return {n: r.started - h.submitted[n] for r in h.ran for n in r.names}


@async_test
async def test_a_request_finding_the_instance_idle_runs_at_once() -> None:
    h = Harness(dynamic(8, delay=LONG), pace=None)
    await h.submit("first")  # nothing measured yet: no reason to wait
    # One client: a request every 50 ms, a batch takes 10 ms; the instance is idle each time.
    await drive(h, [(0.05 * k, f"r{k}") for k in range(1, 6)], compute=0.01)
    assert h.batches() == [["first"]] + [[f"r{k}"] for k in range(1, 6)]
    assert all(w == 0.0 for w in waited(h).values())
    assert all(r.batch_s == [0.0] for r in h.ran)


@async_test
async def test_a_burst_batches_and_no_request_waits_past_the_window_plus_one_batch() -> None:
    delay, compute = 0.03, 0.02
    h = Harness(dynamic(16, delay=delay), pace=None)
    # A request every 5 ms (4 per batch's compute) for 200 ms, then one every 100 ms.
    burst = [(0.005 * k, f"b{k}") for k in range(40)]
    quiet = [(0.3 + 0.1 * k, f"q{k}") for k in range(6)]
    await drive(h, burst + quiet, compute=compute)
    wait = waited(h)
    assert wait["b0"] == 0.0  # the first found the instance idle
    assert max(wait.values()) <= delay + compute + 1e-9
    # Once arrivals outpace a batch, a free instance holds a partial batch for its window...
    assert any(w == pytest.approx(delay) for w in wait.values())
    assert max(len(b) for b in h.batches()) > 1
    # ...and once they slow down again, each request runs at once.
    assert [wait[f"q{k}"] for k in range(3, 6)] == [0.0, 0.0, 0.0]


def test_measured_pace() -> None:
    pace = MeasuredPace(max_delay_s=0.003)
    assert not pace.batch_can_grow(1)  # nothing measured
    for k in range(10):
        pace.arrived(k * 0.001)  # 1 ms apart
    assert not pace.batch_can_grow(1)  # no batch measured yet
    pace.ran(0.004)  # 4 arrivals per batch
    assert pace.batch_can_grow(1) and pace.batch_can_grow(3)
    assert not pace.batch_can_grow(4)  # 4 instances run them one by one
    pace.arrived(60.0)  # a minute idle counts as a capped gap: a few arrivals decide again
    for k in range(1, 4):
        pace.arrived(60.0 + k * 0.001)
    assert pace.batch_can_grow(1)
