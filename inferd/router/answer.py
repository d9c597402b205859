"""Reading a replica's answer on its way to the client: the router's `route` time goes into
`timings`, and the replica's own `usage` (prompt and cached tokens) comes out, for the prefix
index's correction (Cluster.reported).

Bodies are parsed only when they carry `timings` or `cached_tokens`; anything else, or anything
that is not JSON, passes through byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Usage:
    """What the replica said it did with the prompt (OpenAI's `usage`)."""

    prompt_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, doc: dict[str, object]) -> Usage | None:
        """`usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`, when both are
        there and are counts."""
        usage = doc.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if not isinstance(usage, dict) or not isinstance(details, dict):
            return None
        prompt, cached = usage.get("prompt_tokens"), details.get("cached_tokens")
        if isinstance(prompt, int) and isinstance(cached, int):
            return cls(prompt, cached)
        return None


def read_answer(body: bytes, route_s: float) -> tuple[bytes, Usage | None]:
    """The body with `timings.route` (seconds, first) added when it carries `timings`, and its
    usage when it reports one."""
    if b'"timings"' not in body and b'"cached_tokens"' not in body:
        return body, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, None
    if not isinstance(doc, dict):
        return body, None
    usage = Usage.of(doc)
    timings = doc.get("timings")
    if not isinstance(timings, dict):
        return body, usage
    doc["timings"] = {"route": round(route_s, 6), **timings}
    return orjson.dumps(doc), usage


class SSEEvents:
    r"""Re-cuts a byte stream at SSE event boundaries (a blank line) so the event that carries
    `timings` (the last one) gets `route` added, and the one that carries `usage` (with
    `stream_options.include_usage`) is read; every complete event leaves at once, only a
    partial one waits for its end.

    >>> e = SSEEvents(0.5)
    >>> e.feed(b'data: {"a": 1}\n\ndata: {"timings": {"e2e')
    b'data: {"a": 1}\n\n'
    >>> e.feed(b'": 1}}\n\n')
    b'data: {"timings":{"route":0.5,"e2e":1}}\n\n'
    """

    def __init__(self, route_s: float) -> None:
        self.route_s = route_s
        self.pending = b""
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return b""
        done, self.pending = data[: cut + 2], data[cut + 2 :]
        if b'"timings"' not in done and b'"cached_tokens"' not in done:
            return done
        return b"\n\n".join(self._event(e) for e in done.split(b"\n\n"))

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        payload = event[6:]
        body, usage = read_answer(payload, self.route_s)
        self.usage = usage or self.usage
        return event if body is payload else b"data: " + body
