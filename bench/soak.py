"""Soak: mixed load for a fixed time against a server this script launches on 127.0.0.1.

    .venv/bin/python bench/soak.py --duration 180            # the full run (docs/benchmarks.md)
    .venv/bin/python bench/soak.py --duration 60 --clients 6 # what CI runs (tests/e2e/test_soak.py)

The server serves inferd-tiny (OpenAI API, SSE, WebSocket) and the example repository's `fraud`
model (KServe v2 over HTTP and gRPC), behind an admin API key, with a read timeout and a body
bound. `--clients` loops each pick a scenario per request (seeded): completions and chat, streamed
and not; streams the client drops after two chunks; WebSocket streams, some cancelled; KServe
HTTP and gRPC inference, unary and streamed; malformed requests of every protocol. Partway
through, the `fraud` model is unloaded and loaded again through the repository API.

Every request ends in exactly one outcome: `answered` (2xx / OK), `rejected` (the 4xx, 429 or 503
its scenario allows: malformed input, the model being reloaded, a full queue), `cancelled` (the
client left on purpose) or `unexpected` (a 5xx, a status the scenario does not allow, a transport
error, or no answer within --request-timeout). Afterwards, with the server idle, the checks:

- 0 unexpected outcomes;
- the server accounts for every admitted LLM request (`inferd_requests_finished_total` grew by
  exactly the answered + cancelled LLM requests) and every answered classic one
  (`inferd_model_requests_total{outcome="success"}`);
- nothing leaked: no running/waiting/queued LLM request, KV cache usage 0, no classic request in
  flight (`inferd_model_requests_inflight`), no API-key slot held;
- resident memory (server + engine process) grew by under 5 % from after warm-up to the end;
- open file descriptors back to the post-warm-up baseline.

Bounded: each loop stops at the deadline or after --max-requests; only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import websockets

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from inferd.gateway.kserve.proto import SERVICE_NAME  # noqa: E402
from inferd.gateway.kserve.proto import grpc_service_pb2 as pb  # noqa: E402
from inferd.telemetry.metrics import parse_samples  # noqa: E402

KEY = "soak-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
MODEL = "fraud"
MAX_BODY = 65536
SERVER_FLAGS = [
    "--max-model-len", "256",
    "--kv-cache-memory", "8MiB",
    "--max-num-seqs", "8",
    "--num-threads", "1",
    "--request-timeout", "60",
    "--max-body-bytes", str(MAX_BODY),
    "--read-timeout", "10",
    "--load-model", MODEL,
    "--api-key", KEY,
]  # fmt: skip
OK_REJECTIONS = frozenset({429, 503})  # a well-formed request may be turned away with these
MEMORY_GROWTH_LIMIT = 0.05
WARM_UP_SHARE, WARM_UP_MIN_S = 0.2, 8.0  # the warm-up load: a share of the run, at least this


# -- outcomes ----------------------------------------------------------------------------------


@dataclass
class Tally:
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def add(self, scenario: str, outcome: str, detail: str = "") -> None:
        self.counts[(scenario, outcome)] += 1
        if outcome == "unexpected" and len(self.unexpected) < 50:
            self.unexpected.append(f"{scenario}: {detail}")

    def total(self, outcome: str | None = None, scenarios: tuple[str, ...] = ()) -> int:
        return sum(
            n
            for (s, o), n in self.counts.items()
            if (outcome is None or o == outcome) and (not scenarios or s in scenarios)
        )


class Unexpected(Exception):
    """A scenario saw something it does not allow."""


def http_outcome(status: int, allowed: frozenset[int] = OK_REJECTIONS) -> str:
    if 200 <= status < 300:
        return "answered"
    if status in allowed:
        return "rejected"
    raise Unexpected(f"HTTP {status}")


# -- scenarios ---------------------------------------------------------------------------------


@dataclass
class Ctx:
    http: httpx.AsyncClient
    channel: grpc.aio.Channel
    ws_url: str
    rng: random.Random


def _prompt(rng: random.Random, max_words: int = 30) -> str:
    """Short enough for the server's 256-token context with the longest `max_tokens` here."""
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, max_words)))


async def completion(ctx: Ctx) -> str:
    body = {"prompt": _prompt(ctx.rng), "max_tokens": ctx.rng.randint(1, 24)}
    r = await ctx.http.post("/v1/completions", json=body)
    return http_outcome(r.status_code)


