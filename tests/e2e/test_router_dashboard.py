"""`inferd router`'s dashboard over two real `inferd-tiny` replicas: the overview after requests
(both replicas, nothing in flight at rest, routed counts adding up, hit rates in [0, 1]), the page,
its live stream, the page in headless chromium when there is one (INFERD_SCREENSHOTS=1 refreshes
docs/dashboard-router.png), and the stream's end on SIGTERM.

The tests run in file order; the last one stops the router."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from typing import Any

import httpx
import pytest
import test_router
from conftest import ROOT
from test_router import PREFIX, Cluster, completion

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# test_router's module fixture: this module gets two replicas and a router of its own.
c = test_router.c
SENT = 6  # requests the first test sends through the router


def overview(c: Cluster) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(
        f"{c.router.url}/v1/dashboard/overview", params={"window": "300"}, timeout=10
    ).json()
    return doc


def test_overview_shows_each_replica_and_adds_up(c: Cluster) -> None:
    shared = [completion(c, PREFIX + f"Question {i}: what happened?") for i in range(4)]
    other = [completion(c, f"Unrelated topic {i}, about rivers and lakes. " * 3) for i in (1, 2)]
    assert all(r.status_code == 200 for r in shared + other)
    home = shared[0].headers["x-inferd-replica"]
    # The replica-reported rate needs one health round's scrape after the requests.
    deadline = time.monotonic() + 10
    while True:
        doc = overview(c)
        rows = {r["url"]: r for r in doc["replicas"]}
        if rows[home]["replica_hit_rate"]:
            break
        assert time.monotonic() < deadline, f"no replica-reported hit rate: {rows[home]}"
        time.sleep(0.25)
    assert set(rows) == {r.url for r in c.replicas}
    assert all(r["state"] == "healthy" and r["in_flight"] == 0 for r in rows.values())
    assert sum(r["routed"] for r in rows.values()) == SENT == doc["requests"]
    assert sum(doc["outcomes"].values()) == SENT and doc["outcomes"].get("cache_hit", 0) >= 3
    assert doc["rps"] > 0 and doc["replicas_ready"] == 2
    assert 0 < doc["decision"]["p50"] <= doc["decision"]["p99"]
    for rate in (rows[home]["estimated_hit_rate"], rows[home]["replica_hit_rate"]):
        assert 0.0 < rate <= 1.0  # three of the four shared the prefix
    assert rows[home]["dashboard"] == f"{home}/dashboard"


def test_page_and_event_stream(c: Cluster) -> None:
    page = httpx.get(f"{c.router.url}/dashboard", timeout=10)
    assert page.headers["content-type"].startswith("text/html") and "router.js" in page.text
    static = ROOT / "inferd" / "gateway" / "static" / "dashboard"
    for name in ("router.js", "common.js", "style.css"):
        asset = httpx.get(f"{c.router.url}/dashboard/static/{name}", timeout=10)
        assert asset.status_code == 200, name
        assert asset.content == (static / name).read_bytes()  # the packaged file, whole
    url = f"{c.router.url}/v1/dashboard/events"
    with httpx.stream("GET", url, params={"interval": "0.25"}, timeout=10) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        data = next(line for line in events.iter_lines() if line.startswith("data: "))
    # The same snapshot the overview answers with: one row per replica, by its URL.
    event = json.loads(data[len("data: ") :])
    assert {r["url"] for r in event["replicas"]} == {r.url for r in c.replicas}
    assert event.keys() == overview(c).keys()


def test_page_in_a_browser_lists_both_replicas(c: Cluster) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (dev extra)")
    chromium = os.environ.get("INFERD_CHROMIUM", "/usr/bin/chromium")
    if not (os.path.exists(chromium) or shutil.which(chromium)):
        pytest.skip(f"no chromium at {chromium}")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=args)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 640})
            page.goto(f"{c.router.url}/dashboard")
            rows = page.locator("#replicas tbody tr")
            sync_api.expect(rows).to_have_count(2, timeout=15_000)
            links = {rows.nth(i).locator("a").get_attribute("href") for i in range(2)}
            assert links == {f"{r.url}/dashboard" for r in c.replicas}
            sync_api.expect(page.locator("#conn")).to_have_text("live")
            if os.environ.get("INFERD_SCREENSHOTS") == "1":
                page.screenshot(path=str(ROOT / "docs" / "dashboard-router.png"), full_page=True)
        finally:
            browser.close()


def test_event_stream_ends_when_the_router_stops(c: Cluster) -> None:
    url = f"{c.router.url}/v1/dashboard/events"
    with httpx.stream("GET", url, params={"interval": "0.25"}, timeout=10) as events:
        lines = events.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        c.router.proc.send_signal(signal.SIGTERM)
        for _ in lines:  # ends (instead of timing out) once the router stops
            pass
    assert c.router.proc.wait(timeout=15) == 0
