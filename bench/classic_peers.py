"""Classic models beside the Python serving frameworks: MiniLM embeddings from inferd, a plain
FastAPI endpoint, LitServe, mosec, Ray Serve and Triton (PyTriton), each alone, in one run.

    .venv/bin/python bench/classic_peers.py --peers-python /work/bench-peers-venv/bin/python \\
        --pytriton-python /work/bench-pytriton310-venv/bin/python

The workload a platform engineer would try: all-MiniLM-L6-v2 (the example repository's ONNX file
and tokenizer, `--model-repository examples`), ONNX Runtime with 2 intra-op threads in every
server, batches of up to 64, a 3 ms maximum wait everywhere; closed-loop aiohttp clients at 1, 8
and 64, each sending one seeded 8-40-word sentence, waiting for its embedding, sending the next.
Servers:
- `inferd`: `inferd serve --model-repository <examples>`, the Open Inference Protocol's
  `POST /v2/models/minilm/infer` (the example's config: max_batch_size 64, max_queue_delay_ms 3);
- `plain`: bench/plain_embed_server.py, a sync FastAPI endpoint calling the session per request;
- `litserve`, `mosec`, `ray` (`@serve.batch`), `pytriton`: bench/classic_peer_servers.py run by
  `--peers-python` / `--pytriton-python` (their own environments: none is a dependency of
  inferd). A peer whose Python is not given, or that does not start, is reported as skipped.
Only one server runs at a time (started, measured at every client count, stopped); `--rounds`
rounds, the order rotated each round, so a slow spell of the machine hits every server. Reported
per server and client count: the median over rounds of requests/s, p50 and p99, the 1-minute load
average around each measurement, and inferd's own stage times at 1 client. Plus the model alone
(ONNX Runtime in this process: one sentence at a time vs batches of 64). JSON to bench/results/.
Targets (issue 44): at 1 client inferd's p50 within 1 ms of plain's and no peer's lower; at 8
and 64 clients >= 1.3x the best peer's requests/s with a lower p99 than every peer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from batching import STAGES, closed_loop, compute_ceiling, plain_server, sentences
from common import RESULTS_DIR, command_line, machine_info, write_result
from serve import free_port, launched_server

PEERS = ("litserve", "mosec", "ray", "pytriton")
SERVERS = ("inferd", "plain", *PEERS)
TARGET_THROUGHPUT_X = 1.3
TARGET_P50_MS = 1.0
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
LOGS = RESULTS_DIR / "logs"

Body = Callable[[str], dict[str, Any]]


def oip_body(text: str) -> dict[str, Any]:
    """The Open Inference Protocol request of one sentence (inferd and Triton)."""
    return {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}


def plain_body(text: str) -> dict[str, Any]:
    return {"input": text}


@dataclass(frozen=True)
class Endpoint:
    url: str
    body: Body


def endpoint(name: str, base: str) -> Endpoint:
    if name in ("inferd", "pytriton"):
        return Endpoint(f"{base}/v2/models/minilm/infer", oip_body)
    return Endpoint(f"{base}/{'inference' if name == 'mosec' else 'embed'}", plain_body)


@contextlib.contextmanager
def running(name: str, args: argparse.Namespace, model_dir: Path) -> Iterator[Endpoint]:
    """One server, started and ready, until the block ends."""
    if name == "inferd":
        server_args = ["--model-repository", str(args.repository), "--grpc-port", "-1"]
        with launched_server(
            [*server_args, "--disable-access-log"], LOGS / "classic_inferd.log"
        ) as s:
            yield endpoint(name, s.url)
    elif name == "plain":
        with plain_server(model_dir, args.threads, LOGS / "classic_plain.log") as base:
            yield endpoint(name, base)
    else:
        with peer(name, args, model_dir) as base:
            yield endpoint(name, base)


@contextlib.contextmanager
def peer(name: str, args: argparse.Namespace, model_dir: Path) -> Iterator[str]:
    python = args.pytriton_python if name == "pytriton" else args.peers_python
    port = free_port() if name != "pytriton" else _three_free_ports()
    script = Path(__file__).parent / "classic_peer_servers.py"
    cmd = [str(python), str(script), name, "--model-dir", str(model_dir), "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size)]
    cmd += ["--max-wait-ms", str(args.max_wait_ms)]
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / f"classic_{name}.log").open("w") as log:
        # A session of its own: the peers start worker processes, stopped with it as a group.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_answering(endpoint(name, base), proc)
            yield base
        finally:
            _stop_group(proc)


def _three_free_ports() -> int:
    """A port p with p+1 and p+2 free too (Triton's HTTP, gRPC and metrics ports)."""
    for _ in range(100):
        port = free_port()
        if port < 65530 and all(_is_free(port + i) for i in (1, 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_answering(ep: Endpoint, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before answering")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(ep.url, json=ep.body("warm up"), timeout=10).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"did not answer within {START_TIMEOUT_S:.0f} s")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by the group's leader
    proc.wait()


def measure(name: str, ep: Endpoint, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clients in args.clients:
        load = os.getloadavg()[0]
        r = asyncio.run(closed_loop(ep.url, ep.body, texts, clients, args.seconds))
        r["load_1m"] = [load, os.getloadavg()[0]]
        out[str(clients)] = r
        lat = r["latency_ms"]
        print(
            f"{name:>9} clients={clients:<3} {r['throughput_rps']:7.1f} req/s  "
            f"p50 {lat['p50']:7.2f} ms  p99 {lat['p99']:7.2f} ms  errors {r['errors']}  "
            f"load {load:.1f}",
            flush=True,
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    texts = sentences(4096, args.seed)
    model_dir = max((args.repository / "minilm").glob("[0-9]*"), key=lambda p: int(p.name))
    servers = [s for s in args.servers if s in ("inferd", "plain") or _python_for(s, args)]
    skipped = {s: "no Python environment given" for s in args.servers if s not in servers}
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    for r in range(args.rounds):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        print(f"round {r + 1}: {' -> '.join(order)}", flush=True)
        for name in order:
            if name in skipped:
                continue
            try:
                with running(name, args, model_dir) as ep:
                    rounds[name].append(measure(name, ep, args, texts))
            except RuntimeError as e:
                skipped[name] = f"{e} (log: {LOGS / f'classic_{name}.log'})"
                print(f"{name}: skipped: {skipped[name]}", flush=True)
    table = {s: summary(runs, args.clients) for s, runs in rounds.items() if runs}
    ceiling = compute_ceiling(model_dir, texts[:512], args.threads)
    print("model alone (ONNX Runtime):", {k: round(v, 2) for k, v in ceiling.items()})
    return {
        "table": table,
        "rounds": rounds,
        "skipped": skipped,
        "model_alone": ceiling,
        "targets": targets(table),
    }


def _python_for(name: str, args: argparse.Namespace) -> Path | None:
    python: Path | None = args.pytriton_python if name == "pytriton" else args.peers_python
    return python


def summary(runs: list[dict[str, Any]], clients: list[int]) -> dict[str, Any]:
    """Per client count: the median over rounds of req/s, p50 and p99; inferd's stages."""
    out: dict[str, Any] = {}
    for c in map(str, clients):
        rs = [run[c] for run in runs]
        row = {
            "rps": statistics.median(r["throughput_rps"] for r in rs),
            "p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rs),
            "p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
            "load_1m": [x for r in rs for x in r["load_1m"]],
        }
        stages = [r["stages_ms"] for r in rs if "stages_ms" in r]
        if stages:
            keys = [*STAGES, "client_latency", "outside"]
            row["stages_ms"] = {k: statistics.median(s[k] for s in stages) for k in keys}
        out[c] = row
    return out


def targets(table: dict[str, Any]) -> dict[str, Any]:
    inferd = table.get("inferd")
    peers = {p: table[p] for p in PEERS if p in table}
    if inferd is None or not peers:
        return {}
    out: dict[str, Any] = {}
    if "1" in inferd:
        p50 = inferd["1"]["p50_ms"]
        if "plain" in table:
            out["p50_1_minus_plain_ms"] = p50 - table["plain"]["1"]["p50_ms"]
        out["p50_1_lowest_peer_ms"] = min(t["1"]["p50_ms"] for t in peers.values())
        out["p50_1_met"] = p50 <= out["p50_1_lowest_peer_ms"] and (
            out.get("p50_1_minus_plain_ms", 0.0) <= TARGET_P50_MS
        )
    for c in ("8", "64"):
        if c not in inferd:
            continue
        best = max(peers, key=lambda p: peers[p][c]["rps"])
        x = inferd[c]["rps"] / peers[best][c]["rps"]
        lowest_p99 = min(t[c]["p99_ms"] for t in peers.values())
        out[c] = {
            "best_peer": best,
            "rps_x_best_peer": x,
            "p99_ms": inferd[c]["p99_ms"],
            "lowest_peer_p99_ms": lowest_p99,
            "met": x >= TARGET_THROUGHPUT_X and inferd[c]["p99_ms"] < lowest_p99,
        }
    return out


def print_table(table: dict[str, Any], clients: list[int]) -> None:
    print(f"\n{'clients':>8} " + " ".join(f"{s:>24}" for s in table))
    for c in map(str, clients):
        cells = [
            f"{t[c]['rps']:7.1f} {t[c]['p50_ms']:6.1f}/{t[c]['p99_ms']:6.1f}"
            for t in table.values()
        ]
        print(f"{c:>8} " + " ".join(f"{x:>24}" for x in cells))
    print("(req/s p50/p99 ms)")


def main(argv: list[str] | None = None) -> int:
    from inferd.examples import ensure_example_repository

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--seconds", type=float, default=8.0, help="per server and client count")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--max-batch-size", type=int, default=64, help="the peers' (inferd: config)")
    p.add_argument("--max-wait-ms", type=float, default=3.0, help="the peers' (inferd: config)")
    p.add_argument("--peers-python", type=Path, default=None, help="LitServe, mosec, Ray Serve")
    p.add_argument("--pytriton-python", type=Path, default=None, help="nvidia-pytriton's env")
    p.add_argument("--repository", type=Path, default=None, help="default: the examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.repository = args.repository or ensure_example_repository()
    result = run(args)
    print_table(result["table"], args.clients)
    print("skipped:", result["skipped"] or "none")
    print("targets:", result["targets"])
    out = args.out or RESULTS_DIR / f"classic_peers_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(
        out, {"command": command_line(), "machine": machine_info(), "args": vars(args), **result}
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
