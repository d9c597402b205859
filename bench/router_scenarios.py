"""The routing benchmark's measured cells: one routing setup (a policy behind one or two fresh
routers, approximate or exact index) over one workload, round-robin's saturation calibration,
and the same cell with a replica SIGKILLed part-way (failures split by whether the request was
already streaming, and the hit rate per time window after the kill)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from common import BenchRequest
from router_cluster import (
    CounterSampler,
    Replica,
    in_flight,
    kill_replica,
    launched_router,
    prefix_counters,
    router_stats,
)
from router_workloads import CellPrompts, ideal_hit_tokens
from serve import (
    RequestResult,
    completion_body,
    distribution_ms,
    parse_goodput,
    run_load,
    summarize,
)


@dataclass(frozen=True)
class Setup:
    """How a cell routes: `policy` behind `routers` independent router processes (no shared
    state; the client splits its Poisson arrivals between them at random), each with an index
    built from its own decisions or, with `exact`, from the replicas' KV events."""

    label: str
    policy: str
    routers: int = 1
    exact: bool = False
    # A peer router's command line instead of `inferd router` ({port} and {workers} filled in).
    command: str | None = None
    # More `inferd router` flags (e.g. --no-replica-digest).
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kill:
    """SIGKILL `replica` `after_s` seconds into the cell; hit rates in `window_s` windows."""

    replica: Replica
    after_s: float
    window_s: float


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


