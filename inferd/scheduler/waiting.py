"""The waiting requests' order: the scheduling policy (`--scheduling-policy fcfs | priority`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from inferd.admission.lazy_heap import LazyHeap
from inferd.scheduler.request import Request


class WaitingQueue(Protocol):
    """Order in which waiting requests are admitted: the scheduling policy."""

    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...


class FcfsQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival_time) first; a preempted request keeps its place by its key."""

    def __init__(self) -> None:
        # The queued requests by id; a heap item whose request is not (or no longer) here is
        # stale and skipped, so `remove` is O(1).
        self._members: dict[str, Request] = {}
        self._heap: LazyHeap[tuple[int, float], Request] = LazyHeap(self._is_member)

    def _is_member(self, request: Request) -> bool:
        return self._members.get(request.request_id) is request

    def push(self, request: Request) -> None:
        assert request.request_id not in self._members, "a request is queued once"
        self._members[request.request_id] = request
        self._heap.push((request.priority, request.arrival_time), request)

    def push_front(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request:
        top = self._heap.peek()
        assert top is not None, "peek on an empty queue"
        return top[1]

    def pop(self) -> Request:
        top = self._heap.pop()
        assert top is not None, "pop on an empty queue"
        del self._members[top[1].request_id]
        return top[1]

    def remove(self, request: Request) -> None:
        if self._members.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        del self._members[request.request_id]
        self._heap.compact(len(self._members))

    def __len__(self) -> int:
        return len(self._members)
