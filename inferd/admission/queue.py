"""A bounded priority queue of requests that are accepted but not yet handed to the engine.

Bounds: at most `max_requests` entries and at most `max_prompt_tokens` prompt tokens in total;
a push past either bound raises QueueFullError and changes nothing (token-aware, so a burst of
huge prompts cannot exhaust memory). Order: lowest `priority` value first, FIFO (push order)
within one value. Deadlines: `expire(now)` removes and returns every entry whose deadline is
<= now.

Algorithm: two lazy heaps (inferd.admission.lazy_heap) over the same live entries, one keyed
by priority for `pop`, one by deadline for `expire`, plus a dict request_id -> entry. Removal
from the middle (`remove`, or an entry leaving through the other heap) only marks the entry
dead; the heaps drop dead items when they surface and rebuild when dead items outnumber live
ones. Every operation is O(log n) amortized. Pure Python, no torch.

>>> q: AdmissionQueue[str] = AdmissionQueue(max_requests=2, max_prompt_tokens=100)
>>> q.push("a", "A", num_prompt_tokens=10, priority=1)
>>> q.push("b", "B", num_prompt_tokens=10, priority=0)
>>> [q.pop().request_id, q.pop().request_id]
['b', 'a']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from inferd.admission.lazy_heap import LazyHeap
from inferd.errors import QueueFullError

T = TypeVar("T")


@dataclass(eq=False)
class QueueEntry(Generic[T]):
    request_id: str
    item: T
    num_prompt_tokens: int
    priority: int
    deadline: float | None  # time.monotonic() seconds; None: never expires
    seq: int  # push order: the FIFO tie-break within one priority
    alive: bool = field(default=True, repr=False)


class AdmissionQueue(Generic[T]):
    def __init__(self, max_requests: int, max_prompt_tokens: int) -> None:
        if max_requests < 1 or max_prompt_tokens < 1:
            raise ValueError("queue bounds must be >= 1")
        self.max_requests = max_requests
        self.max_prompt_tokens = max_prompt_tokens
        self._entries: dict[str, QueueEntry[T]] = {}
        self._by_priority: LazyHeap[int, QueueEntry[T]] = LazyHeap(_is_alive)
        self._by_deadline: LazyHeap[float, QueueEntry[T]] = LazyHeap(_is_alive)
        self._num_prompt_tokens = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    def push(
        self,
        request_id: str,
        item: T,
        *,
        num_prompt_tokens: int,
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Adds an entry, or raises QueueFullError (nothing changes) if a bound would be passed."""
        if request_id in self._entries:
            raise ValueError(f"request id {request_id!r} is already queued")
        if num_prompt_tokens < 0:
            raise ValueError("num_prompt_tokens must be >= 0")
        self._check_room(num_prompt_tokens)
        entry = QueueEntry(request_id, item, num_prompt_tokens, priority, deadline, next(self._seq))
        self._entries[request_id] = entry
        self._num_prompt_tokens += num_prompt_tokens
        # Pushes happen in `seq` order, so the heaps' own FIFO tie-break is the seq order.
        self._by_priority.push(priority, entry)
        if deadline is not None:
            self._by_deadline.push(deadline, entry)

    def _check_room(self, num_prompt_tokens: int) -> None:
        if len(self._entries) >= self.max_requests:
            raise QueueFullError(
                f"the queue holds its maximum of {self.max_requests} requests",
                reason="requests",
            )
        if self._num_prompt_tokens + num_prompt_tokens > self.max_prompt_tokens:
            raise QueueFullError(
                f"the queue holds {self._num_prompt_tokens} prompt tokens; {num_prompt_tokens} "
                f"more would pass its maximum of {self.max_prompt_tokens}",
                reason="tokens",
            )

    def entries(self) -> Iterator[QueueEntry[T]]:
        """The queued entries in push order (not pop order)."""
        return iter(self._entries.values())

    def peek(self) -> QueueEntry[T] | None:
        """The entry `pop` would return, without removing it."""
        top = self._by_priority.peek()
        return None if top is None else top[1]

    def pop(self) -> QueueEntry[T] | None:
        """Removes and returns the first entry: lowest priority value, then earliest pushed."""
        top = self._by_priority.pop()
        if top is None:
            return None
        self._discard(top[1])
        return top[1]

    def remove(self, request_id: str) -> QueueEntry[T] | None:
        """Removes an entry by id (a client gave up); None if it is not queued."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._discard(entry)
        return entry

    def expire(self, now: float) -> list[QueueEntry[T]]:
        """Removes and returns the entries whose deadline is <= now, earliest deadline first."""
        expired = self._by_deadline.pop_through(now)
        for entry in expired:
            self._discard(entry)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued entries, None if none has one."""
        top = self._by_deadline.peek()
        return None if top is None else top[0]

    def _discard(self, entry: QueueEntry[T]) -> None:
        entry.alive = False
        del self._entries[entry.request_id]
        self._num_prompt_tokens -= entry.num_prompt_tokens
        live = len(self._entries)
        self._by_priority.compact(live)
        self._by_deadline.compact(live)

    def time_to_next_deadline(self, now: float) -> float:
        """Seconds until the next deadline (0 if one has passed), math.inf if there is none."""
        deadline = self.next_deadline()
        return math.inf if deadline is None else max(0.0, deadline - now)


def _is_alive(entry: QueueEntry[T]) -> bool:
    return entry.alive