async def split_load(
    urls: list[str], bodies: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at `args.request_rate` in all, dealt to the routers: the union of k
    independent Poisson streams at rate/k each is one Poisson stream at the rate. Results come
    back in workload order."""
    k = len(urls)
    runs = await asyncio.gather(
        *(
            run_load(
                f"{url}/v1/completions",
                bodies[i::k],
                _with(args, request_rate=args.request_rate / k, seed=args.seed + i),
            )
            for i, url in enumerate(urls)
        )
    )
    results: list[RequestResult] = [RequestResult(0)] * len(bodies)
    for i, (part, _, _) in enumerate(runs):
        results[i::k] = part
    return results, max(wall for _, wall, _ in runs)


def bodies_for(prompts: CellPrompts, output_len: int) -> list[dict[str, Any]]:
    """Streaming completion bodies; a text prompt replaces the token ids (its `prompt_len` in
    the client's results is then in characters)."""
    bodies = []
    for sent, ids in zip(prompts.sent, prompts.ids, strict=True):
        # `model` named: sglang-router's schema requires it (inferd does not).
        body = completion_body(BenchRequest(ids, output_len), "inferd-tiny", 0.0)
        body["prompt"] = sent
        bodies.append(body)
    return bodies


def run_cell(
    args: argparse.Namespace,
    replicas: list[Replica],
    setup: Setup,
    prompts: CellPrompts,
    kill: Kill | None = None,
) -> dict[str, Any]:
    """One setup over one (salted) workload at `args.request_rate`: the replicas' counter
    deltas, the client's latencies, and the routers' own view."""
    urls = [r.url for r in replicas]
    bodies = bodies_for(prompts, args.output_len)
    before = [prefix_counters(u) for u in urls]
    sampler = CounterSampler(urls)
    with ExitStack() as stack:
        routers = [
            stack.enter_context(
                launched_router(
                    replicas,
                    setup.policy,
                    args.log_dir / f"router_{setup.label}_{i}.log",
                    setup.exact,
                    setup.command,
                    setup.flags,
                )
            )
            for i in range(setup.routers)
        ]
        sampler.start(time.perf_counter())  # the load's clock starts right after
        switch = KillSwitch(kill, routers[0], time.perf_counter()) if kill else None
        if switch is not None:
            switch.arm()
        results, wall = asyncio.run(split_load(routers, bodies, args))
        if switch is not None:
            switch.disarm()
        sampler.stop()
        routed = router_stats(routers) if setup.command is None else {}
    # The last sample: live replicas scraped at the end, a killed one's values frozen.
    summary = cell_summary(args, results, wall, before, sampler.samples[-1][1])
    summary |= {f"router_{k}": v for k, v in routed.items()}
    if kill is not None:
        summary["kill"] = kill_report(kill, results, prompts.ids, sampler, wall)
        summary["kill"]["killed_at_s"] = switch.fired_s if switch else None
        summary["kill"]["killed"] = summary["kill"]["killed_at_s"] is not None
    return summary


# How long a kill may wait past `after_s` for a request in flight on the victim.
STREAM_WAIT_S = 30.0


@dataclass
class KillSwitch:
    """Kills `kill.replica` `after_s` into the cell, at the first moment from then on when the
    router has a request in flight there (within STREAM_WAIT_S; then regardless), so that the
    kill catches a stream open on it. `fired_s`: when it fired, in seconds since `start`."""

    kill: Kill
    router: str
    start: float
    fired_s: float | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def arm(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        if self._done.wait(self.kill.after_s):
            return
        deadline = time.monotonic() + STREAM_WAIT_S
        while time.monotonic() < deadline and not self._done.is_set():
            if in_flight(self.router, self.kill.replica.url) > 0:
                break
            time.sleep(0.02)
        if not self._done.is_set():
            kill_replica(self.kill.replica)
            self.fired_s = time.perf_counter() - self.start


def cell_summary(
    args: argparse.Namespace,
    results: list[RequestResult],
    wall: float,
    before: list[tuple[float, float]],
    after: list[tuple[float, float]],
) -> dict[str, Any]:
    queried = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    prefill = [q - h for q, h in zip(queried, hits, strict=True)]
    summary = summarize(results, wall, parse_goodput(args.goodput))
    summary["request_rate"] = args.request_rate
    summary["hit_rate"] = sum(hits) / sum(queried) if sum(queried) else math.nan
    summary["prefill_tokens_per_replica"] = prefill
    mean = float(np.mean(prefill)) if prefill else 0.0
    summary["prefill_max_over_mean"] = max(prefill) / mean if mean else math.nan
    # Per request (workload order): when it was sent and its TTFT, both in seconds (NaN when it
    # failed), to see where a tail comes from (cold groups at the start, a burst, a spill).
    summary["sent_s_ttft_s"] = [
        (round(r.start, 3), round(r.ttft, 4) if r.success else math.nan) for r in results
    ]
    # The same TTFTs without the cold start (every prefix new at once): the steady state.
    steady = [r.ttft for r in results if r.success and r.start >= args.steady_after]
    summary["ttft_ms_steady"] = {"sent_after_s": args.steady_after} | distribution_ms(steady)
    return summary


ROUND_ROBIN = Setup("calibrate", "round_robin")


def calibrate(
    args: argparse.Namespace,
    replicas: list[Replica],
    prompts: CellPrompts,
    setup: Setup = ROUND_ROBIN,
) -> dict[str, Any]:
    """A setup's saturation on this workload (round-robin's sets the load): closed-loop
    throughput with `calibration_concurrency` requests per replica always outstanding (more
    concurrency only queues), over the workload's first `calibration_requests` prompts (own
    salt, so cold)."""
    n = min(len(prompts.ids), args.calibration_requests)
    concurrency = args.calibration_concurrency * len(replicas)
    closed = _with(args, request_rate=math.inf, max_concurrency=concurrency)
    cell = run_cell(closed, replicas, setup, prompts.head(n))
    return {
        "requests": n,
        "concurrency": concurrency,
        "saturation_rps": cell["request_throughput"],
        "failed": cell["failed"],
        "ttft_ms_p50": cell["ttft_ms"]["p50"],
        "hit_rate": cell["hit_rate"],
    }


def kill_report(
    kill: Kill,
    results: list[RequestResult],
    prompts: list[list[int]],
    sampler: CounterSampler,
    wall: float,
) -> dict[str, Any]:
    """Failures by whether the client had a token yet, and the cluster's hit rate per window
    against the ideal of the requests sent in that window (an infinite cache's)."""
    failed = [r for r in results if not r.success]
    not_streaming = [r for r in failed if not r.chunk_times]
    streaming = [r for r in failed if r.chunk_times]
    edges = list(np.arange(0.0, wall + kill.window_s, kill.window_s))
    measured = sampler.window_hit_rates(edges)
    ideal_hits = ideal_hit_tokens(prompts)
    windows = []
    for (lo, hi), hit in zip(itertools.pairwise(edges), measured, strict=True):
        sent = [i for i, r in enumerate(results) if lo <= r.start < hi]
        tokens = sum(len(prompts[i]) for i in sent)
        ideal = sum(ideal_hits[i] for i in sent) / tokens if tokens else math.nan
        windows.append({"start_s": lo, "requests": len(sent), "hit_rate": hit, "ideal": ideal})
    return {
        "replica": kill.replica.url,
        "after_s": kill.after_s,
        "window_s": kill.window_s,
        "failed_not_yet_streaming": len(not_streaming),
        "failed_already_streaming": len(streaming),
        "errors_not_yet_streaming": sorted({r.error for r in not_streaming})[:5],
        "errors_already_streaming": sorted({r.error for r in streaming})[:5],
        "windows": windows,
    }