async def _sse(ctx: Ctx, body: dict[str, Any], drop_after: int | None) -> str:
    async with ctx.http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            if r.status_code not in OK_REJECTIONS:
                raise Unexpected(f"HTTP {r.status_code}: {text[:200]}")
            return "rejected"
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if '"error"' in line[:20]:
                    raise Unexpected(f"stream error event {line[:200]}")
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return "cancelled"  # leaving the block closes the connection
            elif line == "data: [DONE]":
                return "answered"
    raise Unexpected("stream ended without [DONE]")


def _chat(ctx: Ctx, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": _prompt(ctx.rng, 8)}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def chat_stream(ctx: Ctx) -> str:
    return await _sse(ctx, _chat(ctx, ctx.rng.randint(4, 32)), None)


async def stream_disconnect(ctx: Ctx) -> str:
    return await _sse(ctx, _chat(ctx, 120), drop_after=2)


async def _websocket(ctx: Ctx, cancel: bool) -> str:
    prompt = _prompt(ctx.rng, 8)
    body = {"prompt": prompt, "max_tokens": 120 if cancel else 16, "ignore_eos": True}
    async with websockets.connect(ctx.ws_url, additional_headers=AUTH, open_timeout=30) as ws:
        await ws.send(json.dumps(body))
        chunks = 0
        while True:
            message = await ws.recv()
            if message == "[DONE]":
                return "cancelled" if cancel else "answered"
            doc = json.loads(message)
            if "error" in doc:
                return http_outcome(int(doc.get("status", 500)))
            chunks += 1
            if cancel and chunks == 2:
                if ctx.rng.random() < 0.5:
                    return "cancelled"  # closing the socket mid-stream aborts the request
                await ws.send(json.dumps({"type": "cancel"}))


async def websocket_stream(ctx: Ctx) -> str:
    return await _websocket(ctx, cancel=False)


async def websocket_cancel(ctx: Ctx) -> str:
    return await _websocket(ctx, cancel=True)


def _features(rng: random.Random, rows: int) -> np.ndarray:
    return np.asarray([[rng.random() * 100 for _ in range(8)] for _ in range(rows)], np.float32)


async def kserve_http(ctx: Ctx) -> str:
    x = _features(ctx.rng, ctx.rng.randint(1, 4))
    tensor = {"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.tolist()}
    r = await ctx.http.post(f"/v2/models/{MODEL}/infer", json={"inputs": [tensor]})
    return http_outcome(r.status_code)


def _grpc_request(rng: random.Random, rows: int, truncate: bool = False) -> pb.ModelInferRequest:
    x = _features(rng, rows)
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    raw = x.tobytes()
    request.raw_input_contents.append(raw[:-3] if truncate else raw)
    return request


# A gRPC status a well-formed request may get: the model being reloaded, a full queue.
GRPC_REJECTIONS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _infer_call(ctx: Ctx) -> Any:
    return ctx.channel.unary_unary(
        f"/{SERVICE_NAME}/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


async def grpc_infer(ctx: Ctx) -> str:
    try:
        await _infer_call(ctx)(_grpc_request(ctx.rng, ctx.rng.randint(1, 4)), metadata=GRPC_AUTH)
    except grpc.aio.AioRpcError as e:
        if e.code() in GRPC_REJECTIONS:
            return "rejected"
        raise Unexpected(f"gRPC {e.code().name}: {e.details()}") from None
    return "answered"


async def grpc_stream(ctx: Ctx) -> str:
    """Three requests on one ModelStreamInfer stream, the middle one malformed: two answers
    and one error_message come back, and the stream ends cleanly."""
    call = ctx.channel.stream_stream(
        f"/{SERVICE_NAME}/ModelStreamInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    requests = [_grpc_request(ctx.rng, 2), _grpc_request(ctx.rng, 1, truncate=True)]
    requests.append(_grpc_request(ctx.rng, 3))
    errors = []
    try:
        async for response in call(iter(requests), metadata=GRPC_AUTH):
            errors.append(response.error_message)
    except grpc.aio.AioRpcError as e:
        raise Unexpected(f"gRPC stream {e.code().name}: {e.details()}") from None
    failed = [e for e in errors if e]
    turned_away = [e for e in failed if any(w in e for w in _STREAM_REJECTIONS)]
    if len(errors) != 3 or len(failed) - len(turned_away) != 1:
        raise Unexpected(f"stream answers {errors}")  # exactly the malformed one must fail
    return "rejected" if turned_away else "answered"


# What a good request's error_message on a stream may say: the model being reloaded, or its
# queue full (the unary calls tell these apart by status code instead).
_STREAM_REJECTIONS = ("not ready", "not loaded", "stopped", "queue")


# Malformed requests: (method, path, body or JSON, headers, allowed statuses). Classic ones may
# also meet the model being reloaded (503), which is checked before their tensors.
_CLASSIC_BAD = frozenset({400, 503})
MALFORMED: list[tuple[str, dict[str, Any] | bytes, dict[str, str], frozenset[int]]] = [
    ("/v1/completions", b"{not json", {}, frozenset({400})),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, {}, frozenset({400})),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, {}, frozenset({404})),
    ("/v1/chat/completions", {"messages": "not a list"}, {}, frozenset({400})),
    ("/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, {}, frozenset({413})),
    ("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"}, frozenset({401})),
    (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "features"}]}, {}, _CLASSIC_BAD),
    (
        f"/v2/models/{MODEL}/infer",
        {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
        {},
        _CLASSIC_BAD,
    ),
    ("/v2/models/no-such-model/infer", {"inputs": []}, {}, frozenset({404})),
]


