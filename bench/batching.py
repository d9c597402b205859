"""Dynamic batching benchmark: MiniLM embeddings over HTTP, batching on vs off vs a plain API.

    .venv/bin/python bench/batching.py                      # 1, 8, 32, 64 clients, 10 s each
    .venv/bin/python bench/batching.py --clients 64 --seconds 5

One run, one machine, three targets on the same model file, tokenizer and thread count:
- `batched`: inferd's `minilm` from the example repository (dynamic batching on),
- `unbatched`: the same model with no `dynamic_batching` section (each request runs alone),
- `plain`: bench/plain_embed_server.py, a FastAPI endpoint calling ONNX Runtime per request.
Both inferd targets are served by one `inferd serve --model-repository` process (launched here on
a free loopback port) through `POST /v1/embeddings`; the plain server answers `POST /embed`.
Closed loop: each client sends one sentence (seeded, 8-40 words), waits for the answer, sends the
next. Reported per target and client count: requests/s and latency p50/p90/p99, plus, for the
batched target, the batch sizes and the per-request stage times the server returned (`timings`).
Targets (issue 4): batched >= 4x unbatched at 64 clients; batched p99 at 8 clients <=
max_queue_delay_ms + 2 x one batch's compute time (compute_input + infer + compute_output);
batched >= 1.5x plain at 64 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson
import yaml
from common import RESULTS_DIR, command_line, machine_info, write_result
from serve import free_port, launched_server

TARGET_BATCHING_X = 4.0
TARGET_PLAIN_X = 1.5
MODEL = "minilm"
UNBATCHED = "minilm_unbatched"
_VOCAB = (
    "the a quick brown fox jumps over lazy dog model server batch latency token embedding vector "
    "cloud data request queue python fast slow river mountain city night morning coffee music "
    "learning network inference memory compute thread kernel cache engine search query answer"
)
WORDS = _VOCAB.split(" ")
STAGES = ("queue", "batch", "compute_input", "infer", "compute_output", "preprocess", "postprocess")


def report_line(name: str, clients: int, r: dict[str, Any]) -> None:
    lat = r["latency_ms"]
    print(
        f"{name:>10} clients={clients:<3} {r['throughput_rps']:8.1f} req/s  "
        f"p50 {lat['p50']:7.1f} ms  p99 {lat['p99']:7.1f} ms  errors {r['errors']}"
    )


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 41)))) for _ in range(n)]


def bench_repository(examples: Path, into: Path) -> tuple[Path, float]:
    """A repository with the example `minilm` twice: batched (as shipped) and unbatched."""
    src = examples / MODEL
    config = yaml.safe_load((src / "config.yaml").read_text())
    delay_ms = float(config["dynamic_batching"]["max_queue_delay_ms"])
    (into / MODEL).symlink_to(src, target_is_directory=True)
    plain = into / UNBATCHED
    plain.mkdir()
    for entry in src.iterdir():
        if entry.name != "config.yaml":
            (plain / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    config.pop("dynamic_batching")
    config["name"] = UNBATCHED
    (plain / "config.yaml").write_text(yaml.safe_dump(config))
    return into, delay_ms


def payload(body: dict[str, Any] | tuple[bytes, dict[str, str]]) -> tuple[bytes, dict[str, str]]:
    """A request body maker's answer as (bytes, headers): a dict goes as JSON, a (bytes,
    headers) pair as it is (binary bodies: KServe's binary tensor extension)."""
    if isinstance(body, tuple):
        return body
    return orjson.dumps(body), {"content-type": "application/json"}


async def closed_loop(
    url: str, make_body: Any, texts: list[Any], clients: int, seconds: float
) -> dict[str, Any]:
    """`clients` loops of send -> wait -> send again for `seconds`, on aiohttp (httpx's pool
    costs O(connections) per request: at 64 clients it took a core from the server).
    `make_body(texts[k])`: a JSON dict, or (bytes, headers) (see `payload`)."""
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors = 0
    stop_at = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=clients)

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal errors
        k = i
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            data, headers = payload(make_body(texts[k % len(texts)]))
            async with http.post(url, data=data, headers=headers) as r:
                body = await r.read()
                status = r.status
            latencies.append(time.perf_counter() - t0)
            k += clients
            if status != 200:
                errors += 1
                continue
            answer = orjson.loads(body)  # timings: OpenAI's top level, KServe's parameters
            t = answer.get("timings") or answer.get("parameters", {}).get("timings")
            if t:
                timings.append(t | {"client_latency": latencies[-1]})

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        data, headers = payload(make_body(texts[0]))
        async with http.post(url, data=data, headers=headers) as r:
            await r.read()  # warm the connection and the model
        cpu0, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return summarize(latencies, timings, errors, wall) | {"client_cpu_s": cpu}


