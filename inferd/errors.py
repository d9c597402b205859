"""One error taxonomy, mapped to the request's life.

Each protocol maps these to its own status codes (the HTTP gateway: 400/404/413/429/503).
"""

from __future__ import annotations


class InferdError(Exception):
    """Base of every error inferd raises on purpose."""


class InvalidRequestError(InferdError, ValueError):
    """Bad input, found before the request is queued (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextWindowError(InvalidRequestError):
    """The prompt, or prompt + max_tokens, does not fit the model's context window (HTTP 400,
    code "context_length_exceeded")."""


class ModelLoadError(InferdError):
    """A model folder, file, tensor or architecture that cannot be loaded.

    The message says what is wrong and where."""


class EngineDeadError(InferdError):
    """The engine loop stopped; every in-flight request fails with this."""


class QueueFullError(InferdError):
    """The admission queue is at its request or prompt-token bound (HTTP 429 with Retry-After).

    `reason` is "requests" or "tokens"; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, *, reason: str = "requests", retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class QueueTimeoutError(InferdError):
    """The request's deadline passed before it was scheduled (HTTP 503, code "queue_timeout")."""


class DeadlineExceededError(QueueTimeoutError):
    """The request's deadline passed while it ran, and nothing partial can be returned (the image
    lane, between denoising steps). A QueueTimeoutError, so a protocol that maps only that
    answers 503 as for a deadline passed while waiting."""


class DrainingError(InferdError):
    """The server is shutting down and admits nothing new (HTTP 503)."""


class OutputBacklogError(InferdError):
    """A consumer read too slowly: its unread output passed the bound, so it was aborted."""


class ModelNotFoundError(InferdError):
    """No such model (or version) in the repository (HTTP 404, gRPC NOT_FOUND)."""


class ModelNotReadyError(InferdError):
    """The model exists but is loading, unloading, unloaded or failed (HTTP 503, UNAVAILABLE)."""


class ModelConfigError(ModelLoadError):
    """A model's config.yaml is invalid; the message names the field."""
