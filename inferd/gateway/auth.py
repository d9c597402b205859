"""Who may do what: API keys, their scopes and their per-key limits, for HTTP and gRPC alike.

    guard = Guard.from_config(server, metrics)         # None keys: authentication off
    admission = guard.admit("Bearer sk-...", admin=False)  # raises Refusal (401/403/429)
    ...                                                # serve; admission.headers() on the reply
    admission.done(tokens=57)                          # once, however the request ended

Keys come from `--api-key` and INFERD_API_KEY (scope admin, as today's single kind of key;
named `flag1`, `flag2`, ... in that order) and from `--api-key-file`, one key per line:

    # key            options (any order): a scope word, name=, rpm=, tpm=, concurrency=
    sk-live-1234     name=web       rpm=600 tpm=200000 concurrency=8
    sk-ops-5678      admin          name=ops

A file key's scope is `inference` unless it says `admin`; `name` labels its metrics (default
`key<N>`, the line number: never the key itself); rpm/tpm/concurrency override the server-wide
--rate-limit-* defaults for that key. `admin` may do everything `inference` may, plus change
server state: load and unload repository models (HTTP and gRPC) and LoRA adapters.

Every key is compared against the given token with `hmac.compare_digest`, all of them every
time, so the time taken says nothing about which key (or how much of one) matched.
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inferd.admission.rate_limit import (
    Clock,
    Decision,
    KeyLimiter,
    KeyLimits,
    LimitKind,
    rate_limit_headers,
)
from inferd.config import ServerConfig
from inferd.errors import InferdError
from inferd.telemetry.metrics import ServerMetrics

KeyScope = Literal["inference", "admin"]
_SCOPES: tuple[KeyScope, ...] = ("inference", "admin")
_LIMIT_OPTIONS = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute", "concurrency": ""}


class KeyFileError(InferdError):
    """--api-key-file cannot be read or has a malformed line (the message names the line)."""


@dataclass(frozen=True)
class ApiKey:
    secret: bytes = field(repr=False)
    name: str
    scope: KeyScope
    limits: KeyLimits = field(default_factory=KeyLimits)


def parse_key_file(text: str, defaults: KeyLimits, source: str = "api key file") -> list[ApiKey]:
    """The keys of a key file's text (see the module docstring for the format)."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if fields:
            keys.append(_parse_line(fields, defaults, f"{source}:{number}", f"key{number}"))
    return keys


def _parse_line(fields: list[str], defaults: KeyLimits, where: str, name: str) -> ApiKey:
    scope: KeyScope = "inference"
    limits = {
        "requests_per_minute": defaults.requests_per_minute,
        "tokens_per_minute": defaults.tokens_per_minute,
        "max_concurrent": defaults.max_concurrent,
    }
    for option in fields[1:]:
        opt, eq, value = option.partition("=")
        if not eq and opt in _SCOPES:
            scope = opt
        elif opt == "scope" and value in _SCOPES:
            scope = value
        elif opt == "name" and value:
            name = value
        elif opt in _LIMIT_OPTIONS and value.isdigit() and int(value) > 0:
            limits[_LIMIT_OPTIONS[opt] or "max_concurrent"] = int(value)
        else:
            raise KeyFileError(
                f"{where}: cannot read {option!r} (expected admin, inference, name=ID, "
                "rpm=N, tpm=N or concurrency=N with N > 0)"
            )
    return ApiKey(fields[0].encode(), name, scope, KeyLimits(**limits))


def configured_keys(server: ServerConfig) -> list[ApiKey]:
    """Every key the server accepts: flags/environment first (admin), then the key file."""
    defaults = KeyLimits(
        server.rate_limit_rpm, server.rate_limit_tpm, server.rate_limit_concurrency
    )
    keys = [
        ApiKey(k.encode(), f"flag{i}", "admin", defaults)
        for i, k in enumerate(server.api_keys, start=1)
    ]
    if server.api_key_file is not None:
        try:
            text = Path(server.api_key_file).expanduser().read_text()
        except OSError as e:
            raise KeyFileError(f"--api-key-file {server.api_key_file!r}: {e.strerror}") from None
        keys += parse_key_file(text, defaults, server.api_key_file)
    names = [k.name for k in keys]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise KeyFileError(f"API key names must be unique; repeated: {clash}")
    return keys


@dataclass(eq=False)
class Refusal(Exception):
    """A request the guard turns away; each protocol renders it in its own error form."""

    status: int  # 401, 403 or 429 (gRPC: UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED)
    message: str
    code: str
    reason: str  # the inferd_requests_rejected_total label
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def error_type(self) -> str:
        return {401: "authentication_error", 403: "permission_error"}.get(
            self.status, "rate_limit_error"
        )


def _unauthorized() -> Refusal:
    return Refusal(
        401,
        "invalid or missing API key (send Authorization: Bearer <key>)",
        "invalid_api_key",
        "unauthorized",
    )


def _forbidden() -> Refusal:
    message = "this API key may not change server state (that needs the admin scope)"
    return Refusal(403, message, "insufficient_scope", "forbidden")


class Admission:
    """One admitted request of one key: `done` hands its slot back and charges its tokens."""

    def __init__(self, key: ApiKey, limiter: KeyLimiter, metrics: ServerMetrics | None) -> None:
        self.key = key
        self._limiter = limiter
        self._metrics = metrics
        self._done = False

    def headers(self) -> list[tuple[str, str]]:
        return rate_limit_headers(self._limiter.state())

    def done(self, tokens: int = 0) -> None:
        if self._done:
            return
        self._done = True
        self._limiter.release(tokens)
        if self._metrics is not None:
            self._metrics.key_done(self.key.name, tokens)


class Guard:
    """The keys and their limiters. Not thread-safe: HTTP and gRPC share one event loop."""

    def __init__(
        self,
        keys: list[ApiKey],
        metrics: ServerMetrics | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.keys = keys
        self._metrics = metrics
        self._limiters = {k.name: KeyLimiter(k.limits, clock) for k in keys}

    @classmethod
    def from_config(cls, server: ServerConfig, metrics: ServerMetrics | None) -> Guard | None:
        keys = configured_keys(server)
        return cls(keys, metrics) if keys else None

    def identify(self, authorization: str | None) -> ApiKey | None:
        """The key a `Bearer <key>` header names, or None. Constant time in which key matched."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key.secret):
                found = key
        return found

    def admit(self, authorization: str | None, *, admin: bool) -> Admission:
        """Authenticates, checks the scope, applies the key's limits; raises Refusal."""
        key = self.identify(authorization)
        if key is None:
            raise _unauthorized()
        if admin and key.scope != "admin":
            raise _forbidden()
        limiter = self._limiters[key.name]
        decision = limiter.acquire()
        if not decision.allowed:
            if self._metrics is not None:
                self._metrics.key_limited(key.name, decision.limit or "requests")
            raise _rate_limited(key, decision, limiter)
        if self._metrics is not None:
            self._metrics.key_admitted(key.name)
        return Admission(key, limiter, self._metrics)


_LIMIT_WORDS: dict[LimitKind, str] = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent requests",
}


def _rate_limited(key: ApiKey, decision: Decision, limiter: KeyLimiter) -> Refusal:
    seconds = max(1, math.ceil(decision.retry_after_s))
    kind = decision.limit or "requests"
    message = (
        f"rate limit reached for API key {key.name!r} on {_LIMIT_WORDS[kind]}; retry in {seconds} s"
    )
    headers = (("retry-after", str(seconds)), *rate_limit_headers(limiter.state()))
    return Refusal(429, message, "rate_limit_exceeded", "rate_limited", headers)