def summarize(
    latencies: list[float], timings: list[dict[str, float]], errors: int, wall: float
) -> dict[str, Any]:
    lat = np.array(latencies) * 1e3
    out: dict[str, Any] = {
        "requests": len(latencies),
        "errors": errors,
        "wall_s": wall,
        "throughput_rps": len(latencies) / wall,
        "latency_ms": {f"p{p}": float(np.percentile(lat, p)) for p in (50, 90, 99)},
    }
    out["latency_ms"]["mean"] = float(lat.mean())
    if timings:
        out["stages_ms"] = mean_stages_ms(timings)
        # Where the slowest requests' time went: the 2% slowest, stage by stage, and the rest
        # (HTTP, JSON, the client) as `outside`.
        cut = np.percentile([t["client_latency"] for t in timings], 98)
        out["slowest_2pct_stages_ms"] = mean_stages_ms(
            [t for t in timings if t["client_latency"] >= cut]
        )
    return out


def mean_stages_ms(timings: list[dict[str, float]]) -> dict[str, float]:
    out = {s: float(np.mean([t.get(s, 0.0) for t in timings]) * 1e3) for s in STAGES}
    inside = np.mean([sum(t.get(s, 0.0) for s in STAGES) for t in timings]) * 1e3
    out["client_latency"] = float(np.mean([t["client_latency"] for t in timings]) * 1e3)
    out["outside"] = out["client_latency"] - float(inside)
    return out


