"""`inferd serve`: the server's lifecycle around uvicorn, the LLM engine client, the model
repository, the image engine and the gRPC service.

Start: HTTP comes up first (live, not ready), the repository's models and the engine load, gRPC
starts, readiness turns green. One bad model in the repository does not stop the server (it is
listed as UNAVAILABLE with its reason); a missing repository or LLM exits with code 2.
SIGTERM/SIGINT: drain (readiness red, new requests 503 "draining"), in-flight requests finish
up to --shutdown-timeout (then they are aborted), exit 0.
Engine death: readiness red, in-flight requests get an error, the server exits with code 3 so an
orchestrator restarts it (the engine is not restarted in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from inferd.config import AdmissionConfig, RepositoryConfig, ServeConfig, ServerConfig
from inferd.errors import ModelLoadError
from inferd.gateway.app import create_app, set_engine
from inferd.gateway.connection import listening_port, read_timeout_protocol
from inferd.gateway.state import GatewayState, gateway_state
from inferd.heap import freeze_startup_heap

if TYPE_CHECKING:
    from inferd.diffusion.client import AsyncImageEngine
    from inferd.engine.async_client import AsyncLLM
    from inferd.repository.manager import ModelRepository

logger = logging.getLogger("inferd.serve")

EXIT_OK = 0
EXIT_LOAD_FAILED = 2
EXIT_ENGINE_DEAD = 3
_POLL_S = 0.05
EXAMPLES = "examples"  # --model-repository examples: the built-in example repository


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run_server(config: ServeConfig) -> int:
    """Serves an LLM (`config.engine`), a model repository, or both; returns the exit code."""
    server = config.server
    app = create_app(None, server, lora_updates=config.env.allow_runtime_lora_updating)
    state = gateway_state(app)
    state.serves_llm = config.engine is not None
    state.serves_repository = config.repository is not None
    http = _Server(uvicorn.Config(app, **uvicorn_options(server)))
    http_task = asyncio.create_task(http.serve())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parts = _Parts()
    try:
        await _start_parts(parts, app, config)
    except Exception:
        logger.exception("the server failed to start")
        http.should_exit = True
        await http_task
        await parts.close(0.0)
        return EXIT_LOAD_FAILED
    freeze_startup_heap("server")
    port = listening_port(http, server.port)
    logger.info("ready: http://%s:%d%s", server.host, port, parts.describe())
    code = await _wait_for_end(stop, parts.llm, http_task)
    state.draining = True
    if code == EXIT_OK:
        logger.info("draining: up to %.1f s for in-flight requests", server.shutdown_timeout_s)
        await parts.drain(server.shutdown_timeout_s)
    await _wait_inflight(state, 2.0)
    http.should_exit = True
    with contextlib.suppress(Exception):
        await http_task
    await parts.close(server.shutdown_timeout_s if code == EXIT_OK else 0.0)
    if state.tracer is not None:
        state.tracer.shutdown()
    return code


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config's keywords: address, TLS, connection bounds (docs/configuration.md)."""
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "log_config": None,
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": server.timeout_keep_alive,
        "limit_concurrency": server.limit_concurrency,
        "ssl_keyfile": server.ssl_keyfile,
        "ssl_certfile": server.ssl_certfile,
        "ssl_ca_certs": server.ssl_ca_certs,
    }
    if server.ssl_ca_certs is not None and server.ssl_certfile is not None:
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED  # a CA given: clients must show a cert
    if server.read_timeout_s is not None:
        options["http"] = read_timeout_protocol(server.read_timeout_s)
    return options


@dataclass
class _Parts:
    """What one server runs besides HTTP; each part is optional."""

    llm: AsyncLLM | None = None
    repository: ModelRepository | None = None
    grpc: Any = None
    grpc_port: int | None = None
    # Image models by served name (each its own engine thread in this process).
    images: dict[str, AsyncImageEngine] = field(default_factory=dict)

    def describe(self) -> str:
        words = []
        if self.llm is not None:
            words.append(f" LLM {self.llm.model_name}")
        if self.images:
            words.append(f" images {sorted(self.images)}")
        if self.repository is not None:
            words.append(f" models {self.repository.model_names()}")
        if self.grpc_port is not None:
            words.append(f" gRPC :{self.grpc_port}")
        return ";".join(words)

    async def drain(self, timeout_s: float) -> None:
        waits = []
        if self.llm is not None:
            waits.append(self.llm.drain(timeout_s))
        if self.repository is not None:
            waits.append(self.repository.shutdown(timeout_s))
        waits.extend(engine.drain(timeout_s) for engine in self.images.values())
        await asyncio.gather(*waits)

    async def close(self, grace_s: float) -> None:
        if self.grpc is not None:
            from inferd.gateway.kserve.grpc_server import stop_grpc_server

            await stop_grpc_server(self.grpc, min(grace_s, 5.0))
        if self.repository is not None:
            await self.repository.shutdown(0.0)
        if self.llm is not None:
            await self.llm.shutdown()
        for engine in self.images.values():
            await engine.shutdown()


