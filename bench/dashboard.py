"""What the dashboard costs a loaded server: served throughput with the page open, closed, and off.

    python bench/dashboard.py --rounds 3 --num-requests 64

Two `inferd serve inferd-tiny` servers run one after the other (never at once): one as shipped
(the request log on), one with `--disable-dashboard` (no request log at all). Each round sends the
same mixed workload (bench/serve.py's: prompts 16-256, outputs 16-128, all at once; each server
first serves it once unmeasured, as a warm-up, since a fresh server's first run is slower) to:

- `off`:    the server with --disable-dashboard;
- `closed`: the default server, nobody reading the dashboard;
- `open`:   the default server while a reader does what an open page does (app.js): the live
            overview stream `/v1/dashboard/events` (one event per second) and the recent-request
            list `/v1/requests?limit=100` every 2 s.

Conditions alternate within each round (off, then closed and open in an order that flips each
round), so drift on a noisy machine spreads over all three; the report gives each condition's
mean output tok/s and the ratios open/closed (the page's cost) and closed/off (the log's cost
with the page closed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from common import RESULTS_DIR, BenchRequest, command_line, machine_info, write_result
from serve import (
    Launched,
    completion_body,
    launched_server,
    process_cpu_seconds,
    run_load,
    summarize,
    workload,
)
from serve import parse_args as serve_args

CONDITIONS = ("off", "closed", "open")
PROCS = ("front", "children")
SUMMARY_KEYS = ("mean_output_tok_s", "mean_cpu_s_per_1k_tokens", "open_vs_closed", "closed_vs_off")
EVENTS_INTERVAL_S = 1.0
LIST_INTERVAL_S = 2.0


async def _page_reader(base: str, stop: asyncio.Event) -> int:
    """What an open dashboard page asks for; returns how many overview events it read."""
    events = 0
    async with httpx.AsyncClient(base_url=base, timeout=None) as client:

        async def poll_list() -> None:
            while not stop.is_set():
                await client.get("/v1/requests", params={"limit": 100})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), LIST_INTERVAL_S)

        poller = asyncio.create_task(poll_list())
        try:
            params = {"interval": EVENTS_INTERVAL_S}
            async with client.stream("GET", "/v1/dashboard/events", params=params) as resp:
                lines = resp.aiter_lines()
                while not stop.is_set():
                    line = await _next_or_stop(lines, stop)
                    if line is None:
                        break
                    events += line.startswith("data:")
        finally:
            stop.set()
            await poller
    return events


async def _next_or_stop(lines: AsyncIterator[str], stop: asyncio.Event) -> str | None:
    read = asyncio.ensure_future(anext(lines))
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if read in done:
        stopped.cancel()
        return read.result()
    read.cancel()
    return None


async def _one_run(
    server: Launched, requests: list[BenchRequest], args: argparse.Namespace, page: bool
) -> dict[str, Any]:
    url = f"{server.url}/v1/completions"
    stop = asyncio.Event()
    reader = asyncio.create_task(_page_reader(server.url, stop)) if page else None
    if reader is not None:
        await asyncio.sleep(EVENTS_INTERVAL_S)  # the page is open before the load starts
    bodies = [completion_body(r, None, 0.0) for r in requests]
    before = process_cpu_seconds(server.pid)
    results, wall, _ = await run_load(url, bodies, args)
    after = process_cpu_seconds(server.pid)
    stop.set()
    events = await reader if reader is not None else 0
    summary = summarize(results, wall, {})
    tokens = summary["output_throughput"] * wall
    # CPU per 1k output tokens of the API server process (where the log and the page's reads
    # run) and of the engine core (its child): less noisy than throughput on a shared machine.
    cpu = {k: 1000 * (after[k] - before[k]) / tokens for k in before} if before else {}
    return {
        "output_tok_s": summary["output_throughput"],
        "cpu_s_per_1k_tokens": cpu,
        "failed": summary["failed"],
        "events": events,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--server-args", default="inferd-tiny", help="arguments of `inferd serve`")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    load_args = serve_args(["--num-requests", str(args.num_requests), "--no-progress"])
    requests = workload(load_args, load_args.seed, args.num_requests)
    base_args = args.server_args.split()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONDITIONS}
    log = RESULTS_DIR / "dashboard.server.log"
    for r in range(args.rounds):
        with launched_server([*base_args, "--disable-dashboard"], log) as server:
            asyncio.run(_one_run(server, requests, load_args, False))  # warm-up, not counted
            runs["off"].append(asyncio.run(_one_run(server, requests, load_args, False)))
        with launched_server(base_args, log) as server:
            asyncio.run(_one_run(server, requests, load_args, False))  # warm-up, not counted
            # Alternate which goes first, so neither always meets the freshly started server.
            for cond in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                runs[cond].append(
                    asyncio.run(_one_run(server, requests, load_args, cond == "open"))
                )
        print(
            f"round {r + 1}: "
            + ", ".join(f"{c} {runs[c][-1]['output_tok_s']:.1f}" for c in CONDITIONS)
        )
    mean = {c: statistics.fmean(x["output_tok_s"] for x in runs[c]) for c in CONDITIONS}
    cpu = {
        c: {k: statistics.fmean(x["cpu_s_per_1k_tokens"][k] for x in runs[c]) for k in PROCS}
        for c in CONDITIONS
        if all(x["cpu_s_per_1k_tokens"] for x in runs[c])
    }
    report = {
        "command": command_line(),
        "machine": machine_info(),
        "runs": runs,
        "mean_output_tok_s": mean,
        "mean_cpu_s_per_1k_tokens": cpu,
        "open_vs_closed": mean["open"] / mean["closed"],
        "closed_vs_off": mean["closed"] / mean["off"],
    }
    out = args.out or RESULTS_DIR / f"dashboard_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(out, report)
    print(
        json.dumps(
            {k: report[k] for k in SUMMARY_KEYS},
            indent=2,
        )
    )
    failed = sum(x["failed"] for c in CONDITIONS for x in runs[c])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