async def malformed(ctx: Ctx) -> str:
    if ctx.rng.random() < 0.15:
        return await _malformed_grpc(ctx)
    path, body, headers, allowed = ctx.rng.choice(MALFORMED)
    if isinstance(body, bytes):
        kind = {"content": body, "headers": {**headers, "content-type": "application/json"}}
        r = await ctx.http.post(path, **kind)  # type: ignore[arg-type]
    else:
        r = await ctx.http.post(path, json=body, headers=headers)
    outcome = http_outcome(r.status_code, allowed)
    if outcome == "answered":
        raise Unexpected(f"{path} answered a malformed request")
    return outcome


async def _malformed_grpc(ctx: Ctx) -> str:
    try:
        await _infer_call(ctx)(_grpc_request(ctx.rng, 2, truncate=True), metadata=GRPC_AUTH)
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE):
            return "rejected"
        raise Unexpected(f"gRPC {e.code().name}: {e.details()}") from None
    raise Unexpected("gRPC answered a truncated tensor")


Scenario = Callable[[Ctx], Awaitable[str]]
SCENARIOS: dict[str, tuple[Scenario, int]] = {
    "completion": (completion, 3),
    "chat_stream": (chat_stream, 3),
    "stream_disconnect": (stream_disconnect, 2),
    "websocket": (websocket_stream, 2),
    "websocket_cancel": (websocket_cancel, 1),
    "kserve_http": (kserve_http, 3),
    "grpc_infer": (grpc_infer, 3),
    "grpc_stream": (grpc_stream, 1),
    "malformed": (malformed, 2),
}
LLM_SCENARIOS = ("completion", "chat_stream", "stream_disconnect", "websocket", "websocket_cancel")


# -- the load --------------------------------------------------------------------------------


async def one(name: str, ctx: Ctx, tally: Tally, timeout_s: float) -> None:
    scenario = SCENARIOS[name][0]
    try:
        outcome = await asyncio.wait_for(scenario(ctx), timeout_s)
    except Unexpected as e:
        tally.add(name, "unexpected", str(e))
    except TimeoutError:
        tally.add(name, "unexpected", f"no answer in {timeout_s} s")
    except Exception as e:  # a transport failure is a finding too
        tally.add(name, "unexpected", f"{type(e).__name__}: {e}")
    else:
        tally.add(name, outcome)


async def client_loop(
    ctx: Ctx, tally: Tally, deadline: float, max_requests: int, timeout_s: float
) -> None:
    names = list(SCENARIOS)
    weights = [SCENARIOS[n][1] for n in names]
    for _ in range(max_requests):
        if time.monotonic() >= deadline:
            return
        await one(ctx.rng.choices(names, weights)[0], ctx, tally, timeout_s)


async def reload_model(http: httpx.AsyncClient, tally: Tally, at_s: float) -> None:
    """Unloads and reloads the classic model through the repository API, mid-run."""
    await asyncio.sleep(at_s)
    for action in ("unload", "load"):
        r = await http.post(f"/v2/repository/models/{MODEL}/{action}", timeout=120)
        outcome = "answered" if r.status_code == 200 else "unexpected"
        tally.add(f"repository_{action}", outcome, f"HTTP {r.status_code} {r.text[:200]}")
        await asyncio.sleep(1.0)


