"""deploy/kubernetes/ names only what inferd really has: every manifest parses, the container args
parse with inferd's own CLI parser, probe and scrape paths are routes of the real apps, ports
line up (container port = --port, Service targetPort = a named container port), and the
autoscaler's queries use metric names the replica's registry exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from inferd.cli import build_parser
from inferd.config import ServerConfig
from inferd.gateway import create_app
from inferd.preprocess.tokenizer import Tokenizer
from inferd.router.app import create_router_app
from inferd.router.command import router_config
from inferd.telemetry.metrics import EngineGauges, ServerMetrics

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
Manifest = dict[str, Any]


def _manifests() -> list[Manifest]:
    docs: list[Manifest] = []
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


def _kind(kind: str) -> list[Manifest]:
    return [m for m in _manifests() if m["kind"] == kind]


def _by_name(kind: str, name: str) -> Manifest:
    (found,) = [m for m in _kind(kind) if m["metadata"]["name"] == name]
    return found


def _container(deployment: Manifest) -> Manifest:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return cast(Manifest, container)


def _served(app: FastAPI, paths: list[str]) -> dict[str, int]:
    """Each path's status from a GET on `app` (lifespan not run: no engine, no replica). Any
    answer but 404/405 means the route exists (readiness is 503 here, which is fine)."""
    client = TestClient(app)
    return {path: client.get(path).status_code for path in paths}


def _assert_routes(app: FastAPI, paths: list[str]) -> None:
    missing = {p: s for p, s in _served(app, paths).items() if s in (404, 405)}
    assert not missing, f"not routes of the app: {missing}"


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _probe_paths(container: Manifest) -> list[str]:
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    return [container[p]["httpGet"]["path"] for p in probes if p in container]


def _scrape_annotations(deployment: Manifest) -> dict[str, str]:
    return cast(dict[str, str], deployment["spec"]["template"]["metadata"]["annotations"])


def _replica_app() -> FastAPI:
    return create_app(None, ServerConfig(access_log=False))


def _router_app() -> FastAPI:
    router = _by_name("Deployment", "inferd-router")
    args = build_parser().parse_args(_container(router)["args"])
    # The tokenizer is only used per request; building the app must not download one.
    return create_router_app(router_config(args), cast(Tokenizer, object()))


def test_every_manifest_parses_and_the_kustomization_lists_them_all() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    for m in _manifests():
        assert {"apiVersion", "kind", "metadata"} <= m.keys(), m


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_whole_set() -> None:
    kubectl = shutil.which("kubectl") or "kubectl"
    built = subprocess.run(
        [kubectl, "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(built) if d is not None)
    assert kinds == sorted(m["kind"] for m in _manifests())


def test_replica_args_parse_with_the_serve_parser() -> None:
    container = _container(_by_name("Deployment", "inferd-replica"))
    assert container["command"] == ["inferd"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    assert args.host == "0.0.0.0"  # reachable from the router's pod
    # The probes' named port is the one the server listens on.
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    assert args.port == http["containerPort"]
    # The drain time is the manifest's own (its shutdown timeline counts on 30 s), not a default.
    assert "--shutdown-timeout" in container["args"] and args.shutdown_timeout == 30.0


def test_router_args_parse_and_discover_replicas_through_the_headless_service() -> None:
    container = _container(_by_name("Deployment", "inferd-router"))
    args = build_parser().parse_args(container["args"])
    cfg = router_config(args)
    service = _by_name("Service", "inferd-replicas")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS gives every pod's address
    host, _, port = (cfg.dns_name or "").rpartition(":")
    assert host == service["metadata"]["name"]
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert cfg.host == "0.0.0.0"


def test_router_and_replicas_agree_on_model_and_block_size() -> None:
    parser = build_parser()
    replica = parser.parse_args(_container(_by_name("Deployment", "inferd-replica"))["args"])
    router = parser.parse_args(_container(_by_name("Deployment", "inferd-router"))["args"])
    assert (router.model, router.block_size) == (replica.model, replica.block_size)


@pytest.mark.parametrize("name", ["inferd-replica", "inferd-router"])
def test_ports_line_up(name: str) -> None:
    deployment = _by_name("Deployment", name)
    container = _container(deployment)
    args = build_parser().parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    assert int(_scrape_annotations(deployment)["prometheus.io/port"]) == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["port"] in ports
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [s for s in _kind("Service") if s["spec"]["selector"].items() <= labels.items()]
    assert services, f"no Service selects {name}"
    for service in services:
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports


def test_replica_probes_and_scrape_path_are_server_routes() -> None:
    deployment = _by_name("Deployment", "inferd-replica")
    scrape = _scrape_annotations(deployment)["prometheus.io/path"]
    _assert_routes(_replica_app(), [*_probe_paths(_container(deployment)), scrape])
    # Liveness must not follow readiness: readiness is red while draining.
    assert _container(deployment)["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_router_probes_and_scrape_path_are_router_routes() -> None:
    deployment = _by_name("Deployment", "inferd-router")
    scrape = _scrape_annotations(deployment)["prometheus.io/path"]
    _assert_routes(_router_app(), [*_probe_paths(_container(deployment)), scrape])


def test_replica_rollout_and_shutdown_fit_the_drain() -> None:
    deployment = _by_name("Deployment", "inferd-replica")
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    sleep_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain_s = float(_flag(container["args"], "--shutdown-timeout"))
    # preStop sleep, then SIGTERM: drain, then ~2 s for the last requests and closing.
    assert sleep_s + drain_s + 2 < pod["terminationGracePeriodSeconds"]


def _exported_metric_names() -> set[str]:
    metrics = ServerMetrics()
    metrics.watch_engine(lambda: EngineGauges())
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_autoscaler_queries_name_exported_metrics() -> None:
    exported = _exported_metric_names()
    (scaled,) = _kind("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "inferd-replica"
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    named = {n for q in queries for n in re.findall(r"\binferd_[a-z_]+\b", q)}
    assert named, "the autoscaler reads no inferd metric"
    assert named <= exported, named - exported
