"""Routing benchmark: shared-prefix workloads through `inferd router` over inferd-tiny replicas,
one policy after another in the same run (issue 9's benchmark; not a timed test).

    .venv/bin/python bench/router.py --quick
    .venv/bin/python bench/router.py --replicas 2 --request-rate 4 --num-requests 200

Workloads (bench token ids, seeded, the same for every policy):
    uniform     K groups, each a P-token shared prefix; every request = a group's prefix + its own
                S-token suffix, groups drawn uniformly
    zipf        the same, groups drawn Zipf(s): the hottest group carries more than 1/N of the
                traffic, so a policy must spill it to keep the load balanced
    multiturn   K sessions of T turns; turn t's prompt = turn t-1's prompt + the assistant's reply
                (S tokens standing in for it) + a new S-token user message; rounds of turns
    nosharing   every prompt unique (P + S tokens): any hit is noise, only balance matters

The replicas' KV pools are shrunk (`--kv-cache-memory`) so the K prefixes need more than one
replica's cache (`--prefix-cache-ratio`, default 1.5x) but fit the cluster's; otherwise every
policy hits and the comparison says nothing.

Per (workload, policy) cell: a fresh router process (empty index); the same replicas, with the
cell's own first token put in front of every prompt, so earlier cells' blocks never match (the
block hash is chained) and only sit in the replicas' caches as evictable blocks. Hit rate comes
from the replicas' `inferd_prefix_cache_{queries,hits}_tokens_total` (deltas over the cell),
against the ideal H* = (tokens an infinite cache would hit) / (prompt tokens), which for grouped
workloads is H* = 1 - (K*P + R*S) / (R*(P+S)) (R requests). Per-replica prefill work is the
prompt tokens each replica computed (queries - hits). Latencies are bench/serve.py's (TTFT, TPOT,
goodput under `--goodput` SLOs). Arrivals are Poisson at `--request-rate` (a fixed rate: the
issue's 0.7 x round-robin's measured saturation is not calibrated here).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import RESULTS_DIR, BenchRequest, command_line, machine_info, write_result
from prometheus_client.parser import text_string_to_metric_families
from serve import (
    completion_body,
    free_port,
    launched_server,
    parse_goodput,
    run_load,
    stop_server,
    summarize,
    wait_ready,
)

from inferd.models.tiny import TINY_CONFIG

POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")
WORKLOADS = ("uniform", "zipf", "multiturn", "nosharing")
BLOCK_SIZE = 16
VOCAB = int(TINY_CONFIG["vocab_size"])
# float32 K and V over all layers for one block of BLOCK_SIZE tokens (inferd-tiny's shape).
_HEAD_DIM = int(TINY_CONFIG["hidden_size"]) // int(TINY_CONFIG["num_attention_heads"])
BYTES_PER_BLOCK = (
    2
    * int(TINY_CONFIG["num_hidden_layers"])
    * int(TINY_CONFIG["num_key_value_heads"])
    * _HEAD_DIM
    * BLOCK_SIZE
    * 4
)


@dataclass(frozen=True)
class Shape:
    """The workload family's sizes (tokens); every variant is built from them."""

    groups: int  # K
    prefix_len: int  # P, a multiple of the block size
    suffix_len: int  # S
    output_len: int
    num_requests: int  # R (multiturn: groups x turns instead)
    turns: int  # multiturn: turns per session
    zipf_s: float
    seed: int


# -- workloads --------------------------------------------------------------------------------


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    # Token 0..7 are left for the cell salts (one leading token per cell).
    ids: list[int] = rng.integers(8, VOCAB, size=n).tolist()
    return ids


def grouped(shape: Shape, weights: np.ndarray) -> list[list[int]]:
    """R prompts: group g's prefix (drawn with `weights`) + a unique suffix."""
    rng = np.random.default_rng(shape.seed)
    prefixes = [_ids(rng, shape.prefix_len) for _ in range(shape.groups)]
    picks = rng.choice(shape.groups, size=shape.num_requests, p=weights / weights.sum())
    return [prefixes[g] + _ids(rng, shape.suffix_len) for g in picks]


def multiturn(shape: Shape) -> list[list[int]]:
    """K sessions' T turns in rounds (every session's turn 1, then turn 2, ...), each round in a
    shuffled order; a turn's prompt extends the previous one (reply + new user message)."""
    rng = np.random.default_rng(shape.seed)
    turns = shape.turns
    history = [_ids(rng, shape.prefix_len) for _ in range(shape.groups)]
    prompts: list[list[int]] = []
    for turn in range(turns):
        for s in rng.permutation(shape.groups):
            if turn > 0:
                history[s] = history[s] + _ids(rng, 2 * shape.suffix_len)
            prompts.append(list(history[s]))
    return prompts


