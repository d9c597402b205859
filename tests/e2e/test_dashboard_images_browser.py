"""The dashboard's image lane in a real headless browser (Debian's chromium driven by Playwright):
what a person sees after image requests to a real `inferd serve` with `inferd-tiny-sd`. With
INFERD_SCREENSHOTS=1 it also writes docs/dashboard-images.png.

Skips with its reason when playwright, /usr/bin/chromium or the image engine is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from browser import chromium_page, skip_without_chromium
from conftest import ROOT, Server, start_server, stop_server
from test_dashboard_browser import WAIT_MS

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev extra)")
pytest.importorskip("inferd.diffusion.tiny", reason="needs the image engine (inferd.diffusion)")

MODEL = "inferd-tiny-sd"
STEPS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    skip_without_chromium()
    extra = ("inferd-tiny", "--image-model", MODEL, "--image-threads", "1", "--grpc-port", "-1")
    s = start_server(tmp_path_factory.mktemp("image-browser"), *extra, timeout_s=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def page(server: Server) -> Iterator[Page]:
    with chromium_page() as p:
        yield p


def _generate(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for n in (1, 2, 1):
            body = {"prompt": "a fox", "n": n, "size": "64x64", "num_inference_steps": STEPS}
            assert c.post("/v1/images/generations", json=body).status_code == 200
        bad = {"prompt": "a fox", "size": "60x60"}
        assert c.post("/v1/images/generations", json=bad).status_code == 400


def test_a_person_sees_the_image_lane_and_a_waterfall_with_steps(
    server: Server, page: Page
) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#conn[data-state=live]", timeout=WAIT_MS)
    _generate(server)
    # The lane's cards move by themselves (SSE): images were made, each UNet forward ran rows.
    page.wait_for_function(
        "parseFloat((document.querySelector('[data-testid=image-ips]') || {}).textContent) > 0",
        timeout=WAIT_MS,
    )
    page.wait_for_function(
        "parseFloat((document.querySelector('[data-testid=image-rows]') || {}).textContent) >= 1",
        timeout=WAIT_MS,
    )
    assert MODEL in page.locator("#image-models").inner_text()
    for card in ("#image-ips", "#image-e2e"):
        page.wait_for_selector(
            f"{card} .spark[data-series=window] polyline", state="attached", timeout=WAIT_MS
        )
    assert page.locator("[data-testid=image-e2e]").inner_text() != "–"
    stages = page.locator("#stages-image .item").evaluate_all("e => e.map(x => x.dataset.stage)")
    assert {"text_encode", "denoise", "vae_decode", "image_encode"} <= set(stages)

    # An image request's waterfall: its path sums to e2e and denoise has a tick per step.
    page.select_option("#f-status", "ok")
    row = page.locator("#req-table tr.req", has_text="image").first
    row.wait_for(timeout=WAIT_MS)
    row.click()
    page.wait_for_selector("#waterfall[data-lane=image] .path-seg", timeout=WAIT_MS)
    e2e = float(page.locator("#waterfall").get_attribute("data-e2e") or "nan")
    bars = page.locator("#wf-svg .path-seg").evaluate_all("e => e.map(x => +x.dataset.seconds)")
    assert sum(bars) == pytest.approx(e2e, abs=len(bars) * 2e-6)
    assert page.locator("#wf-svg .stage-bar[data-stage=denoise]").count() == 1
    assert page.locator("#wf-svg .token-tick").count() == STEPS
    assert f"{STEPS} steps" in page.locator("#wf-meta").inner_text()
    # And the request's first image, small.
    page.wait_for_function(
        "document.querySelector('#wf-preview').naturalWidth > 0", timeout=WAIT_MS
    )
    assert page.locator("#wf-preview").is_visible()
    if os.environ.get("INFERD_SCREENSHOTS") == "1":
        page.screenshot(path=str(ROOT / "docs" / "dashboard-images.png"), full_page=True)
