"""Classic models beside the Python serving frameworks: the example repository's MiniLM
embeddings and image classifier from inferd, a plain FastAPI endpoint, LitServe, mosec, Ray
Serve and Triton (PyTriton), each alone, in one run.

    .venv/bin/python bench/classic_peers.py --peers-python /work/bench-peers-venv/bin/python \\
        --pytriton-python /work/bench-pytriton310-venv/bin/python [--models minilm image]

The workloads a platform engineer would try, each model as the example repository ships it
(`--model-repository examples`) and every server given the same settings from its config.yaml:
- `minilm` (all-MiniLM-L6-v2: the ONNX file and tokenizer; 2 intra-op threads, batches of up to
  64, a 3 ms maximum wait): each client sends one seeded 8-40-word sentence;
- `image` (the shapes CNN: PNG -> 32x32 -> 4 probabilities; 1 intra-op thread, batches of up to
  32, 2 ms): each client sends one seeded 64x64 PNG (inferd and Triton: BYTES in KServe's binary
  tensor extension; the others: base64 in JSON).
Closed-loop aiohttp clients at 1, 8 and 64: send one, wait for the answer, send the next.
Servers:
- `inferd`: `inferd serve --model-repository <examples>`, the Open Inference Protocol's
  `POST /v2/models/{model}/infer`;
- `plain` (minilm only): bench/plain_embed_server.py, a sync FastAPI endpoint calling the
  session per request;
- `litserve`, `mosec`, `ray` (`@serve.batch`), `pytriton`: bench/classic_peer_servers.py run by
  `--peers-python` / `--pytriton-python` (their own environments: none is a dependency of
  inferd). A peer whose Python is not given, or that does not start, is reported as skipped.
- `baseline` (with `--baseline-tree DIR`): inferd again, from another checkout (its PYTHONPATH
  set to DIR), for an A/B of two versions in the same run; reported beside the others, left out
  of the targets.
Only one server runs at a time (started, measured at every client count, stopped); `--rounds`
rounds, the order rotated each round, so a slow spell of the machine hits every server. Reported
per model, server and client count: the median over rounds of requests/s, p50 and p99, the
1-minute load average around each measurement, and inferd's own stage times. Plus the model
alone (ONNX Runtime in this process: one input at a time vs batches of the largest size). JSON
to bench/results/. Targets (issue 44): at 1 client inferd's p50 within 1 ms of plain's and no
peer's lower; at 8 and 64 clients >= 1.3x the best peer's requests/s with a lower p99 than every
peer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import signal
import statistics
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import yaml
from batching import STAGES, closed_loop, compute_ceiling, payload, plain_server, sentences
from common import RESULTS_DIR, command_line, machine_info, write_result
from serve import free_port, launched_server

MODELS = ("minilm", "image")
PEERS = ("litserve", "mosec", "ray", "pytriton")
SERVERS = ("inferd", "baseline", "plain", *PEERS)
TARGET_THROUGHPUT_X = 1.3
TARGET_P50_MS = 1.0
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
NUM_IMAGES = 256
LOGS = RESULTS_DIR / "logs"

Body = Callable[[Any], dict[str, Any] | tuple[bytes, dict[str, str]]]


@dataclass(frozen=True)
class Workload:
    """One example model, with the settings every server gets from its config.yaml."""

    model: str
    model_dir: Path  # the newest version folder
    threads: int  # ONNX Runtime intra-op threads
    max_batch_size: int
    max_wait_ms: float
    items: list[Any]  # what the clients send: sentences, or PNG bytes


def workload(model: str, repository: Path, seed: int) -> Workload:
    config = yaml.safe_load((repository / model / "config.yaml").read_text())
    model_dir = max((repository / model).glob("[0-9]*"), key=lambda p: int(p.name))
    items: list[Any] = sentences(4096, seed) if model == "minilm" else pngs(NUM_IMAGES, seed)
    return Workload(
        model,
        model_dir,
        int(config["parameters"]["intra_op_threads"]),
        int(config["max_batch_size"]),
        float(config["dynamic_batching"]["max_queue_delay_ms"]),
        items,
    )


def pngs(n: int, seed: int) -> list[bytes]:
    """Seeded 64x64 pictures of the example's four shapes, PNG-encoded."""
    from inferd.examples.image import SHAPES, draw_shape

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        draw_shape(SHAPES[i % len(SHAPES)], rng).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def oip_body(text: str) -> dict[str, Any]:
    """The Open Inference Protocol request of one sentence (inferd and Triton)."""
    return {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}


