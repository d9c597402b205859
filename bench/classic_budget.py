"""Where the CPU of a classic model's request goes under load, and whether a target rate fits:
inferd alone on the example repository, closed-loop clients, each thread's CPU time from /proc
over the measurement, per request.

    .venv/bin/python bench/classic_budget.py --model minilm --clients 8 --target-rps 321

Groups (the server's threads are told apart by what they do, since Python does not name them
for the OS):
- `event_loop`: the main thread (HTTP, decoding, the batcher, responses);
- `model` (minilm, whose model outweighs everything else by far): the `intra_op_threads`
  busiest other threads: the batcher's worker, which calls ONNX Runtime and works as one of its
  threads, and ONNX Runtime's own intra-op threads (the image model's preprocessing outweighs
  its model, so there the model's threads are not told apart and count as `other`);
- `other`: the rest of the server (the preprocess pool: tokenizing, image decoding);
- `client`: this process's aiohttp clients, which share the machine's cores.
With `--target-rps`: the CPU each request may take at that rate on this machine's cores
(cores x 1000 / rate, ms) against the sum of the groups. A sum above it cannot be served at the
target on this machine by any packing of the same work; `idle_cores` is what the server and the
client left unused; `cores_needed_model_alone` is the rate's need with the model's CPU a row as
it is alone (below) and the rest as measured.

`model_alone` (minilm): ONNX Runtime in this process, with the server's batch session settings
(intra-op threads that do not spin), on the same sentences cut as the batcher cuts them: windows
of one request per client (all a closed loop can have queued), each split into calls by
inferd.batching.cost's cheapest length ranges at the overhead calibrated here. Its CPU a row
is the model's share of the budget without a server beside it. JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import yaml
from batching import batch_sizes, closed_loop, sentence_calls
from classic_peers import MODELS, endpoint, workload
from common import RESULTS_DIR, command_line, machine_info, write_result
from serve import launched_server

WARMUP_S = 2.0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of the process's threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended while being listed
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def split(pid: int, used: dict[int, float], model_threads: int) -> dict[str, float]:
    """CPU seconds per group: the main thread, the `model_threads` busiest others (none: no
    `model` group), the rest."""
    others = sorted((s for tid, s in used.items() if tid != pid), reverse=True)
    groups = {"event_loop": used.get(pid, 0.0), "other": sum(others[model_threads:])}
    if model_threads:
        groups["model"] = sum(others[:model_threads])
    return groups


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = workload(args.model, args.repository, args.seed)
    config = yaml.safe_load((args.repository / args.model / "config.yaml").read_text())
    threads = int(config["parameters"]["intra_op_threads"])
    model_threads = threads if args.model == "minilm" else 0
    server_args = ["--model-repository", str(args.repository), "--grpc-port", "-1"]
    log = RESULTS_DIR / "logs" / "classic_budget.log"
    with launched_server([*server_args, "--disable-access-log"], log) as server:
        ep = endpoint("inferd", server.url, args.model)
        asyncio.run(closed_loop(ep.url, ep.body, work.items, args.clients, WARMUP_S))
        before, cpu0, t0 = thread_cpu(server.pid), time.process_time(), time.perf_counter()
        result = asyncio.run(closed_loop(ep.url, ep.body, work.items, args.clients, args.seconds))
        after, cpu1, t1 = thread_cpu(server.pid), time.process_time(), time.perf_counter()
        rows_per_call = batch_sizes(server.url).get(args.model, 1.0)
    wall = t1 - t0
    requests = result["throughput_rps"] * wall
    used = {tid: s - before.get(tid, 0.0) for tid, s in after.items()}
    groups = split(server.pid, used, model_threads) | {"client": cpu1 - cpu0}
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {
        "model": args.model,
        "clients": args.clients,
        "rps": result["throughput_rps"],
        "latency_ms": result["latency_ms"],
        "cpu_ms_per_request": {k: 1e3 * s / requests for k, s in groups.items()},
        "cores_used": {k: s / wall for k, s in groups.items()},
        "cores": cores,
        "idle_cores": cores - sum(groups.values()) / wall,
        "rows_per_call": rows_per_call,
    }
    out["cpu_ms_per_request"]["total"] = sum(out["cpu_ms_per_request"].values())
    if args.target_rps:
        budget = cores * 1e3 / args.target_rps
        out["target"] = {
            "rps": args.target_rps,
            "budget_ms_per_request": budget,
            "fits": out["cpu_ms_per_request"]["total"] <= budget,
        }
    if args.model == "minilm":
        out["model_alone"] = model_alone(work.model_dir, work.items, threads, args.clients)
        if args.target_rps:
            # The same, with the model as efficient as it is alone.
            serving = out["cpu_ms_per_request"]["total"] - out["cpu_ms_per_request"]["model"]
            need = out["model_alone"]["cpu_ms_per_row"] + serving
            out["target"]["cores_needed_model_alone"] = need * args.target_rps / 1e3
    return out


def model_alone(model_dir: Path, texts: list[str], threads: int, window: int) -> dict[str, float]:
    """ONNX Runtime alone on `texts` cut as the batcher cuts them (see the module docstring)."""
    from inferd.batching.cost import calibrate, cheapest_ranges

    encoded, run = sentence_calls(model_dir, texts, threads, spinning=False)
    overhead = calibrate(lambda n, length: run([[1] * length] * n), 64) or 0.0
    calls: list[list[list[int]]] = []
    for i in range(0, len(encoded), window):
        rows = encoded[i : i + window]
        by_length: dict[int, int] = {}
        for r in rows:
            by_length[len(r)] = by_length.get(len(r), 0) + 1
        for lo, hi in cheapest_ranges(by_length, overhead, 64):
            calls.append([r for r in rows if lo <= len(r) <= hi])
    cpu0, t0 = time.process_time(), time.perf_counter()
    for call in calls:
        run(call)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    padded = sum(len(c) * max(len(r) for r in c) for c in calls)
    return {
        "overhead_elements": overhead,
        "rows_per_call": len(encoded) / len(calls),
        "padding_ratio": 1 - sum(len(r) for r in encoded) / padded,
        "rows_per_s": len(encoded) / wall,
        "cpu_ms_per_row": 1e3 * cpu / len(encoded),
        "cores_used": cpu / wall,
    }


def main(argv: list[str] | None = None) -> int:
    from inferd.examples import ensure_example_repository

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="minilm", choices=MODELS)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--target-rps", type=float, default=None)
    p.add_argument("--repository", type=Path, default=None, help="default: the examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.repository = args.repository or ensure_example_repository()
    result = measure(args)
    print(f"{args.model}, {args.clients} clients: {result['rps']:.1f} req/s")
    for group, ms in result["cpu_ms_per_request"].items():
        print(f"  {group:10s} {ms:6.3f} ms CPU a request")
    print(f"  idle cores {result['idle_cores']:.2f} of {result['cores']}")
    if "model_alone" in result:
        alone = result["model_alone"]
        print(
            f"  model alone, {alone['rows_per_call']:.2f} rows a call: "
            f"{alone['cpu_ms_per_row']:.3f} ms CPU a row, {alone['rows_per_s']:.1f} rows/s"
        )
    if "target" in result:
        t = result["target"]
        print(f"  at {t['rps']:.0f} req/s a request may take {t['budget_ms_per_request']:.3f} ms")
        if "cores_needed_model_alone" in t:
            need = t["cores_needed_model_alone"]
            print(f"  with the model as alone, {t['rps']:.0f} req/s needs {need:.2f} cores")
    out = args.out or RESULTS_DIR / f"classic_budget_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(out, {"command": command_line(), "machine": machine_info(), **result})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
