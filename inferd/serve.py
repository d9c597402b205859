"""`inferd serve`: the HTTP server's lifecycle around uvicorn and the engine client.

Start: HTTP comes up first (live, not ready), the engine loads, readiness turns green.
SIGTERM/SIGINT: drain (readiness red, new requests 503 "draining"), in-flight requests finish
up to --shutdown-timeout (then they are aborted), exit 0.
Engine death: readiness red, in-flight requests get an error, the server exits with code 3 so an
orchestrator restarts it (the engine is not restarted in-process). A model that fails to load
exits with code 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator

import uvicorn

from inferd.config import AdmissionConfig, EngineConfig, ServerConfig
from inferd.gateway.app import create_app, gateway_state, set_engine

logger = logging.getLogger("inferd.serve")

EXIT_OK = 0
EXIT_LOAD_FAILED = 2
EXIT_ENGINE_DEAD = 3
_POLL_S = 0.05


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run_server(engine: EngineConfig, admission: AdmissionConfig, server: ServerConfig) -> int:
    from inferd.engine.async_client import AsyncLLM

    app = create_app(None, server)
    state = gateway_state(app)
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    http = _Server(config)
    http_task = asyncio.create_task(http.serve())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        llm = await AsyncLLM.start(engine, admission, served_model_name=server.served_model_name)
    except Exception:
        logger.exception("the engine failed to start")
        http.should_exit = True
        await http_task
        return EXIT_LOAD_FAILED
    set_engine(app, llm)
    logger.info("ready: serving %s on http://%s:%d", state.model_name, server.host, server.port)
    code = await _wait_for_end(stop, llm, http_task)
    if code == EXIT_OK:
        state.draining = True
        logger.info("draining: up to %.1f s for in-flight requests", server.shutdown_timeout_s)
        await llm.drain(server.shutdown_timeout_s)
        await _wait_inflight(state, 2.0)
    else:
        await _wait_inflight(state, 2.0)
    http.should_exit = True
    with contextlib.suppress(Exception):
        await http_task
    await llm.shutdown()
    if state.tracer is not None:
        state.tracer.shutdown()
    return code


async def _wait_for_end(stop: asyncio.Event, llm: object, http_task: asyncio.Task[None]) -> int:
    while not stop.is_set():
        if getattr(llm, "dead", False):
            logger.error("the engine process died; exiting with code %d", EXIT_ENGINE_DEAD)
            return EXIT_ENGINE_DEAD
        if http_task.done():
            return EXIT_ENGINE_DEAD if http_task.exception() else EXIT_OK
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_S)
    return EXIT_OK


async def _wait_inflight(state: object, timeout_s: float) -> None:
    """Lets responses that already have their final output (or error) finish sending."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while getattr(state, "inflight", 0) > 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_POLL_S)


def serve(engine: EngineConfig, admission: AdmissionConfig, server: ServerConfig) -> int:
    return asyncio.run(run_server(engine, admission, server))
