"""The client of one engine core process: spawn it, watch it, talk to it, stop it.

    core = EngineCoreClient()
    ready = await core.start(config, env, timeout_s=600)  # CoreReady (info + tokenizer path)
    core.send(AddRequest(...))                         # never blocks; False: no core
    async for event in core.events():                  # EngineOutputs, as the core sends them
        ...
    exit_code = await core.wait_exit()                 # returns when the process has exited
    await core.stop(); core.close()

The client binds both ipc:// sockets in a private temporary folder and the spawned core
connects to them (inferd.engine.core_proc). Sends never block: the high-water marks are
unbounded, a send is a memcpy into zmq's queue, and one with no core connected fails at once.
It knows nothing of requests: admission and streams are the caller's (inferd.engine.async_client).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from inferd.config import EngineConfig, Environment
from inferd.engine.core_proc import run_engine_core
from inferd.engine.messages import (
    CoreFailed,
    CoreReady,
    EngineCoreEvent,
    EngineCoreRequest,
    EngineOutputs,
    KVBlocks,
    ShutdownCore,
)
from inferd.errors import EngineDeadError, ModelLoadError

_POLL_INTERVAL_S = 0.1
_SHUTDOWN_GRACE_S = 5.0


class EngineCoreClient:
    """One engine core process and the two sockets to it. `close()` releases everything."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="inferd-ipc-"))
        self._input_address = f"ipc://{self._dir / 'input'}"
        self._output_address = f"ipc://{self._dir / 'output'}"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(self._input_address)
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self._proc: BaseProcess | None = None
        self._closed = False

    async def start(self, config: EngineConfig, env: Environment, timeout_s: float) -> CoreReady:
        """Spawns the core and waits for its CoreReady.

        Raises ModelLoadError if the core reports a load failure, EngineDeadError if it exits
        or stays silent past `timeout_s`."""
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=run_engine_core,
            args=(config, env, self._input_address, self._output_address),
            name="inferd-engine-core",
            daemon=True,
        )
        self._proc = proc
        await asyncio.to_thread(proc.start)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(TimeoutError):
                frame = await asyncio.wait_for(self._output.recv(), _POLL_INTERVAL_S)
                return _ready_or_raise(self._decoder.decode(frame))
            if not proc.is_alive():
                raise EngineDeadError(
                    f"the engine core exited with code {proc.exitcode} while loading the model"
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not load the model in {timeout_s} s")

    @property
    def pid(self) -> int | None:
        """The core process's id once started."""
        return None if self._proc is None else self._proc.pid

    def send(self, message: EngineCoreRequest) -> bool:
        """Queues `message` for the core; never blocks. False when no core is connected.

        A PUSH socket with no connected peer blocks in send, so a core that failed to load (or
        crashed) but whose process had not yet exited froze the front's event loop: seen on a
        GPU, where a failed core took seconds to tear down CUDA while the front, shutting down,
        sent it ShutdownCore. Unconnected means exited or exiting; the watcher (`wait_exit`)
        then fails every request in flight."""
        try:
            self._input.send(self._encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def events(self) -> AsyncIterator[EngineOutputs | KVBlocks]:
        """The core's step outputs and block digests, in order, until cancelled. A frame that
        does not decode raises: a broken message stream is as fatal as a dead core."""
        while True:
            frame = await self._output.recv(copy=False)
            event = self._decoder.decode(frame.buffer)
            if isinstance(event, EngineOutputs | KVBlocks):
                yield event

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
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        self._actx.term()
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
