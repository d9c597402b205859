"""Serving benchmark: a load generator against inferd's OpenAI-compatible HTTP API.

    .venv/bin/python bench/serve.py --launch --offline-baseline --num-requests 64
    .venv/bin/python bench/serve.py --launch --gateway-overhead 200
    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 --request-rate 4

Every request is a streaming `/v1/completions` call with `prompt` as token ids (bench/common.py's
seeded make_workload), `max_tokens` = its output length, `ignore_eos` and
`stream_options.include_usage`, sent over its own aiohttp session (aiohttp as vLLM's client: the
client shares the server's cores, and httpx costs ~0.8 ms more per request). Metrics follow
`vllm bench serve`: TTFT = send -> first chunk with choices; ITL = gaps between later chunks with
choices; E2EL = send -> last chunk with choices; TPOT = (E2EL - TTFT) / (output tokens - 1), output
tokens from `usage`. `--launch` starts `inferd serve` on a free loopback port (`--server-args` are
passed on) and stops it at the end. See docs/benchmarks.md ("Serving") for recorded numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
from common import (
    RESULTS_DIR,
    BenchRequest,
    WorkloadSpec,
    command_line,
    machine_info,
    make_workload,
    workload_stats,
    write_result,
)
from tqdm.auto import tqdm

TARGET_SERVED_OFFLINE = 0.9
TARGET_GATEWAY_P50_MS = 2.0
PERCENTILES = (50, 90, 99)
WARMUP_SEED_OFFSET = 1_000_003
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


@dataclass
class RequestResult:
    """One streamed request as the client saw it; times in seconds from the run's start."""

    prompt_len: int
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    # Arrival time (run clock) of every chunk with choices, for tokens/s over time.
    chunk_times: list[float] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# -- one request ------------------------------------------------------------------------------