@contextlib.asynccontextmanager
async def contexts(base: str, grpc_port: int, clients: int, seed: int) -> Any:
    limits = httpx.Limits(max_connections=clients * 2)
    async with (
        httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120, limits=limits) as http,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        ws_url = base.replace("http://", "ws://") + "/v1/completions/ws"
        yield [Ctx(http, channel, ws_url, random.Random(seed + i)) for i in range(clients)]


@dataclass(frozen=True)
class LoadSpec:
    duration_s: float = 180.0
    clients: int = 8
    max_requests: int = 100_000  # per client loop
    seed: int = 0
    timeout_s: float = 60.0  # per request: no answer by then is `unexpected`


async def run_load(base: str, grpc_port: int, spec: LoadSpec, reload: bool = True) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + spec.duration_s
    async with contexts(base, grpc_port, spec.clients, spec.seed) as ctxs:
        at_s = spec.duration_s * 0.4
        reloads = asyncio.create_task(
            reload_model(ctxs[0].http, tally, at_s) if reload else _noop()
        )
        loops = [client_loop(c, tally, deadline, spec.max_requests, spec.timeout_s) for c in ctxs]
        await asyncio.gather(*loops)
        await reloads
    return tally


async def _noop() -> None:
    return None


# -- the server and what it reports -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launched:
    proc: subprocess.Popen[bytes]
    port: int
    grpc_port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The server and its children (the engine core process)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        )
        return [self.proc.pid, *(int(p) for p in out.stdout.split())]

    def rss_bytes(self) -> list[int]:
        """Resident bytes of the server process, then of each child (the engine core)."""
        return [_status_kib(pid, "VmRSS") * 1024 for pid in self.pids()]

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def metrics(self) -> dict[str, float]:
        return parse_samples(httpx.get(f"{self.base}/metrics", timeout=30).text)


