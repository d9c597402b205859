"""`inferd router` and `inferd serve --data-parallel-size N`: their flags and what they run.

Kept out of inferd/cli.py, which only registers them: the router's flags map onto RouterConfig's
fields one to one (defaults come from the dataclass, so the two cannot drift).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, get_args

from inferd.config import read_environment
from inferd.router.config import RouterConfig
from inferd.router.image_cost import parse_size
from inferd.router.policy import PolicyName

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RouterConfig)}


def add_router_parser(sub: Any) -> None:
    """Registers `inferd router` on the CLI's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "router", help="route OpenAI / KServe v2 requests over inferd replicas (cache-aware)"
    )
    d = _DEFAULTS
    p.add_argument(
        "--replica", action="append", default=[], metavar="URL", help="replica base URL (repeat)"
    )
    p.add_argument(
        "--replica-dns",
        default=None,
        metavar="HOST:PORT",
        help="every address HOST resolves to is a replica (re-resolved each health interval)",
    )
    p.add_argument(
        "--replica-kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="follow the KV events replica URL publishes on ENDPOINT (its --kv-events-endpoint, "
        "e.g. tcp://host:5557): its prefix index is exact (repeat per replica)",
    )
    p.add_argument(
        "--no-replica-digest",
        action="store_true",
        help="do not read the replicas' block digests (GET /v1/kv_cache/blocks) with each health "
        "check: the prefix index of a replica without KV events then comes from this router's "
        "own routing only",
    )
    p.add_argument(
        "--replica-api-key",
        default=None,
        metavar="KEY",
        help="the API key for the replicas' block digests, when the replicas have keys "
        "(default: $INFERD_ROUTER_REPLICA_API_KEY)",
    )
    p.add_argument("--policy", default=d["policy"], choices=get_args(PolicyName))
    p.add_argument("--host", default=d["host"])
    p.add_argument("--port", type=int, default=d["port"])
    p.add_argument("--model", default=d["model"], help="the replicas' model: its tokenizer")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--block-size", type=int, default=d["block_size"], help="the replicas' own")
    p.add_argument(
        "--index-capacity-blocks",
        type=int,
        default=d["index_capacity_blocks"],
        help="prefix index blocks per replica (about its KV cache size in blocks)",
    )
    p.add_argument(
        "--decode-weight",
        type=int,
        default=d["decode_weight"],
        help="tokens of load each request in flight counts",
    )
    p.add_argument("--balance-abs-threshold", type=int, default=d["balance_abs_threshold"])
    p.add_argument("--balance-rel-threshold", type=float, default=d["balance_rel_threshold"])
    p.add_argument(
        "--cold-margin-tokens",
        type=int,
        default=d["cold_margin_tokens"],
        help="a prompt no replica holds goes among the replicas within this many tokens of load "
        "of the least loaded, by a rendezvous hash of its first block",
    )
    p.add_argument(
        "--image-default-steps",
        type=int,
        default=d["image_default_steps"],
        help="an image request without num_inference_steps counts this many (the model's default)",
    )
    p.add_argument(
        "--image-default-size",
        type=parse_size,
        default=d["image_default_size"],
        metavar="WxH",
        help="an image request without size counts this size (the model's default)",
    )
    p.add_argument("--health-interval", type=float, default=d["health_interval_s"])
    p.add_argument("--max-retries", type=int, default=d["max_retries"])
    p.add_argument("--seed", type=int, default=None, help="power_of_two's RNG seed")
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="OTLP/gRPC collector (e.g. http://localhost:4317) for a span per routed request, "
        "the parent of the replica's own trace",
    )
    p.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="no /dashboard page or /v1/dashboard overview of the replicas",
    )
    p.set_defaults(func=run_router_command)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        replicas=tuple(args.replica),
        dns_name=args.replica_dns,
        kv_events=tuple(kv_events_pair(text) for text in args.replica_kv_events),
        replica_digest=not args.no_replica_digest,
        replica_api_key=args.replica_api_key or read_environment().router_replica_api_key,
        model=args.model,
        tokenizer=args.tokenizer,
        revision=args.revision,
        host=args.host,
        port=args.port,
        policy=args.policy,
        block_size=args.block_size,
        index_capacity_blocks=args.index_capacity_blocks,
        decode_weight=args.decode_weight,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        cold_margin_tokens=args.cold_margin_tokens,
        image_default_steps=args.image_default_steps,
        image_default_size=args.image_default_size,
        health_interval_s=args.health_interval,
        max_retries=args.max_retries,
        seed=args.seed,
        dashboard=not args.disable_dashboard,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def kv_events_pair(text: str) -> tuple[str, str]:
    """`--replica-kv-events URL=ENDPOINT` as a pair.

    >>> kv_events_pair("http://10.0.0.5:8000=tcp://10.0.0.5:5557")
    ('http://10.0.0.5:8000', 'tcp://10.0.0.5:5557')
    """
    url, eq, endpoint = text.rpartition("=")
    if not eq or not url or not endpoint:
        raise ValueError(f"--replica-kv-events wants URL=ENDPOINT, got {text!r}")
    return url, endpoint


def run_router_command(args: argparse.Namespace) -> int:
    from inferd.errors import InferdError
    from inferd.router.app import run_router

    try:
        config = router_config(args)
    except ValueError as e:
        raise InferdError(str(e)) from e
    return run_router(config)


def add_data_parallel_args(serve_parser: argparse.ArgumentParser) -> None:
    serve_parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="N > 1: N engine replicas on this machine behind the cache-aware router",
    )


def serve_data_parallel(args: argparse.Namespace) -> int:
    """`inferd serve --data-parallel-size N ...`: the replicas get the same flags."""
    from inferd.router.launch import run_data_parallel

    model = args.model_pos if args.model_pos is not None else args.model
    config = RouterConfig(
        replicas=("http://unused",),  # replaced by the launched replicas' URLs
        model=model or _DEFAULTS["model"],
        tokenizer=args.tokenizer,
        revision=args.revision,
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        dashboard=not args.disable_dashboard,
        # The replicas inherit INFERD_API_KEY (an admin key there): their block digests need it.
        replica_api_key=read_environment().api_key,
        # The replicas get the flag too (their argv): one trace spans router and replica.
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    grace = args.shutdown_timeout if args.shutdown_timeout is not None else 30.0
    return run_data_parallel(
        args.argv, args.data_parallel_size, config, grace, args.kv_events_endpoint
    )
