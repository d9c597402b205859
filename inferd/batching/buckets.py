"""What the dynamic batcher holds: a queued request (`Queued`), the requests of one length
bucket (`Bucket`), and the rows and padding of a forming batch (`BatchShape`). Used by
batcher.py only; `Queued` is re-exported there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from inferd.admission.queue import AdmissionQueue

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Queued(Generic[T]):
    """One accepted request as the batcher sees it. `queue_s`/`batch_s` are set at dispatch."""

    item: T
    rows: int
    key: Hashable
    seq: int  # arrival order across every bucket
    enqueued: float  # the batcher clock's now() (time.monotonic() by default)
    length: int = 0  # longest variable dim (0: none), for the padding ratio of a batch
    # Its wait, split in two: `batch_s` inside its batch's window (max_queue_delay from the
    # batch's oldest request: the cost of the batching policy), `queue_s` the rest (every
    # instance was busy).
    queue_s: float = 0.0
    batch_s: float = 0.0

    @property
    def request_id(self) -> str:
        return str(self.seq)


class Bucket(Generic[T]):
    """Requests of one length bucket: the AdmissionQueue (order, deadlines, row count) plus
    arrival order, since with priority levels the oldest request need not be first in line."""

    def __init__(self, max_requests: int, max_rows: int, group: Hashable) -> None:
        self.queue: AdmissionQueue[Queued[T]] = AdmissionQueue(max_requests, max_rows)
        self.arrivals: deque[Queued[T]] = deque()
        self.group = group  # buckets of one group may share a batch

    def push(self, queued: Queued[T], priority: int, deadline: float | None) -> None:
        self.queue.push(
            queued.request_id,
            queued,
            num_prompt_tokens=queued.rows,
            priority=priority,
            deadline=deadline,
        )
        self.arrivals.append(queued)

    def oldest(self) -> Queued[T]:
        # Entries that left the queue (dispatched, expired, removed) are dropped lazily here;
        # a rebuild bounds the deque when a starved old request pins stale entries behind it.
        arrivals, queue = self.arrivals, self.queue
        while arrivals[0].request_id not in queue:
            arrivals.popleft()
        if len(arrivals) > 2 * len(queue) + 64:
            self.arrivals = deque(q for q in arrivals if q.request_id in queue)
        return self.arrivals[0]


@dataclass(slots=True)
class BatchShape:
    """Rows and elements of a forming batch, for its padding ratio: a request counts as
    `rows` x `length` elements, padded to the batch's longest `length`."""

    rows: int = 0
    elements: int = 0
    longest: int = 0

    def add(self, queued: Queued[Any]) -> None:
        self.rows += queued.rows
        self.elements += queued.rows * queued.length
        self.longest = max(self.longest, queued.length)

    def ratio_with(self, queued: Queued[Any]) -> float:
        """The padding ratio once `queued` joins: padded / total elements."""
        total = (self.rows + queued.rows) * max(self.longest, queued.length)
        if total == 0:
            return 0.0
        return 1.0 - (self.elements + queued.rows * queued.length) / total
