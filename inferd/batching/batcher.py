"""The dynamic batcher of one model: which queued requests run together, when, and on which
worker.

    batcher = DynamicBatcher(policy, backends, run=..., done=..., expired=...)
    batcher.start()                        # in the running event loop
    batcher.submit(item, rows=2, key=8, length=7, priority=1, deadline=t)  # QueueFullError
    # later, on a worker thread:   result = run(backend, [Queued(item), ...])
    # then, on the event loop:     done([Queued(item), ...], result)

Batch rules (Triton's dynamic batcher), checked per length bucket (`key`): a batch holds at
most `max_batch_size` rows and is sent at once when the bucket holds that many rows, or when it
holds at least a preferred batch size (the largest such size caps the batch), or when its
oldest request has waited `max_delay_s`. Without dynamic batching (or with no batch dimension)
every request runs alone as soon as a worker is free.

No wait when waiting cannot help (unlike Triton): the `max_delay_s` window holds a partial
batch on a free worker only while the batch can actually grow, i.e. while requests arrive
faster than one batch runs (more arrivals during one batch's compute than there are workers;
`Pace`, from moving means of the arrival gap and of dispatch-to-finish times). Otherwise a
request that finds a worker free runs at once, with whatever is queued beside it. Requests that
arrive while every worker is busy queue as before and go together when one frees (their wait
for the busy instance counts toward the window), so a burst still batches: no request waits
longer than the window plus the batch running when it arrived (with fewer rows queued than
fit in one batch). Worked example, window 3 ms, a batch of 1 takes 4 ms: one client sends
every ~5 ms (gap > compute), each request runs at once, 0 ms of batching; 8 clients send
every ~1 ms, the first request of a quiet instance waits up to 3 ms for the others.

Order: among buckets that are ready, the one whose first request has the best (priority,
arrival) goes first. Within a bucket the order is the AdmissionQueue's: lowest priority value
first, FIFO within one value; a batch stops at the first request that does not fit, so a big
request is never overtaken forever by small ones.

Which lengths share a batch (variable-length inputs): the buckets decide *when* a batch goes
(the rules above) and which request leads it (the ready bucket's first); *which* requests go
with it is cut by cost. Every queued request of the lead's `group` (all buckets), ordered by
length, is split into the contiguous length ranges that minimize the sum of their calls' costs,
`overhead + rows x longest` (`cost`: the model's call overhead, timed when it loads; see
inferd.batching.cost), and the batch is the range that holds the lead: the lead first, then the
range's requests in (priority, arrival) order, stopping at the first that does not fit. So a
short request is padded to a long one's length only where that costs less than a call of its
own, and requests of adjacent buckets that are close in length share a call. A request's
`length` is its longest variable dim; the cost model is exact for inputs with one variable dim
(token ids [n, L]). Where the overhead is unknown (the model could not be timed) a batch is the
lead's bucket, in the bucket's order, filled from the other buckets of its group (closest
length first) while the padding ratio (padded / total elements) stays <= `max_padding_ratio`.

Threading: everything here runs on the event loop except `run`, which runs on one of
`len(backends)` worker threads with exclusive use of one backend (a backend need not be
thread-safe). Per batch there is one hop to a worker and one `call_soon_threadsafe` back.
Nothing sleeps: arrivals and finished batches call `_schedule`, and one timer wakes it for the
next batch delay or queue deadline (deadlines fire even when no batch runs).

Time: every instant (arrival, dispatch, timer) comes from one injectable `Clock`; the default is
time.monotonic() with the running loop's timers. Tests pass a fake clock they advance by hand,
so "sent when the oldest request has waited max_delay_s" is checked exactly, not within a
tolerance of the machine's load.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from inferd.admission.queue import AdmissionQueue, QueueEntry
from inferd.admission.retry_after import CompletionRate
from inferd.batching.buckets import BatchShape, Bucket
from inferd.batching.buckets import Queued as Queued  # re-exported: the batcher's message
from inferd.batching.clock import MONOTONIC, Clock, Timer
from inferd.batching.cost import CallCost, FixedCallCost, lead_range
from inferd.batching.pace import MeasuredPace, Pace
from inferd.errors import QueueFullError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Closable(Protocol):
    def close(self) -> None: ...


B = TypeVar("B", bound=Closable)

# Completion rate window for the Retry-After hint of a full queue.
_RATE_WINDOW = 256
# A timer may fire a hair before its deadline; treat that as on time instead of re-arming.
_EPSILON_S = 1e-6


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch is sent (from the model config; see inferd.batching.pipeline)."""

    max_batch_size: int = 0  # rows per batch
    dynamic: bool = False  # False: every request runs alone (no dynamic_batching, or no batch dim)
    max_delay_s: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()  # ascending, each <= max_batch_size
    max_queue_size: int = 1024
    max_padding_ratio: float = 0.0  # cross-bucket filling bound; 0: a batch is one bucket

    def __post_init__(self) -> None:
        if self.max_queue_size < 1:
            raise ValueError("max_queue_size must be >= 1")
        if not 0.0 <= self.max_padding_ratio < 1.0:
            raise ValueError("max_padding_ratio must be in [0, 1)")
        if self.dynamic and self.max_batch_size < 1:
            raise ValueError("dynamic batching needs max_batch_size >= 1")
        usable = sorted({s for s in self.preferred_batch_sizes if 1 <= s <= self.max_batch_size})
        object.__setattr__(self, "preferred_batch_sizes", tuple(usable))


