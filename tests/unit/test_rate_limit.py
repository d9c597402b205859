"""Per-key limits (token buckets, concurrency), key files and the guard, on a hand-driven clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.admission.rate_limit import (
    KeyLimiter,
    KeyLimits,
    TokenBucket,
    openai_duration,
    rate_limit_headers,
)
from inferd.config import ServerConfig
from inferd.gateway.auth import Guard, KeyFileError, Refusal, configured_keys, parse_key_file
from inferd.telemetry.metrics import ServerMetrics

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_bursts_to_capacity_then_refills_at_the_steady_rate() -> None:
    b = TokenBucket(120, now=0.0)  # two units a second
    assert all(b.take(1, 0.0) for _ in range(120))
    assert not b.take(1, 0.0)
    assert b.seconds_until(1, 0.0) == pytest.approx(0.5)
    assert not b.take(1, 0.49)
    assert b.take(1, 0.5)
    assert b.remaining(100.0) == 120  # never above capacity
    assert b.reset_s(100.0) == 0.0


def test_requests_per_minute() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimits(requests_per_minute=3), clock)
    for _ in range(3):
        assert lim.acquire().allowed
        lim.release()
    refused = lim.acquire()
    assert (refused.allowed, refused.limit) == (False, "requests")
    assert refused.retry_after_s == pytest.approx(20.0)  # one request per 20 s
    clock.now += 20.0
    assert lim.acquire().allowed


def test_tokens_are_charged_at_the_end_and_debt_blocks_until_repaid() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimits(tokens_per_minute=600), clock)  # 10 tokens a second
    assert lim.acquire().allowed
    lim.release(tokens=700)  # one request may overshoot: its tokens are known only now
    state = lim.state().tokens
    assert state is not None and state.remaining == 0
    refused = lim.acquire()
    assert (refused.allowed, refused.limit) == (False, "tokens")
    assert refused.retry_after_s == pytest.approx(10.1)  # 100 tokens of debt, then 1
    clock.now += 10.1
    assert lim.acquire().allowed


def test_concurrency_slots_come_back_on_release() -> None:
    lim = KeyLimiter(KeyLimits(max_concurrent=2), Clock())
    assert lim.acquire().allowed and lim.acquire().allowed
    refused = lim.acquire()
    assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "concurrency", 1.0)
    lim.release()
    assert lim.acquire().allowed
    assert lim.inflight == 2


def test_a_refusal_takes_nothing() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimits(requests_per_minute=60, max_concurrent=1), clock)
    assert lim.acquire().allowed
    for _ in range(5):
        assert not lim.acquire().allowed  # refused by concurrency: no request unit taken
    lim.release()
    state = lim.state().requests
    assert state is not None and state.remaining == 59


def test_headers_as_openai_sends_them() -> None:
    clock = Clock()
    lim = KeyLimiter(KeyLimits(requests_per_minute=60, tokens_per_minute=6000), clock)
    lim.acquire()
    lim.release(tokens=600)
    assert dict(rate_limit_headers(lim.state())) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert rate_limit_headers(KeyLimiter(KeyLimits(max_concurrent=1), clock).state()) == []
    assert [openai_duration(s) for s in (0.0004, 0.12, 59.2, 360.0, 3723.0)] == [
        "1ms",
        "120ms",
        "1m0s",
        "6m0s",
        "1h2m3s",
    ]


def test_key_file_format() -> None:
    text = """
    # comment line
    sk-a                                  # inference, named by its line
    sk-b   admin  name=ops
    sk-c   scope=inference name=batch rpm=600 tpm=200000 concurrency=8
    """
    a, b, c = parse_key_file(text, KeyLimits(requests_per_minute=5))
    assert (a.secret, a.name, a.scope, a.limits.requests_per_minute) == (
        b"sk-a",
        "key3",
        "inference",
        5,
    )
    assert (b.name, b.scope) == ("ops", "admin")
    assert c.limits == KeyLimits(600, 200000, 8)
    assert "sk-" not in repr(a)  # the secret never shows in logs or reprs
    for bad in ("sk-x rpm=0", "sk-x root", "sk-x name=", "sk-x tpm=many"):
        with pytest.raises(KeyFileError, match=":1: cannot read"):
            parse_key_file(bad, KeyLimits())


def test_configured_keys_merge_flags_and_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-file name=flag1\n")
    server = ServerConfig(api_keys=("sk-flag",), api_key_file=str(path))
    with pytest.raises(KeyFileError, match="unique"):
        configured_keys(server)
    path.write_text("sk-file\n")
    flag, file = configured_keys(server.model_copy(update={"rate_limit_rpm": 9}))
    assert (flag.scope, file.scope, file.limits.requests_per_minute) == ("admin", "inference", 9)
    with pytest.raises(KeyFileError, match="No such file"):
        configured_keys(ServerConfig(api_key_file=str(path) + ".missing"))


def test_guard_scopes_limits_and_metrics() -> None:
    text = "sk-user name=user rpm=2\nsk-root admin name=root\n"
    metrics = ServerMetrics()
    guard = Guard(parse_key_file(text, KeyLimits()), metrics, Clock())
    for auth in (None, "sk-user", "Basic sk-user", "Bearer sk-use", "Bearer sk-userr"):
        with pytest.raises(Refusal) as info:
            guard.admit(auth, admin=False)
        assert info.value.status == 401
    with pytest.raises(Refusal) as info:
        guard.admit("Bearer sk-user", admin=True)
    assert (info.value.status, info.value.reason) == (403, "forbidden")
    guard.admit("Bearer sk-root", admin=True).done()
    first = guard.admit("bearer  sk-user ", admin=False)
    first.done(tokens=11)
    first.done(tokens=11)  # idempotent
    guard.admit("Bearer sk-user", admin=False).done()
    with pytest.raises(Refusal) as info:
        guard.admit("Bearer sk-user", admin=False)
    headers = dict(info.value.headers)
    assert info.value.status == 429 and headers["retry-after"] == "30"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    text_out = metrics.render().decode()
    assert 'inferd_api_key_requests_total{key="user"} 2.0' in text_out
    assert 'inferd_api_key_tokens_total{key="user"} 11.0' in text_out
    assert 'inferd_api_key_rate_limited_total{key="user",limit="requests"} 1.0' in text_out
    assert 'inferd_api_key_requests_running{key="user"} 0.0' in text_out
    assert "sk-user" not in text_out
