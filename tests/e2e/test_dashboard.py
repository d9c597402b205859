"""The dashboard's endpoints on a real `inferd serve` (an LLM and the fraud model, one API key):
the page and its assets open, data behind the key, one request's timeline found by its
X-Request-Id for both lanes and for a failure, list filters, the overview and its SSE stream;
the Grafana board's metrics exist in /metrics; `--disable-dashboard` leaves the routes out."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from conftest import ROOT, Server, start_server, stop_server
from starlette.testclient import TestClient

from inferd.config import ServerConfig
from inferd.examples import ensure_example_repository
from inferd.gateway.app import create_app
from inferd.telemetry.stages import CLASSIC_STAGES, LLM_STAGES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
KEY = "sk-dashboard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRAFANA = ROOT / "deploy" / "grafana" / "inferd.json"
STATIC = ROOT / "inferd" / "gateway" / "static" / "dashboard"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = str(ensure_example_repository())
    extra = ("inferd-tiny", "--model-repository", repo, "--load-model", "fraud")
    s = start_server(tmp_path_factory.mktemp("dash"), *extra, "--grpc-port", "-1", "--api-key", KEY)
    yield s
    stop_server(s)


def _get(server: Server, path: str, **params: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", params=params, headers=AUTH, timeout=10)


def _features(rows: int, width: int = 8) -> dict[str, object]:
    data = [float(i % 7) for i in range(rows * width)]
    return {
        "inputs": [{"name": "features", "shape": [rows, width], "datatype": "FP32", "data": data}]
    }


def _assert_path_sums_to_e2e(doc: dict[str, object]) -> None:
    path = doc["path"]
    assert isinstance(path, list) and path
    assert sum(p["seconds"] for p in path) == pytest.approx(doc["e2e"], abs=len(path) * 2e-6)


def test_page_and_assets_are_open_data_is_behind_the_key(server: Server) -> None:
    page = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert page.status_code == 200 and "/dashboard/static/app.js" in page.text
    assert page.headers["content-type"].startswith("text/html")
    types = {"app.js": "javascript", "common.js": "javascript", "style.css": "text/css"}
    for name, kind in types.items():
        asset = httpx.get(f"{server.url}/dashboard/static/{name}", timeout=10)
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
        assert asset.content == (STATIC / name).read_bytes()  # the packaged file, whole
    assert httpx.get(f"{server.url}/dashboard/static/nope.js", timeout=10).status_code == 404
    for path in ("/v1/requests", "/v1/requests/x", "/v1/dashboard/overview"):
        r = httpx.get(f"{server.url}{path}", timeout=10)
        assert r.status_code == 401, path
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and "API key" in error["message"], error


def test_llm_request_timeline_by_its_request_id(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        headers={**AUTH, "X-Request-Id": "dash-llm-1"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    doc = _get(server, "/v1/requests/dash-llm-1").json()
    assert doc["lane"] == "llm" and doc["status"] == "ok" and doc["error"] is None
    assert doc["model"] == "inferd-tiny"
    names = [s["stage"] for s in doc["stages"]]
    assert set(names) <= {str(s) for s in LLM_STAGES}
    assert {"receive", "queue", "prefill", "decode"} <= set(names)
    assert doc["stage_order"] == [str(s) for s in LLM_STAGES]
    assert len(doc["token_ticks"]) == doc["output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert 0 < doc["ttft"] <= doc["e2e"]
    assert doc["e2e"] == pytest.approx(r.json()["timings"]["e2e"], abs=0.05)
    _assert_path_sums_to_e2e(doc)


def test_classic_requests_and_a_failure_with_its_error(server: Server) -> None:
    ok = httpx.post(
        f"{server.url}/v2/models/fraud/infer",
        json=_features(3),
        headers={**AUTH, "X-Request-Id": "dash-cls-1"},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text
    bad = httpx.post(
        f"{server.url}/v2/models/fraud/infer",
        json=_features(1, width=3),
        headers={**AUTH, "X-Request-Id": "dash-cls-bad"},
        timeout=30,
    )
    assert bad.status_code == 400, bad.text
    doc = _get(server, "/v1/requests/dash-cls-1").json()
    assert doc["lane"] == "classic" and doc["model"] == "fraud" and doc["status"] == "ok"
    names = [s["stage"] for s in doc["stages"]]
    assert set(names) <= {str(s) for s in CLASSIC_STAGES}
    assert {"receive", "validate", "infer", "stream"} <= set(names)
    _assert_path_sums_to_e2e(doc)
    failed = _get(server, "/v1/requests/dash-cls-bad").json()
    assert failed["status"] == "invalid" and failed["failed"] is True
    assert failed["error"] and "features" in failed["error"]


def test_list_filters(server: Server) -> None:
    rows = _get(server, "/v1/requests").json()["data"]
    ids = [r["request_id"] for r in rows]
    assert {"dash-llm-1", "dash-cls-1", "dash-cls-bad"} <= set(ids)
    failed = _get(server, "/v1/requests", status="failed").json()["data"]
    assert [r["request_id"] for r in failed] == ["dash-cls-bad"]
    fraud = _get(server, "/v1/requests", model="fraud").json()["data"]
    assert fraud and all(r["model"] == "fraud" for r in fraud)
    slowest = [r["e2e"] for r in _get(server, "/v1/requests", slowest="1").json()["data"]]
    assert slowest == sorted(slowest, reverse=True)
    missing = _get(server, "/v1/requests/no-such-id")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert "'no-such-id'" in missing.json()["error"]["message"]


def test_overview_and_its_event_stream(server: Server) -> None:
    o = _get(server, "/v1/dashboard/overview", window="300").json()
    assert o["lanes"] == {"llm": True, "classic": True, "image": False}
    llm, classic = o["llm"], o["classic"]
    assert llm["requests"] >= 1 and llm["rps"] > 0 and llm["output_tps"] > 0
    assert llm["ttft"]["p50"] > 0 and llm["engine"]["kv_cache_usage"] >= 0
    assert 0.0 <= llm["engine"]["prefix_cache_hit_rate"] <= 1.0  # prompts were looked up
    assert set(llm["stage_seconds"]) <= set(llm["stage_order"])
    assert classic["models"]["fraud"]["batch_rows"] >= 1
    assert classic["failed"] >= 1
    with httpx.stream(
        "GET",
        f"{server.url}/v1/dashboard/events",
        params={"interval": "0.25"},
        headers=AUTH,
        timeout=10,
    ) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        data = next(line for line in events.iter_lines() if line.startswith("data: "))
    assert json.loads(data[len("data: ") :])["requests_total"] >= 3


def test_every_grafana_query_names_a_served_metric(server: Server) -> None:
    board = json.loads(GRAFANA.read_text())
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    queried = set(grafana_metrics(board))
    assert queried, "the board queries no inferd metric"
    assert queried - exposed_names(text) == set()


def exposed_names(text: str) -> set[str]:
    """Every series name /metrics can show: its samples, and from each `# TYPE` line the names
    of a family that has no sample yet (a labelled histogram before its first observation)."""
    names = {re.sub(r"\{.*", "", line.rpartition(" ")[0]) for line in text.splitlines()}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter":
            names.add(name if name.endswith("_total") else f"{name}_total")
    return names


def grafana_metrics(board: dict[str, object]) -> Iterator[str]:
    """Every `inferd_*` name in every panel target's expression (rows' nested panels too)."""
    panels = list(board.get("panels", []))  # type: ignore[call-overload]
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield from re.findall(r"\binferd_[a-z0-9_]+", target.get("expr", ""))


def test_disable_dashboard_leaves_the_routes_out() -> None:
    app = create_app(None, ServerConfig(dashboard=False))
    with TestClient(app) as client:
        for path in ("/dashboard", "/v1/requests", "/v1/requests/x", "/v1/dashboard/events"):
            assert client.get(path).status_code == 404, path
    assert not hasattr(app.state, "request_log")


def test_event_stream_ends_when_the_server_drains() -> None:
    app = create_app(None, ServerConfig())
    app.state.gateway.draining = True
    with TestClient(app) as client:
        r = client.get("/v1/dashboard/events")
    assert r.status_code == 200 and r.text == "retry: 2000\n\n"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/dashboard/overview?window=nan",
        "/v1/requests?limit=abc",
        "/v1/dashboard/events?interval=NaN",
    ],
)
def test_a_query_parameter_that_is_not_a_number_is_a_400(server: Server, path: str) -> None:
    r = httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    name = path.partition("?")[2].partition("=")[0]
    assert error["param"] == name and error["message"] == f"'{name}' must be a number"
