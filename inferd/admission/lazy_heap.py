"""A binary min-heap whose items can leave from the middle in O(1): lazy deletion.

    heap: LazyHeap[float, Request] = LazyHeap(lambda r: not r.is_finished)
    heap.push(r.deadline, r)
    for r in heap.pop_through(now):    # every live item with key <= now, smallest key first
        ...

The owner says which items are still wanted through `is_live(item)`, evaluated when an item
reaches the top; a dead item is dropped there instead of being searched for when it dies. Equal
keys pop in push order (a sequence number breaks ties, so items are never compared).
`compact(num_live)` rebuilds the heap once dead items outnumber live ones, which keeps memory
O(live) and every operation O(log n) amortized. Pure Python.

Used by the admission queue (priority and deadline orders), the scheduler's priority waiting
queue and its deadline order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class _Ordered(Protocol):
    # `Any`: keys compare with keys of their own type (floats, ints, tuples); Protocols cannot
    # say "Self of the implementing type" for builtins.
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)
T = TypeVar("T")

# Rebuild only when dead items exceed the live ones by this much (tiny heaps never rebuild).
_COMPACT_SLACK = 32


class LazyHeap(Generic[K, T]):
    """Min-heap of `(key, item)`; items for which `is_live` is False are skipped and dropped."""

    def __init__(self, is_live: Callable[[T], bool]) -> None:
        self._is_live = is_live
        self._heap: list[tuple[K, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Items held, dead ones not yet dropped included (the owner counts live ones)."""
        return len(self._heap)

    def push(self, key: K, item: T) -> None:
        heapq.heappush(self._heap, (key, next(self._seq), item))

    def peek(self) -> tuple[K, T] | None:
        """The live item with the smallest key (first pushed among equals), without removing it."""
        heap = self._heap
        while heap and not self._is_live(heap[0][2]):
            heapq.heappop(heap)
        return (heap[0][0], heap[0][2]) if heap else None

    def pop(self) -> tuple[K, T] | None:
        top = self.peek()
        if top is not None:
            heapq.heappop(self._heap)
        return top

    def pop_through(self, bound: K) -> list[T]:
        """Removes and returns every live item whose key is <= `bound`, smallest key first."""
        out: list[T] = []
        while (top := self.peek()) is not None and not bound < top[0]:
            heapq.heappop(self._heap)
            out.append(top[1])
        return out

    def compact(self, num_live: int) -> None:
        """Drops dead items if they outnumber the `num_live` live ones (plus some slack)."""
        if len(self._heap) <= 2 * num_live + _COMPACT_SLACK:
            return
        self._heap = [e for e in self._heap if self._is_live(e[2])]
        heapq.heapify(self._heap)
