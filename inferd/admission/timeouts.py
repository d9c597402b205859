"""A request's timeout against the server's: the one rule, "a request may only shorten it".

Both lanes apply it: the LLM front (`--request-timeout` and a body's `timeout`) and the classic
lane (a model's default queue timeout and a request's `timeout` parameter).

>>> effective_timeout(30.0, 5.0), effective_timeout(30.0, 90.0), effective_timeout(None, 5.0)
(5.0, 30.0, 5.0)
>>> deadline_at(100.0, None, None) is None
True
"""

from __future__ import annotations


def effective_timeout(server_s: float | None, request_s: float | None) -> float | None:
    """The shorter of the two; None (no deadline) only when neither is set."""
    if server_s is None:
        return request_s
    if request_s is None:
        return server_s
    return min(server_s, request_s)


def deadline_at(now: float, server_s: float | None, request_s: float | None) -> float | None:
    """The monotonic instant the request's effective timeout ends, None for no deadline."""
    timeout = effective_timeout(server_s, request_s)
    return None if timeout is None else now + timeout