def completion_body(req: BenchRequest, model: str | None, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    return body


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one `data: {...}` line; None for blank lines, comments and `[DONE]`."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    data = json.loads(payload)
    return data if isinstance(data, dict) else None


def record_chunk(res: RequestResult, chunk: dict[str, Any], now: float) -> None:
    """Updates `res` with one chunk; `now` is seconds since the request was sent."""
    if "error" in chunk:
        raise RuntimeError(json.dumps(chunk["error"]))
    if chunk.get("choices"):
        if res.chunk_times:
            res.itl.append(now - res.e2el)
        else:
            res.ttft = now
        res.e2el = now
        res.chunk_times.append(res.start + now)
    if chunk.get("usage"):
        res.output_tokens = int(chunk["usage"]["completion_tokens"])
    if chunk.get("timings"):
        res.timings = dict(chunk["timings"])


async def send_request(
    url: str, body: dict[str, Any], run_start: float, timeout_s: float
) -> RequestResult:
    """One streaming request on its own connection (aiohttp, as `vllm bench serve`: its
    per-request cost is a fraction of httpx's, and the client shares the server's cores)."""
    res = RequestResult(prompt_len=len(body["prompt"]))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sent = time.perf_counter()
        res.start = sent - run_start
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")
                await read_events(resp, res, sent)
            res.success = bool(res.chunk_times) and res.output_tokens > 0
            res.error = "" if res.success else "no tokens or no usage chunk"
        except (aiohttp.ClientError, TimeoutError, RuntimeError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
    return res


async def read_events(resp: aiohttp.ClientResponse, res: RequestResult, sent: float) -> None:
    """Feeds every SSE event of `resp` to `res`; events that came in one network read share
    the time those bytes arrived (an event ends with a blank line)."""
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter() - sent
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            for line in event.decode().splitlines():
                chunk = parse_sse_line(line)
                if chunk is not None:
                    record_chunk(res, chunk, now)


# -- arrivals ---------------------------------------------------------------------------------


def arrival_gaps(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals (exponential gaps) or all at once."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps: list[float] = rng.exponential(1.0 / request_rate, size=n).tolist()
    return gaps


async def run_load(
    url: str, bodies: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[RequestResult], float, float]:
    """Sends every body on the arrival schedule; returns results (in workload order), wall
    seconds and the client's own CPU seconds (it shares the machine with the server)."""
    limit = args.max_concurrency or len(bodies)
    sem = asyncio.Semaphore(limit)
    bar = tqdm(total=len(bodies), desc="requests", disable=args.no_progress)
    run_start = time.perf_counter()
    cpu_start = time.process_time()

    async def one(body: dict[str, Any]) -> RequestResult:
        async with sem:
            res = await send_request(url, body, run_start, args.request_timeout)
        bar.update(1)
        return res

    tasks = []
    gaps = arrival_gaps(len(bodies), args.request_rate, args.seed)
    for body, gap in zip(bodies, gaps, strict=True):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(body)))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - run_start
    bar.close()
    return list(results), wall, time.process_time() - cpu_start


# -- metrics ----------------------------------------------------------------------------------


def distribution_ms(values: list[float]) -> dict[str, float]:
    """mean, std, p50/p90/p99 of seconds, in milliseconds; NaN when there is nothing."""
    if not values:
        return {"mean": math.nan, "std": math.nan} | {f"p{p}": math.nan for p in PERCENTILES}
    arr = np.asarray(values) * 1000.0
    out = {"mean": float(arr.mean()), "std": float(arr.std())}
    return out | {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:10000` -> SLOs in milliseconds (vLLM's --goodput syntax)."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def meets_slos(res: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": res.ttft, "tpot": res.tpot or 0.0, "e2el": res.e2el}
    return all(values[name] * 1000.0 <= ms for name, ms in slos.items())


def summarize(results: list[RequestResult], wall: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "duration_s": wall,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / wall,
        "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2el_ms": distribution_ms([r.e2el for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        summary["goodput"] = {
            "slos_ms": slos,
            "good_requests": good,
            "request_goodput": good / wall,
        }
    return summary


def tokens_per_second_series(results: list[RequestResult], wall: float) -> list[float]:
    """Output tokens per 1 s bucket of the run; a request's tokens are spread evenly over its
    chunks (a chunk may carry more than one token)."""
    buckets = np.zeros(max(1, math.ceil(wall)))
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            buckets[min(int(t), len(buckets) - 1)] += per_chunk
    return buckets.tolist()


# -- gateway overhead -------------------------------------------------------------------------


ENGINE_STAGES = ("queue", "prefill", "decode")


async def gateway_overhead(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """N sequential 1-token non-streaming requests on one keep-alive client: client-measured E2E
    minus the engine's own time (`timings`: queue + prefill + decode)."""
    spec = WorkloadSpec(
        num_requests=args.gateway_overhead,
        vocab_size=args.vocab_size,
        seed=args.seed + 1,
        min_prompt_len=16,
        max_prompt_len=16,
        min_output_len=1,
        max_output_len=1,
    )
    client_ms, server_ms, engine_ms = [], [], []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as client:
        for req in tqdm(make_workload(spec), desc="gateway", disable=args.no_progress):
            body = completion_body(req, args.served_model, args.temperature) | {"stream": False}
            del body["stream_options"]
            data = json.dumps(body).encode()
            t0 = time.perf_counter()
            async with client.post(url, data=data) as resp:
                raw = await resp.read()
            client_ms.append((time.perf_counter() - t0) * 1000.0)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
            timings = json.loads(raw)["timings"]
            engine_ms.append(sum(timings.get(s, 0.0) for s in ENGINE_STAGES) * 1000.0)
            server_ms.append(timings.get("e2e", math.nan) * 1000.0)
    overhead = np.asarray(client_ms) - np.asarray(engine_ms)
    return {
        "requests": args.gateway_overhead,
        "engine_stages": list(ENGINE_STAGES),
        "client_e2e_ms_p50": float(np.median(client_ms)),
        "engine_ms_p50": float(np.median(engine_ms)),
        "server_e2e_ms_p50": float(np.nanmedian(server_ms)),
        "overhead_ms": {
            "p50": float(np.percentile(overhead, 50)),
            "p90": float(np.percentile(overhead, 90)),
            "p99": float(np.percentile(overhead, 99)),
            "mean": float(overhead.mean()),
        },
        "target_p50_ms": TARGET_GATEWAY_P50_MS,
    }


# -- offline baseline -------------------------------------------------------------------------


def engine_kwargs_from(server_args: list[str]) -> dict[str, Any]:
    """The engine flags among `server_args`, parsed by `inferd serve`'s own parser."""
    from inferd.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    known, _ = parser.parse_known_args(server_args)
    return engine_kwargs(known)


def run_offline(
    requests: list[BenchRequest], warmup: list[BenchRequest], args: argparse.Namespace
) -> dict[str, Any]:
    from inferd import LLM, SamplingParams

    def inputs(reqs: list[BenchRequest]) -> tuple[list[Any], list[SamplingParams]]:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=args.temperature)
            for r in reqs
        ]
        return prompts, params

    kwargs = engine_kwargs_from(args.server_args)
    llm = LLM(**kwargs)
    llm.generate(*inputs(warmup), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(*inputs(requests), use_tqdm=not args.no_progress)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    gc.collect()
    return {
        "engine_kwargs": kwargs,
        "duration_s": wall,
        "output_tokens": tokens,
        "output_throughput": tokens / wall,
    }


# -- server launch ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launched:
    url: str
    pid: int


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds) of every process, from /proc; empty where
    /proc is not available."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


def process_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of `pid` ("front") and of its child processes ("children", the engine core);
    empty where /proc is not available."""
    table = proc_table()
    if pid not in table:
        return {}
    children = sum(cpu for p, (ppid, cpu) in table.items() if ppid == pid and p != pid)
    return {"front": table[pid][1], "children": children}


@contextmanager
def launched_server(
    server_args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[Launched]:
    """`inferd serve` on a free loopback port until the block ends; yields its URL and pid.
    `env`: the server's environment (default: this process's)."""
    port = free_port()
    exe = Path(sys.executable).parent / "inferd"
    cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), *server_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"launching: {shlex.join(cmd)} (log: {log_path})")
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/health/ready", proc)
            yield Launched(base, proc.pid)
        finally:
            stop_server(proc)


def wait_ready(
    health_url: str, proc: subprocess.Popen[bytes], timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Polls the server's health route until it answers 200; fails if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before ready")
        try:
            if httpx.get(health_url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- report -----------------------------------------------------------------------------------


def print_summary(s: dict[str, Any]) -> None:
    print(f"\n{'successful requests':<28}{s['completed']:>12}   failed {s['failed']}")
    print(f"{'duration (s)':<28}{s['duration_s']:>12.2f}")
    print(f"{'request throughput (req/s)':<28}{s['request_throughput']:>12.2f}")
    print(f"{'output throughput (tok/s)':<28}{s['output_throughput']:>12.1f}")
    print(f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:>12.1f}")
    if "goodput" in s:
        print(f"{'request goodput (req/s)':<28}{s['goodput']['request_goodput']:>12.2f}")
    print(f"\n{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        d = s[f"{name}_ms"]
        print(
            f"{name.upper():<6}" + "".join(f"{d[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    for err in s["errors"]:
        print(f"error: {err}")


def write_plot(path: Path, results: list[RequestResult], series: list[float]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return False
    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r.ttft * 1000 for r in ok], bins=30)
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[1].hist([g * 1000 for r in ok for g in r.itl], bins=50)
    axes[1].set(title="ITL", xlabel="ms", ylabel="gaps")
    axes[2].step(range(len(series)), series, where="post")
    axes[2].set(title="output tokens/s (1 s buckets)", xlabel="s since start", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------


def workload(args: argparse.Namespace, seed: int, n: int) -> list[BenchRequest]:
    spec = WorkloadSpec(
        num_requests=n,
        vocab_size=args.vocab_size,
        seed=seed,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
    )
    return make_workload(spec)


async def bench_server(
    base: str,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    args: argparse.Namespace,
    pid: int | None = None,
) -> dict[str, Any]:
    url = f"{base}/v1/completions"
    result: dict[str, Any] = {}
    if args.num_requests > 0:
        bodies = [completion_body(r, args.served_model, args.temperature) for r in warmup]
        await asyncio.gather(*(send_request(url, b, time.perf_counter(), 60.0) for b in bodies))
        bodies = [completion_body(r, args.served_model, args.temperature) for r in requests]
        before = process_cpu_seconds(pid) if pid is not None else {}
        results, wall, cpu = await run_load(url, bodies, args)
        after = process_cpu_seconds(pid) if pid is not None else {}
        result |= {"results": results, "wall": wall, "client_cpu_s": cpu}
        if before and after:
            result["server_cpu_s"] = {k: after[k] - before[k] for k in before}
    if args.gateway_overhead > 0:
        result["gateway_overhead"] = await gateway_overhead(url, args)
    return result


def serve_phase(
    requests: list[BenchRequest], warmup: list[BenchRequest], args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    if not args.launch:
        return asyncio.run(bench_server(args.base_url, requests, warmup, args))
    with launched_server(args.server_args, log) as server:
        return asyncio.run(bench_server(server.url, requests, warmup, args, server.pid))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slos = parse_goodput(args.goodput)
    out = args.out or RESULTS_DIR / f"serve_{time.strftime('%Y%m%d-%H%M%S')}.json"
    n = max(args.num_requests, 1)
    requests = workload(args, args.seed, n)
    warmup = workload(args, args.seed + WARMUP_SEED_OFFSET, 2)
    result: dict[str, Any] = {
        "command": command_line(),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": workload_stats(requests) | {"num_requests": args.num_requests},
    }
    if args.offline_baseline and args.num_requests > 0:
        result["offline"] = run_offline(requests, warmup, args)
    served = serve_phase(requests, warmup, args, out.with_suffix(".server.log"))
    report_served(served, result, slos, out)
    write_result(out, result)
    print(f"\nresult: {out}")
    return 0 if not result.get("serving", {}).get("failed") else 1


def report_served(
    served: dict[str, Any], result: dict[str, Any], slos: dict[str, float], out: Path
) -> None:
    if "results" in served:
        results, wall = served["results"], served["wall"]
        summary = summarize(results, wall, slos)
        series = tokens_per_second_series(results, wall)
        result["serving"] = summary | {"output_tokens_per_second_1s": series}
        result["serving"]["client_cpu_s"] = served.get("client_cpu_s")
        result["requests"] = [asdict(r) | {"chunk_times": len(r.chunk_times)} for r in results]
        print_summary(summary)
        server_cpu = served.get("server_cpu_s", {})
        result["serving"]["server_cpu_s"] = server_cpu
        print(
            f"CPU over {wall:.1f} s: client {served.get('client_cpu_s', 0.0):.1f} s, server front "
            f"{server_cpu.get('front', math.nan):.1f} s, engine core "
            f"{server_cpu.get('children', math.nan):.1f} s"
        )
        if write_plot(out.with_suffix(".png"), results, series):
            result["plot"] = str(out.with_suffix(".png"))
        if "offline" in result:
            ratio = summary["output_throughput"] / result["offline"]["output_throughput"]
            result["served_offline_ratio"] = ratio
            off = result["offline"]["output_throughput"]
            print(f"offline {off:.1f} tok/s; served / offline = {ratio:.3f} (target >= 0.9)")
    if "gateway_overhead" in served:
        g = served["gateway_overhead"]
        result["gateway_overhead"] = g
        print(
            f"gateway overhead over {g['requests']} 1-token requests: p50 "
            f"{g['overhead_ms']['p50']:.2f} ms (client {g['client_e2e_ms_p50']:.2f} ms, engine "
            f"{g['engine_ms_p50']:.2f} ms; target <= {TARGET_GATEWAY_P50_MS} ms)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server without --launch")
    p.add_argument("--launch", action="store_true", help="start `inferd serve` for the run")
    p.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="extra `inferd serve` flags (one quoted string); engine flags also drive the offline "
        "baseline",
    )
    p.add_argument("--served-model", default=None, help="`model` field of each request")
    p.add_argument("--num-requests", type=int, default=64, help="0: skip the load run")
    p.add_argument("--vocab-size", type=int, default=4096, help="token ids drawn below this")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson) or inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=600.0, help="client timeout, s")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--offline-baseline", action="store_true", help="also run inferd.LLM offline")
    p.add_argument("--gateway-overhead", type=int, default=0, metavar="N")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
