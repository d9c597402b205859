"""The front-core channel (engine/core_channel.py): frames cut right however the bytes arrive,
both ends over a real Unix socket, sends that never block, and each end seeing the other go."""

from __future__ import annotations

import asyncio
import itertools
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.core_channel import CoreSocket, FrameProtocol, FrameSplitter, frame


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
)
def test_frames_come_out_whole_and_in_order_however_the_stream_is_cut(
    payloads: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    splitter = FrameSplitter()
    out: list[bytes] = []
    for a, b in itertools.pairwise(bounds):
        out += splitter.feed(stream[a:b])
    assert out == payloads


def test_a_partial_frame_waits_for_the_rest() -> None:
    splitter = FrameSplitter()
    data = frame(b"hello") + frame(b"world")
    assert splitter.feed(data[:3]) == []  # not even the whole header
    assert splitter.feed(data[3:12]) == [b"hello"]
    assert splitter.feed(data[12:]) == [b"world"]
    assert splitter.feed(frame(b"")) == [b""]


class _Front:
    """A listening front on a real Unix socket, its protocol's frames and losses recorded."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.path = str(Path(self.dir.name) / "core.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.listener.setblocking(False)
        self.frames: list[bytes] = []
        self.lost: list[Exception | None] = []
        self.protocol: FrameProtocol | None = None

    async def accept(self) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        sock, _ = await loop.sock_accept(self.listener)
        _, self.protocol = await loop.connect_accepted_socket(
            lambda: FrameProtocol(self.frames.append, self.lost.append), sock
        )
        return self.protocol

    def close(self) -> None:
        self.listener.close()
        self.dir.cleanup()


@pytest.fixture
def front() -> Iterator[_Front]:
    f = _Front()
    yield f
    f.close()


def test_core_and_front_exchange_frames_both_ways(front: _Front) -> None:

    async def main() -> None:
        loop = asyncio.get_running_loop()
        core = await loop.run_in_executor(None, CoreSocket, front.path)
        protocol = await front.accept()
        assert protocol.send(b"add") and protocol.send(b"abort")
        got: list[bytes] = []
        while len(got) < 2:
            got += await loop.run_in_executor(None, core.receive, 1000)
        assert got == [b"add", b"abort"]
        for i in range(50):
            core.send(b"step %d" % i)
        while len(front.frames) < 50:
            await asyncio.sleep(0.01)
        assert front.frames == [b"step %d" % i for i in range(50)]
        assert core.receive(0) == [] and not core.closed
        core.close(1.0)
        while not front.lost:
            await asyncio.sleep(0.01)
        assert front.lost == [None]  # the core closed its end: no error, but the stream is over
        assert not protocol.send(b"late")

    asyncio.run(main())


def test_a_send_larger_than_the_socket_takes_never_blocks_and_arrives_whole(front: _Front) -> None:
    # The front reads nothing until the core has sent 8 MiB (the socket holds a few hundred
    # KiB): every send returns at once, the rest waits in the core, and `receive` sends it on
    # as the front reads.
    big = bytes(range(256)) * (8 << 12)  # 8 MiB

    async def main() -> None:
        loop = asyncio.get_running_loop()
        core = await loop.run_in_executor(None, CoreSocket, front.path)
        sock, _ = await loop.sock_accept(front.listener)  # accepted, but nobody reads yet
        returned = threading.Event()

        def send_all() -> None:
            core.send(big)
            core.send(b"after")
            returned.set()

        threading.Thread(target=send_all).start()
        assert await loop.run_in_executor(None, returned.wait, 10), "a send blocked"
        _, front.protocol = await loop.connect_accepted_socket(
            lambda: FrameProtocol(front.frames.append, front.lost.append), sock
        )
        for _ in range(1000):
            if len(front.frames) == 2:
                break
            await loop.run_in_executor(None, core.receive, 10)  # flushes as the socket drains
        assert front.frames == [big, b"after"]
        core.close(1.0)

    asyncio.run(main())


def test_the_core_sees_the_front_go(front: _Front) -> None:

    async def main() -> None:
        loop = asyncio.get_running_loop()
        core = await loop.run_in_executor(None, CoreSocket, front.path)
        protocol = await front.accept()
        protocol.send(b"last words")
        protocol.close()
        got: list[bytes] = []
        for _ in range(100):
            got += await loop.run_in_executor(None, core.receive, 100)
            if core.closed:
                break
        assert got == [b"last words"] and core.closed
        core.send(b"nobody listens")  # must neither raise nor block
        core.close(0.1)
        assert front.lost == []  # a close the front asked for is not a broken stream

    asyncio.run(main())


def test_a_callback_that_raises_ends_the_stream_once(front: _Front) -> None:
    lost: list[Exception | None] = []

    def on_frame(payload: bytes) -> None:
        raise ValueError(payload.decode())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        core = await loop.run_in_executor(None, CoreSocket, front.path)
        sock, _ = await loop.sock_accept(front.listener)
        _, protocol = await loop.connect_accepted_socket(
            lambda: FrameProtocol(on_frame, lost.append), sock
        )
        core.send(b"bad")
        core.send(b"worse")
        # Until the transport has reported its end (connection_lost clears it): the one other
        # place a second loss could come from.
        while protocol.transport is not None:
            await asyncio.sleep(0.01)
        assert len(lost) == 1 and isinstance(lost[0], ValueError) and str(lost[0]) == "bad"
        core.close(0.1)

    asyncio.run(main())