def oip_image_body(image: bytes) -> tuple[bytes, dict[str, str]]:
    """One image as BYTES [1, 1] in the binary tensor extension: a 4-byte length, the bytes."""
    size = 4 + len(image)
    tensor = {"name": "image", "shape": [1, 1], "datatype": "BYTES"}
    header = orjson.dumps({"inputs": [tensor | {"parameters": {"binary_data_size": size}}]})
    headers = {
        "content-type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + struct.pack("<I", len(image)) + image, headers


def plain_body(text: str) -> dict[str, Any]:
    return {"input": text}


def plain_image_body(image: bytes) -> dict[str, Any]:
    import base64

    return {"image": base64.b64encode(image).decode()}


@dataclass(frozen=True)
class Endpoint:
    url: str
    body: Body


def endpoint(name: str, base: str, model: str) -> Endpoint:
    image = model == "image"
    if name in ("inferd", "pytriton"):
        return Endpoint(f"{base}/v2/models/{model}/infer", oip_image_body if image else oip_body)
    path = "inference" if name == "mosec" else "embed"
    return Endpoint(f"{base}/{path}", plain_image_body if image else plain_body)


@contextlib.contextmanager
def running(name: str, args: argparse.Namespace, work: Workload) -> Iterator[Endpoint]:
    """One server, started and ready, until the block ends."""
    if name in ("inferd", "baseline"):
        server_args = ["--model-repository", str(args.repository), "--grpc-port", "-1"]
        env = None
        if name == "baseline":
            env = os.environ | {"PYTHONPATH": str(args.baseline_tree.resolve())}
        with launched_server(
            [*server_args, "--disable-access-log"], LOGS / f"classic_{name}.log", env
        ) as s:
            yield endpoint("inferd", s.url, work.model)
    elif name == "plain":
        with plain_server(work.model_dir, work.threads, LOGS / "classic_plain.log") as base:
            yield endpoint(name, base, work.model)
    else:
        with peer(name, args, work) as base:
            yield endpoint(name, base, work.model)


@contextlib.contextmanager
def peer(name: str, args: argparse.Namespace, work: Workload) -> Iterator[str]:
    python = args.pytriton_python if name == "pytriton" else args.peers_python
    port = free_port() if name != "pytriton" else _three_free_ports()
    script = Path(__file__).parent / "classic_peer_servers.py"
    cmd = [str(python), str(script), name, "--model", work.model, "--port", str(port)]
    cmd += ["--model-dir", str(work.model_dir), "--threads", str(work.threads)]
    cmd += ["--max-batch-size", str(work.max_batch_size), "--max-wait-ms", str(work.max_wait_ms)]
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / f"classic_{name}.log").open("w") as log:
        # A session of its own: the peers start worker processes, stopped with it as a group.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_answering(endpoint(name, base, work.model), proc, work.items[0])
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


