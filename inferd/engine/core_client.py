"""The client of one engine core process: spawn it, watch it, talk to it, stop it.

    core = EngineCoreClient()
    ready = await core.start(config, env, timeout_s=600,   # CoreReady (info + tokenizer path)
                             on_event=..., on_broken=...)
    core.send(AddRequest(...))         # never blocks; False: no core
    # on_event(event) runs on the event loop for every EngineOutputs, KVBlocks and LoRAReply,
    # in order;
    # on_broken(reason) once if the message stream breaks (a frame that does not decode, a
    # callback that raises, or the core closing its end).
    exit_code = await core.wait_exit()  # returns when the process has exited
    await core.stop(); core.close()

The client listens on a Unix socket in a private temporary folder, and the spawned core
connects to it (engine/core_channel.py). Sends never block: the transport buffers what the
kernel does not take, and a send with no core connected fails at once. It knows nothing of
requests: admission and streams are the caller's (inferd.engine.async_client).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TypeVar

import msgspec

from inferd.config import EngineConfig, Environment
from inferd.engine.core_channel import FrameProtocol
from inferd.engine.core_proc import run_engine_core
from inferd.engine.messages import (
    CoreEvent,
    CoreFailed,
    CoreReady,
    EngineCoreEvent,
    EngineCoreRequest,
    EngineOutputs,
    KVBlocks,
    LoRAReply,
    ShutdownCore,
)
from inferd.errors import EngineDeadError, ModelLoadError

logger = logging.getLogger("inferd.engine.core_client")

_POLL_INTERVAL_S = 0.1
_SHUTDOWN_GRACE_S = 5.0

T = TypeVar("T")


class EngineCoreClient:
    """One engine core process and the socket to it. `close()` releases everything."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="inferd-ipc-"))
        self._path = str(self._dir / "core.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self._channel: FrameProtocol | None = None
        self._proc: BaseProcess | None = None
        self._closed = False

    async def start(
        self,
        config: EngineConfig,
        env: Environment,
        timeout_s: float,
        on_event: Callable[[CoreEvent], None],
        on_broken: Callable[[str], None],
    ) -> CoreReady:
        """Spawns the core and waits for its CoreReady; from then on every EngineOutputs,
        KVBlocks and LoRAReply goes to `on_event`, and `on_broken` hears once if the stream
        breaks.

        Raises ModelLoadError if the core reports a load failure, EngineDeadError if it exits
        or stays silent past `timeout_s`."""
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=run_engine_core,
            args=(config, env, self._path),
            name="inferd-engine-core",
            daemon=True,
        )
        self._proc = proc
        await asyncio.to_thread(proc.start)
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        sock, _ = await self._while_alive(loop.sock_accept(self._listener), deadline, timeout_s)
        self._listener.close()  # one core, one connection
        first: asyncio.Future[EngineCoreEvent] = loop.create_future()

        def on_frame(payload: bytes) -> None:
            event = self._decoder.decode(payload)
            if not first.done():
                first.set_result(event)
            elif isinstance(event, EngineOutputs | KVBlocks | LoRAReply):
                on_event(event)

        def on_lost(exc: Exception | None) -> None:
            if not first.done():
                first.set_exception(EngineDeadError("the engine core closed its channel"))
                return
            if exc is None:
                on_broken("the engine core closed its channel")
                return
            logger.error("the engine output stream failed", exc_info=exc)
            on_broken("the engine output stream failed")

        _, self._channel = await loop.connect_accepted_socket(
            lambda: FrameProtocol(on_frame, on_lost), sock
        )
        return _ready_or_raise(await self._while_alive(first, deadline, timeout_s))

    async def _while_alive(self, waitable: Awaitable[T], deadline: float, timeout_s: float) -> T:
        """Awaits `waitable` while the core lives and the start-up deadline has not passed."""
        proc = self._proc
        assert proc is not None
        task = asyncio.ensure_future(waitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_INTERVAL_S)
            if done:
                return task.result()
            if not proc.is_alive():
                task.cancel()
                raise EngineDeadError(
                    f"the engine core exited with code {proc.exitcode} while loading the model"
                )
            if time.monotonic() > deadline:
                task.cancel()
                raise EngineDeadError(f"the engine core did not load the model in {timeout_s} s")

    @property
    def pid(self) -> int | None:
        """The core process's id once started."""
        return None if self._proc is None else self._proc.pid

    def send(self, message: EngineCoreRequest) -> bool:
        """Queues `message` for the core; never blocks. False when no core is connected.

        A core that failed to load (or crashed) may take seconds to exit (a GPU tearing down
        CUDA), so a send must never wait on it: the transport buffers, and with no channel
        (never connected, or closed) a send fails at once. Unconnected means exited or
        exiting; the watcher (`wait_exit`) then fails every request in flight."""
        channel = self._channel
        return channel is not None and channel.send(self._encoder.encode(message))

    async def wait_exit(self) -> int | None:
        """Returns the core's exit code once its process has exited.

        Waits on the process's sentinel (a descriptor that becomes readable when it exits), not
        by polling: a wake-up a tenth of a second in the front's process costs the engine's
        threads CPU time for as long as the server runs."""
        proc = self._proc
        assert proc is not None, "the core was never started"
        if proc.is_alive():
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(proc.sentinel, on_exit)
            try:
                await exited
            finally:
                loop.remove_reader(proc.sentinel)
        proc.join()  # reaps it, so exitcode is set
        return proc.exitcode

    async def stop(self) -> None:
        """Stops the core: ShutdownCore, then SIGTERM, then SIGKILL, each after a grace period."""
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive() and self.send(ShutdownCore()):
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.terminate()
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        proc.join(timeout=0)

    def close(self) -> None:
        """Closes the sockets and removes the socket folder (after `stop`)."""
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            self._channel.close()
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _ready_or_raise(event: EngineCoreEvent) -> CoreReady:
    if isinstance(event, CoreReady):
        return event
    if isinstance(event, CoreFailed):
        raise ModelLoadError(f"the engine failed to start: {event.error_type}: {event.message}")
    raise EngineDeadError(f"unexpected first message from the engine core: {type(event).__name__}")


async def _wait_exit(proc: BaseProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