class DynamicBatcher(Generic[T, B, R]):
    def __init__(
        self,
        policy: BatchPolicy,
        backends: Sequence[B],
        *,
        run: Callable[[B, list[Queued[T]]], R],
        done: Callable[[list[Queued[T]], R | BaseException], None],
        expired: Callable[[T], None],
        name: str = "model",
        clock: Clock = MONOTONIC,
        pace: Pace | None = None,
        cost: CallCost | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a batcher needs at least one backend")
        self.policy = policy
        self._backends = list(backends)
        self._free: list[B] = []
        self._run = run
        self._done = done
        self._expired = expired
        self._name = name
        self._clock = clock
        self._pace = pace if pace is not None else MeasuredPace(policy.max_delay_s)
        self.cost = cost if cost is not None else FixedCallCost(None)  # set before start()
        self._buckets: dict[Hashable, Bucket[T]] = {}
        self._num_queued = 0
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._timer: Timer | None = None
        self._timer_due = math.inf  # when `_timer` fires: a Timer need not say (clock.py)
        self._schedule_soon = False
        self._closed = False
        self._completions = CompletionRate(_RATE_WINDOW)  # requests finished, for Retry-After

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Binds to the running loop and starts the workers (threads start on first use)."""
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(
            max_workers=len(self._backends), thread_name_prefix=f"inferd-{self._name}"
        )
        self._free = list(self._backends)

    async def close(self) -> list[T]:
        """Stops batching: returns what was still queued (the caller fails it), closes the free
        backends, and lets each busy one close when its batch returns. Idempotent."""
        if self._closed:
            return []
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        left = [q.item for b in self._buckets.values() for q in _drain(b.queue)]
        self._buckets.clear()
        self._num_queued = 0
        free, self._free = self._free, []
        await asyncio.gather(*(asyncio.to_thread(_close_quietly, b) for b in free))
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=False)
        return left

    # -- admission ---------------------------------------------------------------------------

    def now(self) -> float:
        """The batcher's clock (`Queued.enqueued` is an instant of it)."""
        return self._clock.now()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def idle(self) -> bool:
        """Whether a request submitted now runs at once and alone: a worker is free, nothing
        is queued, and requests arrive slower than a batch runs (waiting cannot grow it)."""
        return (
            bool(self._free)
            and not self._num_queued
            and not self._pace.batch_can_grow(len(self._backends))
        )

    def submit(
        self,
        item: T,
        *,
        rows: int,
        key: Hashable = 0,
        length: int = 0,
        group: Hashable = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Queued[T]:
        """Queues one request (on the loop). Raises QueueFullError (with a Retry-After hint).

        `key` is its length bucket; `length` its longest variable dim (0: none, then it never
        joins another bucket's batch); `group` which buckets may share a batch (the requests of
        one key share one group)."""
        if self._loop is None or self._closed:
            raise RuntimeError("the batcher is not running")
        self.check_room()
        now = self._clock.now()
        queued = Queued(item, rows, key, next(self._seq), now, length)
        self._pace.arrived(now)
        bucket = self._buckets.get(key)
        if bucket is None:
            max_rows = self.policy.max_queue_size * max(1, self.policy.max_batch_size)
            bucket = self._buckets[key] = Bucket(self.policy.max_queue_size, max_rows, group)
        bucket.push(queued, priority, deadline)
        self._num_queued += 1
        # Arrivals of one loop iteration share one scheduling pass (and so can share a batch).
        if not self._schedule_soon:
            self._schedule_soon = True
            self._loop.call_soon(self._schedule)
        return queued

    def check_room(self, waiting: int = 0) -> None:
        """QueueFullError (with a Retry-After hint) unless one more request fits, counting
        `waiting` requests the caller holds for this queue (e.g. still preprocessing)."""
        if self._num_queued + waiting >= self.policy.max_queue_size:
            raise QueueFullError(
                f"model {self._name!r} has {self._num_queued + waiting} requests waiting, "
                f"its maximum",
                retry_after=self.retry_after(),
            )

    def remove(self, queued: Queued[T]) -> bool:
        """Takes a still-queued request out (its client went away); False if it already left."""
        bucket = self._buckets.get(queued.key)
        if bucket is None or bucket.queue.remove(queued.request_id) is None:
            return False
        self._num_queued -= 1
        self._drop_if_empty(queued.key, bucket)
        return True

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained, from the recent completion rate."""
        return self._completions.retry_after(self._num_queued)

    # -- scheduling (event loop) -------------------------------------------------------------

    def _schedule(self) -> None:
        self._schedule_soon = False
        if self._closed:
            return
        now = self._clock.now()
        self._expire(now)
        due = math.inf
        while self._free and self._buckets:
            key, limit, due = self._pick(now)
            if key is None:
                break
            self._dispatch(key, limit, now)
        self._arm(due if self._free else math.inf)

    def _expire(self, now: float) -> None:
        for key, bucket in list(self._buckets.items()):
            for entry in bucket.queue.expire(now + _EPSILON_S):
                self._num_queued -= 1
                self._expired(entry.item.item)
            self._drop_if_empty(key, bucket)

    def _pick(self, now: float) -> tuple[Hashable | None, int, float]:
        """The ready bucket whose first request ranks best, its row limit, and the earliest
        time a bucket that is not ready becomes ready by delay."""
        best: Hashable | None = None
        best_rank = (math.inf, math.inf)
        best_limit = 0
        due = math.inf
        for key, bucket in self._buckets.items():
            limit, ready_at = self._limit(bucket, now)
            if limit is None:
                due = min(due, ready_at)
                continue
            head = bucket.queue.peek()
            assert head is not None  # empty buckets are deleted
            rank = (head.priority, head.item.seq)
            if rank < best_rank:
                best, best_rank, best_limit = key, rank, limit
        return best, best_limit, due

    def _limit(self, bucket: Bucket[T], now: float) -> tuple[int | None, float]:
        """(rows the batch may take, now) when the bucket should be sent; (None, when it will
        be ready) otherwise. A limit of 0 takes exactly one request."""
        policy = self.policy
        if not policy.dynamic:
            return 0, now
        rows = bucket.queue.num_prompt_tokens
        if rows >= policy.max_batch_size:
            return policy.max_batch_size, now
        preferred = policy.preferred_batch_sizes
        i = bisect.bisect_right(preferred, rows)
        if i > 0:
            return preferred[i - 1], now
        ready_at = bucket.oldest().enqueued + policy.max_delay_s
        if now + _EPSILON_S >= ready_at or not self._pace.batch_can_grow(len(self._backends)):
            return policy.max_batch_size, now
        return None, ready_at

    def _dispatch(self, key: Hashable, limit: int, now: float) -> None:
        bucket = self._buckets[key]
        policy = self.policy
        window_start = bucket.oldest().enqueued
        batch: list[Queued[T]] = []
        lead = bucket.queue.peek()
        assert lead is not None  # empty buckets are deleted
        overhead = self.cost.overhead_elements() if policy.dynamic else None
        if overhead is not None and lead.item.length > 0:
            self._cut(bucket.group, lead, limit, overhead, batch)
        else:
            shape = BatchShape()
            self._take(key, bucket, limit, batch, shape, math.inf)
            if policy.dynamic and policy.max_padding_ratio > 0 and shape.longest > 0:
                self._fill(key, bucket.group, limit, batch, shape)
        # A request taken from another bucket may be older than this bucket's oldest.
        window_start = min(window_start, min(q.enqueued for q in batch))
        # The batching window closes max_delay after the batch's oldest request arrived.
        window_end = window_start + policy.max_delay_s if policy.dynamic else -math.inf
        for queued in batch:
            queued.batch_s = max(0.0, min(now, window_end) - queued.enqueued)
            queued.queue_s = now - queued.enqueued - queued.batch_s
        backend = self._free.pop()
        assert self._pool is not None
        self._pool.submit(self._work, backend, batch, now)

    def _take(
        self,
        key: Hashable,
        bucket: Bucket[T],
        limit: int,
        batch: list[Queued[T]],
        shape: BatchShape,
        max_ratio: float,
    ) -> None:
        """Moves requests from `bucket` into `batch` in the bucket's order until the first one
        that would pass `limit` rows (an empty batch takes one anyway) or `max_ratio`."""
        queue = bucket.queue
        taken = 0
        while (entry := queue.peek()) is not None:
            queued = entry.item
            if batch and shape.rows + queued.rows > limit:
                break
            if shape.ratio_with(queued) > max_ratio + _EPSILON_S:
                break
            queue.pop()
            batch.append(queued)
            shape.add(queued)
            taken += 1
        self._num_queued -= taken
        self._drop_if_empty(key, bucket)

    def _cut(
        self,
        group: Hashable,
        lead: QueueEntry[Queued[T]],
        limit: int,
        overhead: float,
        batch: list[Queued[T]],
    ) -> None:
        """Moves into `batch` the lead and the requests of its cheapest length range (see the
        module docstring), up to `limit` rows."""
        found = [
            (entry, key)
            for key, bucket in self._buckets.items()
            if bucket.group == group
            for entry in bucket.queue.entries()
            if entry.item.length > 0
        ]
        rows_by_length: dict[int, int] = {}
        for entry, _ in found:
            length = entry.item.length
            rows_by_length[length] = rows_by_length.get(length, 0) + entry.item.rows
        shortest, longest = lead_range(rows_by_length, lead.item.length, overhead, max(1, limit))
        chosen = sorted(
            (e for e in found if shortest <= e[0].item.length <= longest and e[0] is not lead),
            key=lambda e: (e[0].priority, e[0].item.seq),
        )
        rows = 0
        for entry, key in [(lead, lead.item.key), *chosen]:
            queued = entry.item
            if batch and rows + queued.rows > limit:
                break
            bucket = self._buckets[key]
            bucket.queue.remove(entry.request_id)
            batch.append(queued)
            rows += queued.rows
            self._num_queued -= 1
            self._drop_if_empty(key, bucket)

    def _fill(
        self,
        key: Hashable,
        group: Hashable,
        limit: int,
        batch: list[Queued[T]],
        shape: BatchShape,
    ) -> None:
        """Fills the rows `batch` has to spare from the other buckets of its group, closest
        length first, while the padding ratio stays <= max_padding_ratio."""
        candidates = []
        for other_key, other in self._buckets.items():
            head = other.queue.peek()
            if other_key == key or other.group != group or head is None or head.item.length < 1:
                continue
            candidates.append((abs(head.item.length - shape.longest), head.item.seq, other_key))
        for _, _, other_key in sorted(candidates):
            if shape.rows >= limit:
                break
            other = self._buckets[other_key]
            self._take(other_key, other, limit, batch, shape, self.policy.max_padding_ratio)

    def _drop_if_empty(self, key: Hashable, bucket: Bucket[T]) -> None:
        if not len(bucket.queue) and self._buckets.get(key) is bucket:
            del self._buckets[key]

    def _arm(self, due: float) -> None:
        """One timer for the next batch delay (only useful with a free worker) or deadline."""
        for bucket in self._buckets.values():
            deadline = bucket.queue.next_deadline()
            if deadline is not None and deadline < due:
                due = deadline
        if due == math.inf:
            return
        timer = self._timer
        if timer is not None and not timer.cancelled() and self._timer_due <= due:
            return  # an earlier wake-up is armed; it re-arms for this one
        if timer is not None:
            timer.cancel()
        self._timer = self._clock.call_at(due, self._on_timer)
        self._timer_due = due

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    # -- workers -----------------------------------------------------------------------------

    def _work(self, backend: B, batch: list[Queued[T]], sent: float) -> None:
        """Worker thread: one batch on one backend, then one hop back to the loop."""
        result: R | BaseException
        try:
            result = self._run(backend, batch)
        except BaseException as exc:  # delivered to every request of the batch by `done`
            result = exc
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, backend, batch, result, sent)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            _close_quietly(backend)

    def _finish(
        self, backend: B, batch: list[Queued[T]], result: R | BaseException, sent: float
    ) -> None:
        now = self._clock.now()
        self._pace.ran(now - sent)
        self._completions.record(now, len(batch))
        if self._closed:
            assert self._loop is not None
            self._loop.run_in_executor(None, _close_quietly, backend)
        else:
            self._free.append(backend)
        try:
            self._done(batch, result)
        finally:
            self._schedule()


def _drain(queue: AdmissionQueue[Queued[T]]) -> list[Queued[T]]:
    out = []
    while (entry := queue.pop()) is not None:
        out.append(entry.item)
    return out


def _close_quietly(backend: Any) -> None:
    try:
        backend.close()
    except Exception:  # closing is best effort; the model is going away either way
        logger.exception("closing a backend failed")
