"""The dashboard in a real headless browser (Debian's chromium driven by Playwright, no browser
download): what a person sees after real LLM and classic requests and one failure.

Skips with its reason when playwright or /usr/bin/chromium is missing. With
INFERD_SCREENSHOTS=1 it also refreshes docs/dashboard-overview.png and
docs/dashboard-waterfall.png (the README shows them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from browser import chromium_page, skip_without_chromium
from conftest import ROOT, Server, start_server, stop_server

from inferd.examples import ensure_example_repository

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev extra)")

KEY = "sk-browser-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    skip_without_chromium()
    repo = str(ensure_example_repository())
    extra = ("inferd-tiny", "--model-repository", repo, "--load-model", "fraud")
    s = start_server(
        tmp_path_factory.mktemp("browser"), *extra, "--grpc-port", "-1", "--api-key", KEY
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def page(server: Server) -> Iterator[Page]:
    with chromium_page() as p:
        yield p


def _send_traffic(server: Server) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        for i, tokens in enumerate((4, 8, 32)):
            body = {"prompt": f"Hello {i}", "max_tokens": tokens, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        for rows in (1, 4):
            data = [0.5] * (rows * 8)
            doc = {
                "inputs": [
                    {"name": "features", "shape": [rows, 8], "datatype": "FP32", "data": data}
                ]
            }
            assert c.post("/v2/models/fraud/infer", json=doc).status_code == 200
        bad = {
            "inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]
        }
        assert c.post("/v2/models/fraud/infer", json=bad).status_code == 400


def _screenshot(page: Page, tmp: Path, name: str, element: str | None = None) -> None:
    target = ROOT / "docs" if os.environ.get("INFERD_SCREENSHOTS") == "1" else tmp
    path = target / name
    if element is None:
        page.screenshot(path=str(path), full_page=True)
    else:
        page.locator(element).screenshot(path=str(path))
    assert path.stat().st_size > 1000


def test_a_person_sees_the_overview_stages_waterfall_and_failure(
    server: Server, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#keyform:not([hidden])", timeout=WAIT_MS)  # data is behind the key
    page.fill("#key", KEY)
    page.click("#keyform button")
    page.wait_for_selector("#conn[data-state=live]", timeout=WAIT_MS)

    _send_traffic(server)
    # The overview moves by itself (SSE): requests are counted and rates are no longer zero.
    page.wait_for_function(
        "parseInt(document.querySelector('#window').textContent.split('·')[1]) >= 7",
        timeout=WAIT_MS,
    )
    page.wait_for_function(
        "parseFloat((document.querySelector('[data-testid=llm-rps]') || {}).textContent) > 0",
        timeout=WAIT_MS,
    )
    assert page.locator("[data-testid=llm-tps]").inner_text() not in ("", "0.0", "n/a")
    # Throughput and latency cards plot the server's window: lines for rate, p99 and p50.
    for card in ("#llm-tps", "#llm-ttft", "#classic-rps", "#classic-e2e"):
        page.wait_for_selector(
            f"{card} .spark[data-series=window] polyline", state="attached", timeout=WAIT_MS
        )
    assert page.locator("#classic-models tr[data-model=fraud]").count() == 1

    # Where the time goes: both lanes list their stages.
    llm_stages = page.locator("#stages-llm .item").evaluate_all("e => e.map(x => x.dataset.stage)")
    assert {"queue", "prefill", "decode"} <= set(llm_stages)
    classic = page.locator("#stages-classic .item").evaluate_all("e => e.map(x => x.dataset.stage)")
    assert {"validate", "infer"} <= set(classic)
    _screenshot(page, tmp_path, "dashboard-overview.png")

    # The slowest request's waterfall: its path bars sum to its e2e.
    page.select_option("#f-order", "1")
    page.wait_for_function(
        "(() => { const r = [...document.querySelectorAll('#req-table tr.req')].map("
        "t => +t.dataset.e2e); return r.length >= 7 && r.every((v, i) => !i || v <= r[i-1]); })()",
        timeout=WAIT_MS,
    )
    page.locator("#req-table tr.req").first.click()
    page.wait_for_selector("#waterfall:not([hidden]) .path-seg", timeout=WAIT_MS)
    e2e = float(page.locator("#waterfall").get_attribute("data-e2e") or "nan")
    bars = page.locator("#wf-svg .path-seg").evaluate_all("e => e.map(x => +x.dataset.seconds)")
    assert sum(bars) == pytest.approx(e2e, abs=len(bars) * 2e-6)
    # The slowest is an LLM request (tens of ms beside the fraud model's few): a tick per token.
    assert page.locator("#waterfall").get_attribute("data-lane") == "llm"
    assert page.locator("#wf-svg .stage-bar[data-stage=decode]").count() == 1
    tokens = int(page.locator("#waterfall").get_attribute("data-tokens") or "0")
    assert tokens >= 4 and page.locator("#wf-svg .token-tick").count() == tokens
    _screenshot(page, tmp_path, "dashboard-waterfall.png", "#waterfall")

    # The failed request is listed with its error, and its waterfall says it.
    page.select_option("#f-status", "failed")
    row = page.locator("#req-table tr.req.failed").first
    row.wait_for(timeout=WAIT_MS)
    assert "features" in row.inner_text()
    row.click()
    page.wait_for_selector("#wf-error:not([hidden])", timeout=WAIT_MS)
    assert "features" in page.locator("#wf-error").inner_text()
