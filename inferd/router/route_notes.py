"""The Ray Serve path's `route` stage: each request's routing decision, handed from the request
router to the ingress, and added to the replica's answer as `inferd router` adds it.

Both run in the ingress's process, the router possibly on its own event-loop thread: the router
`put`s a note under Serve's internal request id (which the ingress's handle call carries), and the
ingress `take`s it once the replica's answer starts, then rewrites the body on its way out
(`timings.route`, router/answer.py) and sets `x-inferd-route-cached-tokens`. Nothing here imports
ray, so it is tested on its own.

    NOTES.put("req-1", RouteNote(decision_s=0.0002, replica="r1", cached_tokens=64))
    note = NOTES.take("req-1")
    body = with_route_timing(parts, "text/event-stream", tokenize_s + note.decision_s)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inferd.router.answer import SSEEvents, read_answer


@dataclass(frozen=True)
class RouteNote:
    """One request's decision: the policy's time, the replica it went to, and the prompt tokens
    the prefix index expected cached there."""

    decision_s: float
    replica: str
    cached_tokens: int


class RouteNotes:
    """Notes by request id, at most `limit` (a request cancelled before its answer starts never
    takes its note: the oldest go first)."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._notes: OrderedDict[str, RouteNote] = OrderedDict()
        self._lock = threading.Lock()  # the router may run on its own thread's event loop

    def put(self, request_id: str, note: RouteNote) -> None:
        with self._lock:
            self._notes[request_id] = note
            while len(self._notes) > self._limit:
                self._notes.popitem(last=False)

    def take(self, request_id: str) -> RouteNote | None:
        with self._lock:
            return self._notes.pop(request_id, None)


NOTES = RouteNotes()


def rewrites(content_type: str) -> bool:
    """Whether `with_route_timing` may change a body of this type (its length then changes)."""
    return content_type.startswith(("text/event-stream", "application/json"))


async def with_route_timing(
    parts: AsyncIterator[bytes], content_type: str, route_s: float
) -> AsyncIterator[bytes]:
    """The answer's body with `timings.route` added: an event stream event by event as it
    arrives, a JSON body once whole (one chunk in practice), anything else untouched."""
    if content_type.startswith("text/event-stream"):
        events = SSEEvents(route_s)
        async for chunk in parts:
            if out := events.feed(chunk):
                yield out
        if events.pending:
            yield events.pending
    elif content_type.startswith("application/json"):
        body = b"".join([chunk async for chunk in parts])
        yield read_answer(body, route_s)[0]
    else:
        async for chunk in parts:
            yield chunk
