"""The channel between the server's front and its engine core: one Unix stream socket carrying
msgpack messages (engine/messages.py), each framed as a 4-byte little-endian length and the bytes.

    front (asyncio, engine/core_client.py)       core (its blocking step loop, core_proc.py)
    listens on DIR/core.sock; accepts once  ◄─── CoreSocket(path): connects at start
    FrameProtocol: frames → callback        ◄─── CoreSocket.send(payload): never blocks
    transport.write(frame(payload))          ───► CoreSocket.receive(timeout_ms): frames in

Why a plain socket and not ZeroMQ (which this used to be): a ZeroMQ message crosses two I/O
threads, so every step's outputs cost two extra thread wake-ups, and pyzmq's asyncio socket ran
~15 Python-level flag operations and futures per message on the front's event loop. On two cores
each wake-up takes its turn from the engine's OpenMP threads. Here the core's own `send` wakes
the front's event loop and uvloop's C transport reads the bytes (docs/benchmarks.md, "One socket
between the front and the core").

Neither side ever blocks on the other:
  - the front writes through its asyncio transport, which buffers what the kernel does not take;
  - the core sends without blocking and keeps what the kernel did not take in `pending`, sent on
    its next `send` or `receive` (which waits for the socket to take more while it has nothing
    else to do). Both queues are unbounded, as ZeroMQ's were with high-water marks of 0: the
    front bounds what it admits, and a step's outputs are a few KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import cast

_HEADER = struct.Struct("<I")
_RECV_BYTES = 1 << 18


def frame(payload: bytes) -> bytes:
    """`payload` behind its length: one frame, ready to write."""
    return _HEADER.pack(len(payload)) + payload


class FrameSplitter:
    """Cuts a byte stream into the frames it carries; keeps a partial frame for the next bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        if not buf:
            frames, used = _split(data)
            if used < len(data):
                buf += memoryview(data)[used:]
            return frames
        buf += data
        frames, used = _split(buf)
        del buf[:used]
        return frames


def _split(data: bytes | bytearray) -> tuple[list[bytes], int]:
    """The whole frames at the start of `data`, and how many bytes they took."""
    frames: list[bytes] = []
    off, end = 0, len(data)
    with memoryview(data) as view:  # one copy per frame, and released before the caller trims
        while end - off >= 4:
            (n,) = _HEADER.unpack_from(view, off)
            if end - off - 4 < n:
                break
            frames.append(view[off + 4 : off + 4 + n].tobytes())
            off += 4 + n
    return frames, off


class FrameProtocol(asyncio.Protocol):
    """The front's end: hands each frame to `on_frame`, and `on_lost` the reason the stream
    ended (an exception, or None when the core closed it). A callback that raises ends the
    stream: the message stream is then as broken as a dead core."""

    def __init__(
        self, on_frame: Callable[[bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._splitter = FrameSplitter()
        self.transport: asyncio.Transport | None = None
        self._failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence a cast, not a check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._failed:
            return
        try:
            for payload in self._splitter.feed(data):
                self._on_frame(payload)
        except Exception as e:
            self._failed = True
            self._on_lost(e)
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self._failed:
            self._failed = True
            self._on_lost(exc)

    def send(self, payload: bytes) -> bool:
        """Queues one frame; never blocks. False once the stream is closed (or not yet open)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(frame(payload))
        return True

    def close(self) -> None:
        self._failed = True  # a close we asked for is not a broken stream
        if self.transport is not None:
            self.transport.close()


class CoreSocket:
    """The core's end, for a blocking loop: `send` never blocks, `receive` waits at most as long
    as it is told. `closed` turns True once the front has closed its end."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.setblocking(False)
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._splitter = FrameSplitter()
        self._pending = bytearray()
        self._mask = select.POLLIN
        self.closed = False

    def send(self, payload: bytes) -> None:
        """Sends one frame, or as much as the socket takes now; the rest waits in `pending`."""
        data = frame(payload)
        if self._pending:  # frames go out in order, after what still waits
            self._pending += data
            self._flush()
            return
        sent = self._send(data)
        if sent < len(data):
            self._pending += memoryview(data)[sent:]
            self._watch_writable()

    def receive(self, timeout_ms: int) -> list[bytes]:
        """The frames that arrived, waiting up to `timeout_ms` for the first (0: only those
        already here). Also sends what is pending as the socket takes it."""
        frames: list[bytes] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            ready = self._poll.poll(timeout_ms)  # one descriptor: [] or [(fd, flags)]
            flags = ready[0][1] if ready else 0
            if flags & select.POLLOUT:
                self._flush()
            if flags & (select.POLLIN | select.POLLHUP | select.POLLERR):
                frames += self._read()
            timeout_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if frames or self.closed or not ready or timeout_ms == 0:
                return frames

    def close(self, linger_s: float) -> None:
        """Sends what is pending (for up to `linger_s` seconds), then closes the socket."""
        with contextlib.suppress(OSError):
            self._sock.settimeout(linger_s)
            self._sock.sendall(self._pending)
        self._pending.clear()
        self._sock.close()

    def _read(self) -> list[bytes]:
        frames: list[bytes] = []
        while True:
            try:
                data = self._sock.recv(_RECV_BYTES)
            except BlockingIOError:
                return frames
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return frames
            frames += self._splitter.feed(data)

    def _flush(self) -> None:
        if self._pending:
            del self._pending[: self._send(self._pending)]
        self._watch_writable()

    def _send(self, data: bytes | bytearray) -> int:
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:  # the front is gone: nobody will read what is pending
            self.closed = True
            return len(data)

    def _watch_writable(self) -> None:
        """Polls for room in the socket while something waits to be sent, and only then."""
        mask = select.POLLIN | (select.POLLOUT if self._pending else 0)
        if mask != self._mask:
            self._mask = mask
            self._poll.modify(self._sock.fileno(), mask)