async def _start_parts(parts: _Parts, app: Any, config: ServeConfig) -> None:
    from inferd.engine.async_client import AsyncLLM

    state = gateway_state(app)
    server, admission, engine = config.server, config.admission, config.engine
    if config.repository is not None:
        root = await asyncio.to_thread(
            resolve_repository, config.repository.path, config.env.cache_dir
        )
        parts.repository = await _start_repository(root, config.repository, admission, state)
        state.repository = parts.repository
    if engine is not None:
        parts.llm = await AsyncLLM.start(
            engine, admission, served_model_name=server.served_model_name, env=config.env
        )
        set_engine(app, parts.llm)
    if config.image is not None:
        await _start_images(parts, app, config)
    # KServe v2 over gRPC serves the repository's models and the image models.
    if server.grpc_port is not None and (parts.repository is not None or parts.images):
        from inferd.gateway.kserve.grpc_server import start_grpc_server

        parts.grpc = await start_grpc_server(
            state, server.host, server.grpc_port, server.grpc_max_message_bytes
        )
        parts.grpc_port = parts.grpc.port


async def _start_images(parts: _Parts, app: Any, config: ServeConfig) -> None:
    """The image model's engine, handed to the gateway in the one call below."""
    from inferd.diffusion.client import AsyncImageEngine
    from inferd.gateway.app import set_image_engines

    assert config.image is not None
    engine = await AsyncImageEngine.start(
        config.image, config.env.cache_dir, request_timeout_s=config.admission.request_timeout_s
    )
    parts.images[engine.model_name] = engine
    set_image_engines(app, dict(parts.images))


async def _start_repository(
    root: Path, cfg: RepositoryConfig, admission: AdmissionConfig, state: GatewayState
) -> ModelRepository:
    from inferd.backends.base import BackendOptions
    from inferd.batching.rules import QueueLimits
    from inferd.repository.manager import ModelRepository

    repo = ModelRepository(
        root,
        options=BackendOptions(allow_pickle=cfg.allow_pickle, intra_op_threads=cfg.backend_threads),
        limits=QueueLimits(
            max_queue_size=admission.max_queued_requests,
            default_timeout_s=admission.request_timeout_s,
        ),
        observer=state.model_metrics,
    )
    await repo.start(list(cfg.load_models) or None)
    return repo


def resolve_repository(path: str, cache_dir: Path) -> Path:
    """`examples` -> the built-in example repository (built on first use, under `cache_dir`);
    else a folder."""
    if path == EXAMPLES:
        from inferd.examples import ensure_example_repository

        try:
            return ensure_example_repository(cache_dir / "repository")
        except ImportError as e:
            raise ModelLoadError(
                f"building the example repository needs the `examples` extra ({e.name} is "
                "missing): pip install 'inferd[examples]'"
            ) from e
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelLoadError(f"--model-repository {path!r} is not a directory")
    return root


async def _wait_for_end(
    stop: asyncio.Event, llm: AsyncLLM | None, http_task: asyncio.Task[None]
) -> int:
    """Waits for the first of: a stop signal, the engine's death, the HTTP server's end. Waits on
    each, not by polling: an idle server wakes for none of them."""
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), http_task]
    if llm is not None:
        waits.append(asyncio.ensure_future(llm.wait_dead()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            if w is not http_task:
                w.cancel()
    if stop.is_set():
        return EXIT_OK
    if llm is not None and llm.dead:
        logger.error("the engine process died; exiting with code %d", EXIT_ENGINE_DEAD)
        return EXIT_ENGINE_DEAD
    return EXIT_ENGINE_DEAD if http_task.exception() else EXIT_OK


async def _wait_inflight(state: object, timeout_s: float) -> None:
    """Lets responses that already have their final output (or error) finish sending."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while getattr(state, "inflight", 0) > 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_POLL_S)


def serve(config: ServeConfig) -> int:
    """Runs the server `config` describes until SIGTERM/SIGINT or engine death; the exit code."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run_server(config))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (a dependency on Linux): its loop cuts the per-request
    scheduling cost of every HTTP request, SSE chunk and engine message."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
