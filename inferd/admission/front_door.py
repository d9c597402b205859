"""The front door: which accepted requests wait, which go to the engine now, which expire.

    door: FrontDoor[AddRequest] = FrontDoor(AdmissionConfig(), max_num_seqs=64)
    deadline = door.deadline_for(now, request_timeout_s)     # the shorten-only rule
    door.enqueue("r1", message, num_prompt_tokens=12, priority=0, deadline=deadline)
    expired = door.expire(now)                               # -> QueueTimeoutError each
    for entry in door.release(engine_load, wanted=streams.__contains__):
        send(entry.item)                                     # hand to the engine

Pure policy, driven by `(now, load)`: no clock, no sockets, no tasks, so it is unit-tested
without an engine process. It owns the bounded admission queue (429 past its bounds, with a
Retry-After from the recent completion rate), the deadlines of requests not yet handed over (a
request's deadline moves with it into the engine, whose scheduler owns it from then on) and the
release policy below.

Release policy: the engine's backlog is what waits in its scheduler plus what was released but
not yet received there. It may hold enough to fill every free sequence slot (so a burst batches
as offline does), and only `min_engine_waiting` once KV memory passes the high watermark: the
rest wait here, where priority, deadlines and bounds apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from inferd.admission.queue import AdmissionQueue, QueueEntry
from inferd.admission.retry_after import CompletionRate
from inferd.admission.timeouts import deadline_at
from inferd.config import AdmissionConfig
from inferd.errors import QueueFullError

T = TypeVar("T")

# Past this KV usage the engine gets only `min_engine_waiting` more requests.
KV_HIGH_WATERMARK = 0.9
# Completions kept for the Retry-After rate.
_RATE_WINDOW = 256


class EngineLoad(Protocol):
    """The engine's state as of its last report (inferd.engine.messages.CoreStats has it)."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    # Requests the engine has received so far.
    @property
    def num_added_total(self) -> int: ...


class FrontDoor(Generic[T]):
    """Admission for one engine: the queue of `T` items (the engine's request messages)."""

    def __init__(self, limits: AdmissionConfig, max_num_seqs: int) -> None:
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        self._queue: AdmissionQueue[T] = AdmissionQueue(
            limits.max_queued_requests, limits.max_queued_tokens
        )
        self._completions = CompletionRate(_RATE_WINDOW)
        self._num_released = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queue

    @property
    def num_prompt_tokens(self) -> int:
        return self._queue.num_prompt_tokens

    # -- in ------------------------------------------------------------------------------------

    def deadline_for(self, now: float, timeout_s: float | None) -> float | None:
        """The request's deadline: its own timeout may only shorten the server's default."""
        return deadline_at(now, self.limits.request_timeout_s, timeout_s)

    def enqueue(
        self,
        request_id: str,
        item: T,
        *,
        num_prompt_tokens: int,
        priority: int,
        deadline: float | None,
    ) -> None:
        """Queues a request, or raises QueueFullError (with its Retry-After hint) at a bound."""
        try:
            self._queue.push(
                request_id,
                item,
                num_prompt_tokens=num_prompt_tokens,
                priority=priority,
                deadline=deadline,
            )
        except QueueFullError as e:
            e.retry_after = self.retry_after()
            raise

    def remove(self, request_id: str) -> QueueEntry[T] | None:
        """Takes a request out before it was released (aborted, or its client went away)."""
        return self._queue.remove(request_id)

    def clear(self) -> list[QueueEntry[T]]:
        """Empties the queue (the engine died or is shutting down); returns what was queued."""
        entries = []
        while (entry := self._queue.pop()) is not None:
            entries.append(entry)
        return entries

    # -- out -----------------------------------------------------------------------------------

    def expire(self, now: float) -> list[QueueEntry[T]]:
        """Removes and returns the queued requests whose deadline is <= now."""
        return self._queue.expire(now)

    def time_to_next_deadline(self, now: float) -> float:
        """Seconds until the next queued deadline (0 if one passed); math.inf if none."""
        return self._queue.time_to_next_deadline(now)

    def engine_room(self, load: EngineLoad) -> int:
        """How many more requests the engine should get now (<= 0: none)."""
        backlog = load.num_waiting + (self._num_released - load.num_added_total)
        target = self.limits.min_engine_waiting
        if load.kv_cache_usage < KV_HIGH_WATERMARK:
            target = max(target, self.max_num_seqs - load.num_running)
        return target - backlog

    def release(self, load: EngineLoad, wanted: Callable[[str], bool]) -> list[QueueEntry[T]]:
        """Pops the requests to hand the engine now, best first, as many as it has room for.

        A popped request that is no longer `wanted` (its caller is gone) is dropped and takes
        no room. The caller must send every returned item: they count as in flight."""
        room = self.engine_room(load)
        released: list[QueueEntry[T]] = []
        while len(released) < room:
            entry = self._queue.pop()
            if entry is None:
                break
            if wanted(entry.request_id):
                released.append(entry)
        self._num_released += len(released)
        return released

    # -- Retry-After ---------------------------------------------------------------------------

    def record_finish(self, now: float) -> None:
        """A request finished: feeds the completion rate behind Retry-After."""
        self._completions.record(now)

    def retry_after(self) -> float:
        """Seconds a rejected client should wait: the time to work off the queue, in [1, 60]."""
        return self._completions.retry_after(len(self._queue))
