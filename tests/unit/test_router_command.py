"""The router's command-line side: flags -> RouterConfig, replica argv for data parallel, DNS."""

from __future__ import annotations

import asyncio

import pytest

from inferd.cli import build_parser
from inferd.router.command import router_config
from inferd.router.config import RouterConfig
from inferd.router.health import resolve
from inferd.router.launch import replica_argv, replica_endpoint


def test_router_flags_map_onto_the_config() -> None:
    argv = ["router", "--replica", "http://a:1", "--replica", "http://b:2"]
    argv += ["--policy", "least_load", "--block-size", "32", "--health-interval", "0.5"]
    args = build_parser().parse_args([*argv, "--seed", "3"])
    cfg = router_config(args)
    assert cfg.replicas == ("http://a:1", "http://b:2")
    assert (cfg.policy, cfg.block_size, cfg.health_interval_s, cfg.seed) == (
        "least_load",
        32,
        0.5,
        3,
    )
    # Flags left out keep the dataclass defaults.
    assert cfg.index_capacity_blocks == RouterConfig.index_capacity_blocks
    assert cfg.replica_digest and cfg.replica_api_key is None


def test_the_digest_flags_and_the_replica_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INFERD_ROUTER_REPLICA_API_KEY", "from-env")
    base = ["router", "--replica", "http://a:1"]
    assert router_config(build_parser().parse_args(base)).replica_api_key == "from-env"
    args = build_parser().parse_args([*base, "--replica-api-key", "k", "--no-replica-digest"])
    cfg = router_config(args)
    assert (cfg.replica_api_key, cfg.replica_digest) == ("k", False)


def test_a_router_needs_replicas() -> None:
    with pytest.raises(ValueError, match="--replica"):
        RouterConfig()


def test_serve_accepts_data_parallel_size() -> None:
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2"])
    assert args.data_parallel_size == 2


def test_replicas_get_the_parents_flags_but_their_own_address() -> None:
    argv = ["serve", "--port", "8000", "--data-parallel-size=2", "--seed", "1", "--host=0.0.0.0"]
    assert replica_argv(argv, 9) == [
        "serve",
        "--seed",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
        "--grpc-port",
        "-1",
    ]


def test_each_replica_publishes_kv_events_on_its_own_endpoint() -> None:
    spaced = ["serve", "--kv-events-endpoint", "tcp://*:5557", "--data-parallel-size", "2"]
    assert replica_argv(spaced, 9, index=1)[:3] == ["serve", "--kv-events-endpoint", "tcp://*:5558"]
    joined = ["serve", "--kv-events-endpoint=ipc:///tmp/kv"]
    assert replica_argv(joined, 9, index=2)[1] == "--kv-events-endpoint=ipc:///tmp/kv-2"
    assert replica_endpoint("tcp://127.0.0.1:6000", 0) == "tcp://127.0.0.1:6000"


def test_dns_names_resolve_to_one_replica_per_address() -> None:
    urls = asyncio.run(resolve("localhost:8001"))
    assert "http://127.0.0.1:8001" in urls
    with pytest.raises(ValueError, match="HOST:PORT"):
        asyncio.run(resolve("localhost"))


def test_disable_dashboard_reaches_the_router_config() -> None:
    base = ["router", "--replica", "http://a:1"]
    assert router_config(build_parser().parse_args(base)).dashboard
    assert not router_config(build_parser().parse_args([*base, "--disable-dashboard"])).dashboard


def test_otlp_traces_endpoint_reaches_the_router_config() -> None:
    base = ["router", "--replica", "http://a:1"]
    assert router_config(build_parser().parse_args(base)).otlp_traces_endpoint is None
    flag = ["--otlp-traces-endpoint", "http://collector:4317"]
    cfg = router_config(build_parser().parse_args([*base, *flag]))
    assert cfg.otlp_traces_endpoint == "http://collector:4317"


def test_cold_margin_tokens_reaches_the_router_config() -> None:
    base = ["router", "--replica", "http://a:1"]
    assert router_config(build_parser().parse_args(base)).cold_margin_tokens == 256
    flag = ["--cold-margin-tokens", "0"]
    assert router_config(build_parser().parse_args([*base, *flag])).cold_margin_tokens == 0
