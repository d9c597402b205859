"""Routing benchmark: shared-prefix workloads through `inferd router` over inferd-tiny replicas,
every routing setup on the same workload in one run (issue 9's benchmark; not a timed test).

    .venv/bin/python bench/router.py --quick
    .venv/bin/python bench/router.py --replicas 4 --num-requests 200
    .venv/bin/python bench/router.py --scenario kill --workloads uniform
    .venv/bin/python bench/router.py --scenario two-routers

Scenarios:
    policies     every --policies entry behind one router (the default)
    two-routers  cache_aware behind one router, behind two routers that share no state (the
                 client splits its arrivals between them) with indexes from their own routing
                 only ("x2 own", --no-replica-digest), from that and the replicas' block
                 digests read with each health check ("x2", the default), and from the
                 replicas' KV events ("x2 +kv", exact)
    kill         one --policies entry (default cache_aware) on the first workload; replica N
                 is SIGKILLed `--kill-after` seconds in; failures split into not-yet-streaming
                 and already-streaming, and the hit rate per `--window` seconds

Workloads are bench/router_workloads.py's (uniform, zipf, multiturn, nosharing). The replicas'
KV pools are shrunk (`--kv-cache-memory`) so the K prefixes need `--prefix-cache-ratio` x one
replica's cache (default: 2.5x, capped at 75 % of the cluster's: 1.5x for 2 replicas); the
sizing is printed and kept in the JSON.

Load: Poisson arrivals at `--load-factor` (0.7) x round-robin's saturation, measured per workload
first (closed loop, `--calibration-concurrency` requests per replica outstanding);
`--request-rate R` skips the calibration and uses R for every cell.

Per cell: fresh router process(es) (empty indexes); the same replicas, with the cell's own first
token put in front of every prompt, so earlier cells' blocks never match (the block hash is
chained) and only sit in the replicas' caches as evictable blocks. Hit rate comes from the
replicas' `inferd_prefix_cache_{queries,hits}_tokens_total` (deltas over the cell), against the
ideal H* (an infinite cache over the same prompts at block granularity; for grouped workloads
close to 1 - (K*P + R*S) / (R*(P+S))). Per-replica prefill work is the prompt tokens each replica
computed (queries - hits). Latencies are bench/serve.py's (TTFT, TPOT, goodput under
`--goodput` SLOs). The JSON goes to bench/results/ with a plot beside it (bench/router_plot.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, command_line, machine_info, write_result
from router_cluster import Replica, launched_replicas, replica_num_blocks
from router_plot import write_plot
from router_scenarios import Kill, Setup, calibrate, run_cell
from router_workloads import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    SALTS,
    WORKLOADS,
    Shape,
    Sizing,
    TextCodec,
    cell_prompts,
    closed_form_hit_rate,
    ideal_hit_rate,
    prompts_for,
    size_pools,
    text_inflation,
)

POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")
SCENARIOS = ("policies", "two-routers", "kill")
# Each router's approximate index from its own routing only (before the replicas' digests).
NO_DIGEST = "--no-replica-digest"


def setups_for(args: argparse.Namespace) -> list[Setup]:
    if args.scenario == "two-routers":
        return [
            Setup("cache_aware", "cache_aware"),
            Setup("cache_aware x2 own", "cache_aware", routers=2, flags=(NO_DIGEST,)),
            Setup("cache_aware x2", "cache_aware", routers=2),
            Setup("cache_aware x2 +kv", "cache_aware", routers=2, exact=True),
        ]
    if args.scenario == "kill":
        return [Setup(f"{args.policies[0]} kill", args.policies[0])]
    peers = [Setup(name, name, command=cmd) for name, cmd in args.peer_router]
    return [Setup(p, p) for p in args.policies] + peers


def run_workload(
    args: argparse.Namespace,
    replicas: list[Replica],
    workload: str,
    salts: Iterator[int],
    codec: TextCodec | None,
) -> dict[str, Any]:
    """Calibration (unless a rate was given), then every setup, over one workload."""
    prompts = prompts_for(workload, shape_from(args))
    out: dict[str, Any] = {"requests": len(prompts), "setups": {}}
    ids = cell_prompts(prompts, 0, codec).ids
    out["prompt_tokens"] = sum(len(p) for p in ids)
    out["ideal_hit_rate"] = ideal = ideal_hit_rate(ids)
    if workload in ("uniform", "zipf"):
        out["closed_form_hit_rate"] = closed_form_hit_rate(shape_from(args))
    rate = args.request_rate
    if rate is None:
        print(f"-- {workload} / calibrating round_robin's saturation")
        out["calibration"] = cal = calibrate(
            args, replicas, cell_prompts(prompts, next(salts), codec)
        )
        rate = args.load_factor * cal["saturation_rps"]
        print(f"   saturation {cal['saturation_rps']:.2f} req/s -> Poisson {rate:.2f} req/s")
    out["request_rate"] = rate
    for setup in setups_for(args):
        print(f"-- {workload} / {setup.label}")
        kill = None
        if args.scenario == "kill":
            kill = Kill(replicas[-1], args.kill_after, args.window)
        cell_args = argparse.Namespace(**(vars(args) | {"request_rate": rate}))
        cell_input = cell_prompts(prompts, next(salts), codec)
        cell = run_cell(cell_args, replicas, setup, cell_input, kill)
        cell["hit_rate_over_ideal"] = cell["hit_rate"] / ideal if ideal else math.nan
        if args.saturation_all:
            closed = calibrate(args, replicas, cell_prompts(prompts, next(salts), codec), setup)
            cell["saturation"] = closed
        out["setups"][setup.label] = cell
    return out


# -- report -----------------------------------------------------------------------------------


def print_table(workload: str, data: dict[str, Any]) -> None:
    print(
        f"\n{workload}: {data['requests']} requests, H* = {data['ideal_hit_rate']:.3f}, "
        f"Poisson {data['request_rate']:.2f} req/s"
    )
    head = ("hit", "hit/H*", "TTFT p50", "p99", "TPOT p50", "p99", "good/s", "fail", "max/mean")
    print(f"{'setup':<19}" + "".join(f"{h:>9}" for h in head) + "   prefill per replica")
    for label, c in data["setups"].items():
        good = c.get("goodput", {}).get("request_goodput", math.nan)
        row = (c["hit_rate"], c["hit_rate_over_ideal"])
        ms = (c["ttft_ms"]["p50"], c["ttft_ms"]["p99"], c["tpot_ms"]["p50"], c["tpot_ms"]["p99"])
        prefill = "/".join(f"{int(p)}" for p in c["prefill_tokens_per_replica"])
        print(
            f"{label:<19}"
            + "".join(f"{v:>9.3f}" for v in row)
            + "".join(f"{v:>9.0f}" for v in ms)
            + f"{good:>9.2f}{c['failed']:>9}{c['prefill_max_over_mean']:>9.2f}   {prefill}"
        )
        if "saturation" in c:
            print(f"{'':<19}closed-loop saturation {c['saturation']['saturation_rps']:.2f} req/s")
        if "kill" in c:
            print_kill(c["kill"])


def print_kill(k: dict[str, Any]) -> None:
    at = k.get("killed_at_s")
    when = "never" if at is None else f"{at:.2f} s"
    print(
        f"  killed {k['replica']} at {when}: failed not yet streaming "
        f"{k['failed_not_yet_streaming']}, already streaming {k['failed_already_streaming']}"
    )
    for err in k["errors_not_yet_streaming"] + k["errors_already_streaming"]:
        print(f"    error: {err}")
    print("  window   reqs    hit  ideal  hit/ideal")
    for w in k["windows"]:
        ratio = w["hit_rate"] / w["ideal"] if w["ideal"] else math.nan
        mark = (
            "  <- kill"
            if at is not None and w["start_s"] <= at < w["start_s"] + k["window_s"]
            else ""
        )
        print(
            f"  {w['start_s']:>5.0f}s {w['requests']:>6} {w['hit_rate']:>6.3f} {w['ideal']:>6.3f}"
            f" {ratio:>10.3f}{mark}"
        )


def shape_from(args: argparse.Namespace) -> Shape:
    return Shape(
        groups=args.groups,
        prefix_len=args.prefix_blocks * BLOCK_SIZE,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        turns=args.turns,
        zipf_s=args.zipf_s,
        seed=args.seed,
    )


def sizing_for(args: argparse.Namespace, codec: TextCodec | None) -> tuple[Sizing, float]:
    """The replicas' KV pools for the issue's rule, on the prefixes' length as the replicas see
    it (text prompts re-tokenize into more tokens than the ids they were decoded from)."""
    inflation = 1.0
    if codec is not None:
        shape = shape_from(args)
        prefixes = [p[: shape.prefix_len] for p in prompts_for("nosharing", shape)[:8]]
        inflation = text_inflation(prefixes, codec)
    blocks = round(args.prefix_blocks * inflation)
    sizing = size_pools(args.groups, blocks, args.replicas, args.prefix_cache_ratio)
    print(sizing.describe())
    if codec is not None:
        print(f"  (text prompts: {inflation:.3f} tokens per bench token id)")
    return sizing, inflation


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    codec = text_codec() if args.text_prompts else None
    sizing, inflation = sizing_for(args, codec)
    server_args = ["--model", "inferd-tiny", "--block-size", str(BLOCK_SIZE)]
    server_args += ["--kv-cache-memory", str(sizing.replica_blocks * BYTES_PER_BLOCK)]
    server_args += ["--disable-access-log", "--num-threads", "1"]
    result: dict[str, Any] = {
        "command": command_line(),
        "machine": machine_info(),
        "scenario": args.scenario,
        "shape": shape_from(args).__dict__,
        "sizing": sizing.__dict__ | {"ratio_one": sizing.ratio_one},
        "load_factor": args.load_factor,
        "workloads": {},
    }
    result["sizing"]["share_of_cluster"] = sizing.share_of_cluster
    result["sizing"]["text_inflation"] = inflation
    started = time.perf_counter()
    salts = iter(range(SALTS))
    kv_events = args.scenario == "two-routers"
    with launched_replicas(args.replicas, server_args, args.log_dir, kv_events) as replicas:
        result["replica_num_blocks_reported"] = [replica_num_blocks(r.url) for r in replicas]
        for workload in args.workloads:
            data = run_workload(args, replicas, workload, salts, codec)
            result["workloads"][workload] = data
            print_table(workload, data)
    result["wall_s"] = time.perf_counter() - started
    path = args.output or RESULTS_DIR / f"router_{time.strftime('%Y%m%d-%H%M%S')}.json"
    if write_plot(path.with_suffix(".png"), result):
        result["plot"] = str(path.with_suffix(".png"))
    write_result(path, result)
    print(f"\nwrote {path} ({result['wall_s']:.0f} s)")
    return 0


def text_codec() -> TextCodec:
    """inferd-tiny's tokenizer, as the replicas and the router load it."""
    from inferd.router.tokenize import load_tokenizer

    return load_tokenizer("inferd-tiny", None, None)