def prompts_for(workload: str, shape: Shape) -> list[list[int]]:
    if workload == "uniform":
        return grouped(shape, np.ones(shape.groups))
    if workload == "zipf":
        return grouped(shape, 1.0 / np.arange(1, shape.groups + 1) ** shape.zipf_s)
    if workload == "multiturn":
        return multiturn(shape)
    rng = np.random.default_rng(shape.seed)
    return [_ids(rng, shape.prefix_len + shape.suffix_len) for _ in range(shape.num_requests)]


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """H* with an infinite cache: each prompt's leading full blocks already seen in an earlier
    prompt (block-chained, as the replicas match; at least one token is always computed)."""
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for p in prompts:
        matching = True
        for end in range(BLOCK_SIZE, len(p), BLOCK_SIZE):
            key = tuple(p[:end])
            if matching and key in seen:
                hit += BLOCK_SIZE
            else:
                matching = False
            seen.add(key)
    return hit / sum(len(p) for p in prompts)


def closed_form_hit_rate(shape: Shape) -> float:
    """The issue's H* = 1 - (K*P + R*S) / (R*(P+S)) for grouped workloads."""
    k, p, s, r = shape.groups, shape.prefix_len, shape.suffix_len, shape.num_requests
    return 1.0 - (k * p + r * s) / (r * (p + s))


# -- replica and router metrics ---------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `url`/metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def prefix_counters(url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens of one replica so far."""
    m = scrape(url)
    return (
        m.get(("inferd_prefix_cache_queries_tokens_total", ()), math.nan),
        m.get(("inferd_prefix_cache_hits_tokens_total", ()), math.nan),
    )


def replica_num_blocks(url: str) -> int | None:
    for (name, labels), _ in scrape(url).items():
        if name == "inferd_cache_config_info":
            return int(dict(labels)["num_blocks"])
    return None


def router_stats(url: str) -> dict[str, Any]:
    """The router's view of the cell: requests by "replica|outcome", and its estimated hit rate
    (the tokens its index expected cached / the prompt tokens it routed)."""
    outcomes: dict[str, float] = {}
    totals = {"inferd_router_prompt_tokens_total": 0.0}
    totals["inferd_router_estimated_cached_tokens_total"] = 0.0
    for (name, labels), value in scrape(url).items():
        if name == "inferd_router_requests_total":
            d = dict(labels)
            outcomes[f"{d.get('replica')}|{d.get('outcome')}"] = value
        elif name in totals:
            totals[name] += value
    prompt = totals["inferd_router_prompt_tokens_total"]
    cached = totals["inferd_router_estimated_cached_tokens_total"]
    return {"requests": outcomes, "estimated_hit_rate": cached / prompt if prompt else math.nan}


@contextmanager
def launched_router(replicas: list[str], policy: str, log_path: Path) -> Iterator[str]:
    port = free_port()
    exe = Path(sys.executable).parent / "inferd"
    cmd = [str(exe), "router", "--port", str(port), "--policy", policy, "--seed", "0"]
    cmd += ["--block-size", str(BLOCK_SIZE)]
    for url in replicas:
        cmd += ["--replica", url]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/health/ready", proc)
            yield base
        finally:
            stop_server(proc)


# -- one cell ---------------------------------------------------------------------------------


def run_cell(
    args: argparse.Namespace,
    replicas: list[str],
    policy: str,
    prompts: list[list[int]],
    salt: int,
) -> dict[str, Any]:
    """One policy over one workload: a fresh router, the replicas' counter deltas."""
    bodies = [
        completion_body(BenchRequest([salt, *p], args.output_len), None, 0.0) for p in prompts
    ]
    before = [prefix_counters(u) for u in replicas]
    log = args.log_dir / f"router_{policy}_{salt}.log"
    with launched_router(replicas, policy, log) as url:
        results, wall, _ = asyncio.run(run_load(f"{url}/v1/completions", bodies, args))
        routed = router_stats(url)
    after = [prefix_counters(u) for u in replicas]
    queried = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    prefill = [q - h for q, h in zip(queried, hits, strict=True)]
    summary = summarize(results, wall, parse_goodput(args.goodput))
    summary["hit_rate"] = sum(hits) / sum(queried) if sum(queried) else math.nan
    summary["prefill_tokens_per_replica"] = prefill
    mean = float(np.mean(prefill)) if prefill else 0.0
    summary["prefill_max_over_mean"] = max(prefill) / mean if mean else math.nan
    summary["router_requests"] = routed["requests"]
    summary["router_estimated_hit_rate"] = routed["estimated_hit_rate"]
    return summary


