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


class ModelLoadError(InferdError):
    """A model folder, file, tensor or architecture that cannot be loaded.

    The message says what is wrong and where."""


class EngineDeadError(InferdError):
    """The engine loop stopped; every in-flight request fails with this."""