def peer_router(text: str) -> tuple[str, str]:
    name, sep, cmd = text.partition("=")
    if not sep or not name or not cmd:
        raise argparse.ArgumentTypeError(f"--peer-router wants NAME=CMD, got {text!r}")
    return name, cmd


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small functional run (~minutes)")
    p.add_argument("--scenario", choices=SCENARIOS, default="policies")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=None, choices=POLICIES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--groups", type=int, default=8, help="K: shared prefixes (or sessions)")
    p.add_argument("--prefix-blocks", type=int, default=64, help="P in blocks of 16 tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="S tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--num-requests", type=int, default=None, help="R per workload and setup (200; quick 24)"
    )
    p.add_argument("--turns", type=int, default=6, help="multiturn: turns per session (K of them)")
    p.add_argument("--zipf-s", type=float, default=1.5)
    p.add_argument(
        "--prefix-cache-ratio",
        type=float,
        default=None,
        help="the K prefixes' blocks / one replica's KV blocks (default: 2.5, at most 0.75 x "
        "replicas)",
    )
    p.add_argument(
        "--request-rate", type=float, default=None, help="Poisson req/s (default: calibrated)"
    )
    p.add_argument("--load-factor", type=float, default=0.7, help="x round-robin's saturation")
    p.add_argument("--calibration-requests", type=int, default=64)
    p.add_argument("--calibration-concurrency", type=int, default=8, help="per replica")
    p.add_argument(
        "--saturation-all",
        action="store_true",
        help="also measure every setup's own saturation (closed loop, as the calibration)",
    )
    p.add_argument(
        "--steady-after",
        type=float,
        default=2.0,
        help="TTFT percentiles also over the requests sent after this many seconds (no cold start)",
    )
    p.add_argument("--kill-after", type=float, default=20.0, help="kill: seconds into the cell")
    p.add_argument("--window", type=float, default=5.0, help="kill: hit-rate window, seconds")
    p.add_argument(
        "--peer-router",
        type=peer_router,
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="a peer router as one more setup (policies scenario): CMD with {port} and a "
        "{workers} word, e.g. 'vllm-router --port {port} --worker-urls {workers}'",
    )
    p.add_argument(
        "--text-prompts",
        action="store_true",
        help="send the prompts as text (decoded ids) for routers that take no token ids",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:200"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=RESULTS_DIR / "logs" / "router")
    args = p.parse_args(argv)
    if args.policies is None:
        args.policies = ["cache_aware"] if args.scenario == "kill" else list(POLICIES)
    if args.scenario == "kill":
        args.workloads = args.workloads[:1]
    if args.quick:
        args.groups, args.prefix_blocks, args.suffix_len = 6, 16, 32
        args.output_len, args.turns, args.calibration_requests = 8, 4, 24
        args.num_requests = args.num_requests or 24
        args.no_progress = True
    args.num_requests = args.num_requests or 200
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(main())