def run_workload(
    args: argparse.Namespace, replicas: list[str], workload: str, shape: Shape, first_salt: int
) -> dict[str, Any]:
    prompts = prompts_for(workload, shape)
    ideal = ideal_hit_rate([[0, *p] for p in prompts])
    out: dict[str, Any] = {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) + 1 for p in prompts),
        "ideal_hit_rate": ideal,
        "policies": {},
    }
    if workload in ("uniform", "zipf"):
        out["closed_form_hit_rate"] = closed_form_hit_rate(shape)
    for i, policy in enumerate(args.policies):
        print(f"-- {workload} / {policy}")
        cell = run_cell(args, replicas, policy, prompts, first_salt + i)
        cell["hit_rate_over_ideal"] = cell["hit_rate"] / ideal if ideal else math.nan
        out["policies"][policy] = cell
    return out


# -- report -----------------------------------------------------------------------------------


def print_table(workload: str, data: dict[str, Any]) -> None:
    print(f"\n{workload}: {data['requests']} requests, H* = {data['ideal_hit_rate']:.3f}")
    head = ("policy", "hit", "hit/H*", "TTFT p50", "p99", "TPOT p50", "p99", "good/s", "fail")
    print(f"{head[0]:<13}" + "".join(f"{h:>9}" for h in head[1:]) + "   prefill per replica")
    for policy, c in data["policies"].items():
        good = c.get("goodput", {}).get("request_goodput", math.nan)
        row = (c["hit_rate"], c["hit_rate_over_ideal"])
        ms = (c["ttft_ms"]["p50"], c["ttft_ms"]["p99"], c["tpot_ms"]["p50"], c["tpot_ms"]["p99"])
        prefill = "/".join(f"{int(p)}" for p in c["prefill_tokens_per_replica"])
        print(
            f"{policy:<13}"
            + "".join(f"{v:>9.3f}" for v in row)
            + "".join(f"{v:>9.0f}" for v in ms)
            + f"{good:>9.2f}{c['failed']:>9}   {prefill}"
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


def replica_blocks(args: argparse.Namespace) -> int:
    """One replica's KV pool: the K prefixes are `prefix_cache_ratio` x its size."""
    blocks: int = round(args.groups * args.prefix_blocks / args.prefix_cache_ratio)
    return max(1, blocks)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = shape_from(args)
    blocks = replica_blocks(args)
    server_args = ["--model", "inferd-tiny", "--block-size", str(BLOCK_SIZE)]
    server_args += ["--kv-cache-memory", str(blocks * BYTES_PER_BLOCK), "--disable-access-log"]
    server_args += ["--num-threads", "1"]
    result: dict[str, Any] = {
        "command": command_line(),
        "machine": machine_info(),
        "shape": shape.__dict__,
        "replicas": args.replicas,
        "replica_kv_blocks": blocks,
        "prefix_blocks_total": args.groups * args.prefix_blocks,
        "request_rate": args.request_rate,
        "workloads": {},
    }
    started = time.perf_counter()
    with ExitStack() as stack:
        urls = [
            stack.enter_context(launched_server(server_args, args.log_dir / f"replica{i}.log")).url
            for i in range(args.replicas)
        ]
        result["replica_num_blocks_reported"] = [replica_num_blocks(u) for u in urls]
        for w, workload in enumerate(args.workloads):
            data = run_workload(args, urls, workload, shape, 1 + w * len(args.policies))
            result["workloads"][workload] = data
            print_table(workload, data)
    result["wall_s"] = time.perf_counter() - started
    path = args.output or RESULTS_DIR / f"router_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(path, result)
    print(f"\nwrote {path}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small functional run (~minutes)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--groups", type=int, default=8, help="K: shared prefixes (or sessions)")
    p.add_argument("--prefix-blocks", type=int, default=64, help="P in blocks of 16 tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="S tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=200, help="R per workload and policy")
    p.add_argument("--turns", type=int, default=6, help="multiturn: turns per session (K of them)")
    p.add_argument("--zipf-s", type=float, default=1.5)
    p.add_argument(
        "--prefix-cache-ratio",
        type=float,
        default=1.5,
        help="the K prefixes' blocks / one replica's KV blocks",
    )
    p.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:200"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=RESULTS_DIR / "logs" / "router")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.prefix_blocks, args.suffix_len = 6, 16, 32
        args.output_len, args.num_requests, args.turns = 8, 24, 4
        args.no_progress = True
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(main())