@contextlib.contextmanager
def plain_server(model_dir: Path, threads: int, log: Path) -> Iterator[str]:
    port = free_port()
    script = Path(__file__).parent / "plain_embed_server.py"
    cmd = [sys.executable, str(script), "--model-dir", str(model_dir), "--port", str(port)]
    cmd += ["--threads", str(threads)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"plain server exited ({proc.returncode}); see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            proc.wait(30)


def sentence_calls(
    model_dir: Path, texts: list[str], threads: int, spinning: bool = True
) -> tuple[list[list[int]], Callable[[list[list[int]]], None]]:
    """The MiniLM example alone: `texts` tokenized as the server does (no padding, at most 256
    tokens), and `run(rows)`, one ONNX Runtime call on the rows padded to the longest.
    `spinning`: ONNX Runtime's default threads, else threads that do not spin between ops (the
    server's batch session)."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), opts)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()  # its tokenizer.json pads to 128; the calls pad themselves
    tok.enable_truncation(256)

    def run(rows: list[list[int]]) -> None:
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        sess.run(None, {"input_ids": ids, "attention_mask": mask})

    return [e.ids for e in tok.encode_batch(texts)], run


def compute_ceiling(model_dir: Path, texts: list[str], threads: int) -> dict[str, float]:
    """What batching can gain on this machine at best: the model alone (ONNX Runtime, no server,
    no client), the same sentences run one at a time vs in batches of 64 sorted by length (the
    least padding possible). Serving cannot beat the ratio of the two rates."""
    encoded, run = sentence_calls(model_dir, texts, threads)
    run(encoded[:8])  # warm up
    t0 = time.perf_counter()
    for r in encoded:
        run([r])
    single = len(encoded) / (time.perf_counter() - t0)
    ordered = sorted(encoded, key=len)
    t0 = time.perf_counter()
    for i in range(0, len(ordered), 64):
        run(ordered[i : i + 64])
    batched = len(encoded) / (time.perf_counter() - t0)
    return {"single_rps": single, "batched_64_rps": batched, "ratio": batched / single}


def batch_sizes(base: str) -> dict[str, float]:
    """Mean executed batch size per model from /metrics (inferd_model_batch_rows histogram)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("inferd_model_batch_rows" + suffix):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                into[model] = float(line.rsplit(" ", 1)[1])
    return {m: sums[m] / counts[m] for m in sums if counts.get(m)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from inferd.examples import ensure_example_repository

    examples = ensure_example_repository()
    texts = sentences(4096, args.seed)
    results: dict[str, Any] = {"batched": {}, "unbatched": {}, "plain": {}}
    with tempfile.TemporaryDirectory() as tmp:
        repo, delay_ms = bench_repository(examples, Path(tmp))
        server_args = ["--model-repository", str(repo), "--grpc-port", "-1"]
        server_args += ["--disable-access-log", *args.server_args]
        log_dir = RESULTS_DIR / "logs"
        with launched_server(server_args, log_dir / "batching_inferd.log") as server:
            base = server.url
            for name, model in (("batched", MODEL), ("unbatched", UNBATCHED)):
                url = f"{base}/v1/embeddings"

                def body(text: str, model: str = model) -> dict[str, Any]:
                    return {"model": model, "input": text}

                for c in args.clients:
                    r = asyncio.run(closed_loop(url, body, texts, c, args.seconds))
                    results[name][str(c)] = r
                    report_line(name, c, r)
            results["mean_batch_rows"] = batch_sizes(base)
        model_dir = max((examples / MODEL).glob("[0-9]*"), key=lambda p: int(p.name))
        results["compute_ceiling"] = compute_ceiling(model_dir, texts[:512], args.threads)
        print(
            "model alone (ONNX Runtime):",
            {k: round(v, 2) for k, v in results["compute_ceiling"].items()},
        )
        with plain_server(model_dir, args.threads, log_dir / "batching_plain.log") as base:
            for c in args.clients:
                r = asyncio.run(
                    closed_loop(f"{base}/embed", lambda t: {"input": t}, texts, c, args.seconds)
                )
                results["plain"][str(c)] = r
                report_line("plain", c, r)
    results["targets"] = targets(results, delay_ms)
    return results


def targets(results: dict[str, Any], delay_ms: float) -> dict[str, Any]:
    out: dict[str, Any] = {"max_queue_delay_ms": delay_ms}
    b, u, p = results["batched"], results["unbatched"], results["plain"]
    if "64" in b and "64" in u:
        out["batched_over_unbatched_64"] = b["64"]["throughput_rps"] / u["64"]["throughput_rps"]
    if "64" in b and "64" in p:
        out["batched_over_plain_64"] = b["64"]["throughput_rps"] / p["64"]["throughput_rps"]
    eight = b.get("8")
    if eight and "stages_ms" in eight:
        st = eight["stages_ms"]
        compute = st["compute_input"] + st["infer"] + st["compute_output"]
        out["p99_8_ms"] = eight["latency_ms"]["p99"]
        out["p99_8_bound_ms"] = delay_ms + 2 * compute
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--seconds", type=float, default=10.0, help="per target and client count")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (plain server)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = run(args)
    t = results["targets"]
    print("\ntargets:", {k: round(v, 2) for k, v in t.items()})
    out = args.out or RESULTS_DIR / f"batching_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_result(
        out,
        {"command": command_line(), "machine": machine_info(), "args": vars(args), **results},
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