def _wait_answering(ep: Endpoint, proc: subprocess.Popen[bytes], item: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    data, headers = payload(ep.body(item))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before answering")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(ep.url, content=data, headers=headers, timeout=10).status_code == 200:
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


def measure(name: str, ep: Endpoint, args: argparse.Namespace, items: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clients in args.clients:
        load = os.getloadavg()[0]
        r = asyncio.run(closed_loop(ep.url, ep.body, items, clients, args.seconds))
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


def run(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """Every server on one model: `--rounds` rounds in rotated order, then the model alone."""
    servers = [s for s in args.servers if _runnable(s, args)]
    skipped = {
        s: "no Python environment given"
        for s in args.servers
        if s not in servers and s != "baseline"  # no --baseline-tree: no A/B asked for
    }
    if work.model != "minilm" and "plain" in servers:
        servers.remove("plain")
        skipped["plain"] = "bench/plain_embed_server.py serves embeddings only"
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    for r in range(args.rounds):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        print(f"{work.model} round {r + 1}: {' -> '.join(order)}", flush=True)
        for name in order:
            if name in skipped:
                continue
            try:
                with running(name, args, work) as ep:
                    rounds[name].append(measure(name, ep, args, work.items))
            except RuntimeError as e:
                skipped[name] = f"{e} (log: {LOGS / f'classic_{name}.log'})"
                print(f"{name}: skipped: {skipped[name]}", flush=True)
    table = {s: summary(runs, args.clients) for s, runs in rounds.items() if runs}
    ceiling = model_alone(work)
    print(f"{work.model} alone (ONNX Runtime):", {k: round(v, 2) for k, v in ceiling.items()})
    return {
        "settings": {k: str(v) for k, v in vars(work).items() if k != "items"},
        "table": table,
        "rounds": rounds,
        "skipped": skipped,
        "model_alone": ceiling,
        "targets": targets(table),
    }


def model_alone(work: Workload) -> dict[str, float]:
    """The model's own rate in this process: one input at a time vs batches of the largest
    size (MiniLM: bench/batching.py's, tokenizing left out; images: decoded beforehand)."""
    if work.model == "minilm":
        return compute_ceiling(work.model_dir, work.items[:512], work.threads)
    from classic_peer_servers import ImageClassifier

    classifier = ImageClassifier(work.model_dir, work.threads)
    pixels = np.stack([classifier.pixels(b) for b in work.items])

    def rate(size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(pixels), size):
            classifier.session.run(None, {"input": pixels[i : i + size]})
        return len(pixels) / (time.perf_counter() - start)

    rate(work.max_batch_size)  # warm up
    single, batched = rate(1), rate(work.max_batch_size)
    return {
        "single_rps": single,
        f"batched_{work.max_batch_size}_rps": batched,
        "ratio": batched / single,
    }


def _runnable(name: str, args: argparse.Namespace) -> bool:
    if name == "baseline":
        return args.baseline_tree is not None
    return name in ("inferd", "plain") or _python_for(name, args) is not None


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


def ab_ratios(table: dict[str, Any], clients: list[int]) -> dict[str, dict[str, float]]:
    """Per client count: inferd's requests/s over the baseline's, and each one's p50."""
    a, b = table["inferd"], table["baseline"]
    return {
        str(c): {
            "rps_x": round(a[str(c)]["rps"] / b[str(c)]["rps"], 3),
            "p50_ms": round(a[str(c)]["p50_ms"], 2),
            "baseline_p50_ms": round(b[str(c)]["p50_ms"], 2),
        }
        for c in clients
    }


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
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--peers-python", type=Path, default=None, help="LitServe, mosec, Ray Serve")
    p.add_argument("--pytriton-python", type=Path, default=None, help="nvidia-pytriton's env")
    p.add_argument("--repository", type=Path, default=None, help="default: the examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--baseline-tree", type=Path, default=None, help="inferd from this checkout too (A/B)"
    )
    args = p.parse_args(argv)
    args.repository = args.repository or ensure_example_repository()
    results = {m: run(args, workload(m, args.repository, args.seed)) for m in args.models}
    for model, result in results.items():
        print(f"\n{model}")
        print_table(result["table"], args.clients)
        print("skipped:", result["skipped"] or "none")
        print("targets:", result["targets"])
        if "baseline" in result["table"] and "inferd" in result["table"]:
            print("inferd / baseline:", ab_ratios(result["table"], args.clients))
    out = args.out or RESULTS_DIR / f"classic_peers_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(
        out,
        {"command": command_line(), "machine": machine_info(), "args": vars(args), **results},
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
