"""The Ray Serve path's route notes (router -> ingress) and the body rewrite that adds
`timings.route` to a replica's answer: plain JSON whole, event streams event by event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson

from inferd.router.route_notes import RouteNote, RouteNotes, rewrites, with_route_timing


async def _parts(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _run(parts: AsyncIterator[bytes], content_type: str, route_s: float) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [c async for c in with_route_timing(parts, content_type, route_s)]

    return asyncio.run(collect())


def test_a_note_is_taken_once_and_the_oldest_go_beyond_the_limit() -> None:
    notes = RouteNotes(limit=2)
    for i in range(3):
        notes.put(f"r{i}", RouteNote(0.001 * i, f"replica{i}", 16 * i))
    assert notes.take("r0") is None  # dropped: its request never took it
    assert notes.take("r2") == RouteNote(0.002, "replica2", 32)
    assert notes.take("r2") is None


def test_a_json_answer_gets_the_route_stage_first() -> None:
    body = orjson.dumps({"choices": [], "timings": {"receive": 0.1}})
    out = _run(_parts(body[:10], body[10:]), "application/json", 0.25)
    assert len(out) == 1
    assert list(orjson.loads(out[0])["timings"].items()) == [("route", 0.25), ("receive", 0.1)]


def test_an_event_stream_passes_event_by_event_and_its_last_event_gets_the_route() -> None:
    first = b'data: {"choices": [{"text": "a"}]}\n\n'
    last = b'data: {"choices": [], "timings": {"e2e": 1}}\n\ndata: [DONE]\n\n'
    out = _run(_parts(first, last), "text/event-stream", 0.5)
    assert out[0] == first  # untouched, and before the rest arrived
    assert b'"timings":{"route":0.5,"e2e":1}' in out[1] and out[1].endswith(b"[DONE]\n\n")


def test_other_bodies_pass_untouched() -> None:
    assert _run(_parts(b"a", b"b"), "text/plain", 0.5) == [b"a", b"b"]
    assert not rewrites("text/plain") and rewrites("application/json; charset=utf-8")
