"""`inferd serve --data-parallel-size N`: N engine replicas on this machine behind the router.

Each replica is a child `inferd serve` with the same flags on its own free loopback port (gRPC
off: the router speaks HTTP); the router takes the main --host/--port and routes with the default
cache-aware policy over them. SIGTERM/SIGINT stops the router, then the replicas drain (SIGTERM,
up to --shutdown-timeout) and are killed past that. A replica that dies is taken out of rotation
by the router's health checks; it is not restarted (an orchestrator restarts the whole command).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from inferd.router.config import RouterConfig
from inferd.router.kv_events import subscribe_address

logger = logging.getLogger("inferd.router")

# Flags the children get from here instead (value-taking flags: their value goes too).
_PARENT_ONLY = ("--data-parallel-size", "--host", "--port", "--grpc-port")
# Each replica gets its own address for this one (see replica_endpoint).
_KV_EVENTS = "--kv-events-endpoint"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def replica_argv(argv: Sequence[str], port: int, index: int = 0) -> list[str]:
    """`argv` (the parent's, from `serve` on) without the parent-only flags, on `port`; replica
    `index` publishes its KV events on its own endpoint (`replica_endpoint`).

    >>> replica_argv(["serve", "--port", "8000", "--data-parallel-size=2", "--seed", "1"], 9)
    ['serve', '--seed', '1', '--host', '127.0.0.1', '--port', '9', '--grpc-port', '-1']
    """
    out: list[str] = []
    skip = rewrite = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if rewrite:
            out.append(replica_endpoint(arg, index))
            rewrite = False
            continue
        name, eq, value = arg.partition("=")
        if name in _PARENT_ONLY:
            skip = not eq
            continue
        if name == _KV_EVENTS:
            rewrite = not eq
            arg = f"{name}={replica_endpoint(value, index)}" if eq else arg
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "-1"]


def replica_endpoint(endpoint: str, index: int) -> str:
    """Replica `index`'s KV-events endpoint: one PUB socket binds one address, so replica i of
    `tcp://host:P` publishes on port P + i (`ipc://path` becomes `ipc://path-i`).

    >>> replica_endpoint("tcp://*:5557", 2), replica_endpoint("ipc:///tmp/kv", 1)
    ('tcp://*:5559', 'ipc:///tmp/kv-1')
    """
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + index}"
    return f"{endpoint}-{index}"


def replica_kv_events(urls: Sequence[str], endpoint: str | None) -> tuple[tuple[str, str], ...]:
    """The router's subscriptions to `urls`' KV events, replica i on `replica_endpoint(endpoint,
    i)` reached over loopback.

    >>> replica_kv_events(["http://a", "http://b"], "tcp://*:5557")
    (('http://a', 'tcp://127.0.0.1:5557'), ('http://b', 'tcp://127.0.0.1:5558'))
    """
    if endpoint is None:
        return ()
    return tuple(
        (url, subscribe_address(replica_endpoint(endpoint, i))) for i, url in enumerate(urls)
    )


def start_replicas(argv: Sequence[str], n: int) -> list[tuple[str, subprocess.Popen[bytes]]]:
    start = list(argv).index("serve")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    replicas = []
    for i in range(n):
        port = free_port()
        own = replica_argv(argv[start:], port, i)
        cmd = [sys.executable, "-m", "inferd.cli", *argv[:start], *own]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        replicas.append((f"http://127.0.0.1:{port}", proc))
    return replicas


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM (drain) when the launching process dies, even by
    SIGKILL, so no replica outlives the command (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_replicas(replicas: Sequence[tuple[str, subprocess.Popen[bytes]]], grace_s: float) -> None:
    for _, proc in replicas:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the replica drains
    for url, proc in replicas:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("replica %s did not drain in %.0f s; killing it", url, grace_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def run_data_parallel(
    argv: Sequence[str],
    n: int,
    config: RouterConfig,
    grace_s: float,
    kv_events_endpoint: str | None = None,
) -> int:
    """Starts `n` replicas from `argv` and serves the router (`config` without replicas yet);
    with `kv_events_endpoint` the router follows each replica's own (exact prefix index)."""
    from dataclasses import replace

    from inferd.router.app import run_router

    replicas = start_replicas(argv, n)
    urls = tuple(url for url, _ in replicas)
    logger.info("data parallel: %d replicas %s", n, list(urls))
    try:
        return run_router(
            replace(config, replicas=urls, kv_events=replica_kv_events(urls, kv_events_endpoint))
        )
    finally:
        stop_replicas(replicas, grace_s + 5.0)