def _status_kib(pid: int, field_name: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


@contextlib.contextmanager
def launch(
    log_dir: Path, repository: Path, extra: tuple[str, ...] = (), timeout_s: float = 300
) -> Iterator[Launched]:
    port, grpc_port = free_port(), free_port()
    log = log_dir / f"soak-server-{port}.log"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "inferd-tiny", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--grpc-port", str(grpc_port), *SERVER_FLAGS]
    cmd += ["--model-repository", str(repository), *extra]
    env = {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    server = Launched(proc, port, grpc_port, log)
    try:
        _wait_ready(server, timeout_s)
        yield server
    finally:
        _stop(server)


def _wait_ready(server: Launched, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{server.log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base}/health/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{server.log.read_text()[-4000:]}")


def _stop(server: Launched) -> None:
    children = server.pids()[1:]
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=30)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- checks ------------------------------------------------------------------------------------

LEAK_GAUGES = (
    "inferd_num_requests_running",
    "inferd_num_requests_waiting",
    "inferd_num_requests_queued",
    "inferd_kv_cache_usage_ratio",
    f'inferd_model_requests_inflight{{model="{MODEL}"}}',
    'inferd_api_key_requests_running{key="flag1"}',
)


def finished_llm(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("inferd_requests_finished_total{"))


def classic_success(m: dict[str, float]) -> float:
    key = f'inferd_model_requests_total{{model="{MODEL}",outcome="success"}}'
    return m.get(key, 0.0)


@dataclass
class Report:
    duration_s: float
    tally: Tally
    rss_before: list[int]  # per process: the server, then the engine core
    rss_after: list[int]
    fds_before: int
    fds_after: int
    llm_server: float  # inferd_requests_finished_total growth
    classic_server: float
    leaks: dict[str, float]
    failures: list[str] = field(default_factory=list)

    @property
    def llm_client(self) -> int:
        answered = self.tally.total("answered", LLM_SCENARIOS)
        return answered + self.tally.total("cancelled", LLM_SCENARIOS)

    @property
    def classic_client(self) -> int:
        """Answered classic requests: each gRPC stream answers two (one more is malformed)."""
        n = self.tally.total("answered", ("kserve_http", "grpc_infer"))
        return n + 2 * self.tally.total("answered", ("grpc_stream",))

    @property
    def rss_growth(self) -> float:
        return sum(self.rss_after) / max(1, sum(self.rss_before)) - 1.0

    def check(self) -> list[str]:
        fails = list(self.failures)
        if self.tally.total("unexpected"):
            fails.append(f"{self.tally.total('unexpected')} unexpected: {self.tally.unexpected}")
        if self.llm_server != self.llm_client:
            fails.append(
                f"LLM requests: server finished {self.llm_server}, client {self.llm_client}"
            )
        if self.classic_server < self.classic_client:
            fails.append(
                f"classic requests: server succeeded {self.classic_server}, "
                f"client answered {self.classic_client}"
            )
        fails += [f"leak: {k} = {v}" for k, v in self.leaks.items() if v != 0]
        if self.rss_growth >= MEMORY_GROWTH_LIMIT:
            fails.append(f"resident memory grew {self.rss_growth:.1%}")
        if self.fds_after > self.fds_before:
            fails.append(f"file descriptors {self.fds_before} -> {self.fds_after}")
        return fails

    def summary(self) -> dict[str, Any]:
        outcomes = Counter[str]()
        for (_, outcome), n in self.tally.counts.items():
            outcomes[outcome] += n
        return {
            "duration_s": round(self.duration_s, 1),
            "requests": self.tally.total(),
            "outcomes": dict(outcomes),
            "by_scenario": {f"{s}/{o}": n for (s, o), n in sorted(self.tally.counts.items())},
            "llm_requests_client_vs_server": [self.llm_client, self.llm_server],
            "classic_answered_client_vs_server": [self.classic_client, self.classic_server],
            "rss_mib_per_process_before": [round(b / 2**20, 1) for b in self.rss_before],
            "rss_mib_per_process_after": [round(b / 2**20, 1) for b in self.rss_after],
            "rss_growth_pct": round(100 * self.rss_growth, 2),
            "fds_before_after": [self.fds_before, self.fds_after],
            "leak_gauges": self.leaks,
            "failures": self.check(),
        }


def settle(server: Launched, fds_before: int, timeout_s: float = 30.0) -> dict[str, float]:
    """Waits (bounded) until the server is idle: gauges at 0, descriptors back; the last
    metrics read. Streams the client dropped need a step or two to be aborted."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = all(m.get(g, 0.0) == 0 for g in LEAK_GAUGES)
        if (idle and server.open_fds() <= fds_before) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def warm_up(server: Launched, spec: LoadSpec) -> Tally:
    """The same load for a while first (every scenario, as many clients), so allocator pools,
    thread pools, connection buffers and caches exist before the baselines are taken."""
    seconds = max(WARM_UP_MIN_S, spec.duration_s * WARM_UP_SHARE)
    warm = LoadSpec(seconds, spec.clients, spec.max_requests, spec.seed + 1000, spec.timeout_s)
    return asyncio.run(run_load(server.base, server.grpc_port, warm, reload=False))


def soak(spec: LoadSpec, log_dir: Path, server_args: tuple[str, ...] = ()) -> Report:
    from inferd.examples import ensure_example_repository

    repository = ensure_example_repository()
    with launch(log_dir, repository, server_args) as server:
        warm = warm_up(server, spec)
        before = settle(server, 1 << 30)
        fds_before, rss_before = server.open_fds(), server.rss_bytes()
        started = time.monotonic()
        tally = asyncio.run(run_load(server.base, server.grpc_port, spec))
        elapsed = time.monotonic() - started
        after = settle(server, fds_before)
        failures = [] if server.proc.poll() is None else ["the server exited during the run"]
        if warm.total("unexpected"):
            failures.append(f"warm-up: {warm.unexpected}")
        return Report(
            duration_s=elapsed,
            tally=tally,
            rss_before=rss_before,
            rss_after=server.rss_bytes(),
            fds_before=fds_before,
            fds_after=server.open_fds(),
            llm_server=finished_llm(after) - finished_llm(before),
            classic_server=classic_success(after) - classic_success(before),
            leaks={g: after.get(g, 0.0) for g in LEAK_GAUGES},
            failures=failures,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    p.add_argument("--max-requests", type=int, default=100_000, help="per client loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument(
        "--server-arg", action="append", default=[], help="one more `inferd serve` argument"
    )
    args = p.parse_args()
    spec = LoadSpec(args.duration, args.clients, args.max_requests, args.seed)
    report = soak(spec, args.log_dir, tuple(args.server_arg))
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
