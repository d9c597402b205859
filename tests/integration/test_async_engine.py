"""AsyncLLM against a real engine core process on inferd-tiny (random weights).

Two engines, each started once per module: `roomy` (default batching) checks streaming against the
offline LLM, aborts, deadlines while generating and drain; `narrow` (one sequence at a time, a
3-request queue, tiny output buffer) checks queue bounds, queue deadlines, priority order, slow
readers and engine death. Every test runs its coroutine on the engine's own event loop.

Where a test needs a request still running at some point, it pauses the engine core process
(SIGSTOP, `paused`) instead of hoping a generation is long enough; waits are on the engine's state
(`until`), never a sleep that guesses how long something takes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

from inferd import LLM, SamplingParams
from inferd.config import AdmissionConfig, EngineConfig
from inferd.engine.async_client import AsyncLLM
from inferd.engine.core_client import EngineCoreClient
from inferd.engine.generate_request import GenerateRequest
from inferd.engine.messages import ShutdownCore
from inferd.errors import (
    DrainingError,
    EngineDeadError,
    OutputBacklogError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.types import RequestOutput

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
KV = 64 << 20
PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "In a hole in the ground there lived",
    "It was the best of times",
    "Call me",
    "All happy families are alike",
]


class Harness:
    """One AsyncLLM on one event loop, kept for the whole module."""

    def __init__(self, config: EngineConfig, limits: AdmissionConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.llm = self.run(AsyncLLM.start(config, limits))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 60))

    def close(self) -> None:
        self.run(self.llm.shutdown())
        self.loop.close()


def _config(**kw: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(dtype="float32", kv_cache_memory=KV, **kw)


@pytest.fixture(scope="module")
def roomy() -> Iterator[Harness]:
    h = Harness(_config(max_num_batched_tokens=256), AdmissionConfig())
    yield h
    h.close()


@pytest.fixture(scope="module")
def narrow() -> Iterator[Harness]:
    # One engine slot and a 3-deep queue. The output backlog bound is out of the way: a hog that
    # its reader fell 16 tokens behind on (a few ms of the tiny model's decode on a loaded
    # machine) was aborted, freed the slot, and let a request meant to time out in the queue in.
    limits = AdmissionConfig(
        max_queued_requests=3,
        max_queued_tokens=10_000,
        max_pending_output_tokens=1_000_000,
        min_engine_waiting=0,
    )
    h = Harness(_config(max_num_seqs=1), limits)
    yield h
    h.close()


@pytest.fixture(scope="module")
def backlog() -> Iterator[Harness]:
    """An engine whose streams may hold at most 16 unread output tokens."""
    h = Harness(_config(max_num_seqs=1), AdmissionConfig(max_pending_output_tokens=16))
    yield h
    h.close()


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


def _joined(deltas: list[RequestOutput]) -> tuple[str, list[int], str | None]:
    text = "".join(d.outputs[0].text for d in deltas)
    ids = [t for d in deltas for t in d.outputs[0].token_ids]
    return text, ids, deltas[-1].outputs[0].finish_reason


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()


@contextmanager
def paused(h: Harness) -> Iterator[None]:
    """The engine core stopped (SIGSTOP) for the block: it makes no step, so nothing it runs can
    finish meanwhile; the front (admission, queue deadlines, streams) goes on."""
    pid = h.llm._core.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Returns once `condition()` holds, checking between the loop's other work."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


def _refused_at_once(stream: AsyncIterator[RequestOutput]) -> Exception:
    """The error the stream's first read raises without waiting for anything: a read that waited
    (in the queue, for the engine) would hand control back to the loop instead of raising."""
    step = stream.__anext__()
    assert isinstance(step, Coroutine)
    try:
        step.send(None)
    except StopIteration:
        raise AssertionError("the first read returned an output") from None
    except Exception as e:  # the caller checks which
        return e
    step.close()
    raise AssertionError("the first read waited instead of being refused")


def _long(h: Harness, rid: str, **kw: Any) -> AsyncIterator[RequestOutput]:
    """A request that runs for the rest of the context window unless stopped."""
    ids = h.llm.tokenizer.encode("a long story")
    room = h.llm.info.max_model_len - len(ids)
    return h.llm.generate(GenerateRequest(rid, ids, _greedy(room), **kw))


# -- roomy ----------------------------------------------------------------------------------------


def test_streams_match_offline_greedy(roomy: Harness) -> None:
    llm = roomy.llm
    params = _greedy(24, logprobs=2)
    offline = LLM(dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=256)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    del offline

    async def main() -> list[list[RequestOutput]]:
        streams = [
            llm.generate(GenerateRequest(f"m{i}", llm.tokenizer.encode(p), params, prompt=p))
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*(_collect(s) for s in streams))

    results = roomy.run(main())
    for deltas, want in zip(results, expected, strict=True):
        text, ids, reason = _joined(deltas)
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        assert ids == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert reason == "length"
        logprobs = [lp for d in deltas for lp in d.outputs[0].logprobs or []]
        assert len(logprobs) == len(ids)
        assert deltas[-1].prompt == want.prompt
        assert deltas[-1].metrics.detokenize_s > 0.0


def test_closing_the_iterator_aborts_and_frees_blocks(roomy: Harness) -> None:
    llm = roomy.llm

    async def main() -> None:
        streams = [_long(roomy, f"abort{i}") for i in range(3)]
        for s in streams:
            await _first(s)
        assert llm.stats().kv_cache_usage > 0.0
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while llm.stats().kv_cache_usage > 0.0 or llm.stats().running:
            assert time.monotonic() < deadline, llm.stats()
            await asyncio.sleep(0.01)
        assert llm.stats().in_flight == 0

    roomy.run(main())


def test_running_past_deadline_finishes_with_timeout(roomy: Harness) -> None:
    async def main() -> list[RequestOutput]:
        stream = _long(roomy, "deadline", timeout_s=0.3)
        first = await _first(stream)
        # Paused after its first token, the request outlasts its deadline on any machine.
        with paused(roomy):
            await asyncio.sleep(0.3)
        return [first, *await _collect(stream)]

    deltas = roomy.run(main())
    _, ids, reason = _joined(deltas)
    assert reason == "timeout" and ids


def test_abort_by_id(roomy: Harness) -> None:
    async def main() -> list[RequestOutput]:
        stream = _long(roomy, "byid")
        first = await _first(stream)
        await roomy.llm.abort("byid")
        return [first, *await _collect(stream)]

    deltas = roomy.run(main())
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"


def test_drain_finishes_in_flight_then_refuses(roomy: Harness) -> None:
    llm = roomy.llm

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        # Both accepted while the core is paused, so both are in flight when the drain starts.
        with paused(roomy):
            short = asyncio.ensure_future(
                _collect(llm.generate(GenerateRequest("d1", [5, 6, 7], _greedy(8))))
            )
            long = asyncio.ensure_future(_collect(_long(roomy, "d2")))
            await until(lambda: llm.stats().in_flight == 2)
            drain = asyncio.ensure_future(llm.drain(timeout_s=2.0))
            await asyncio.sleep(0)
            assert not llm.ready
        with pytest.raises(DrainingError):
            await _first(llm.generate(GenerateRequest("d3", [5, 6, 7], _greedy(4))))
        # 8 tokens finish inside the drain's 2 s even on a loaded machine; the long one (the
        # rest of the context window) is then held paused until the drain's deadline passed.
        done = await short
        with paused(roomy):
            await drain
        return done, await long

    short, long = roomy.run(main())
    assert _joined(short)[2] == "length" and len(_joined(short)[1]) == 8
    assert _joined(long)[2] == "abort"


# -- narrow ---------------------------------------------------------------------------------------


def test_queue_full_rejects_at_once(narrow: Harness) -> None:
    llm = narrow.llm

    async def main() -> None:
        hog = _long(narrow, "hog")
        await _first(hog)
        # Read the hog as a client would while the test goes on.
        reader = asyncio.ensure_future(_collect(hog))
        with paused(narrow):  # the hog holds the only slot until the block ends
            queued = [llm.generate(GenerateRequest(f"q{i}", [5, 6], _greedy(2))) for i in range(3)]
            tasks = [asyncio.ensure_future(_collect(q)) for q in queued]
            await until(lambda: llm.stats().queued == 3)
            assert llm.stats().queued_prompt_tokens == 6
            error = _refused_at_once(llm.generate(GenerateRequest("over", [5, 6], _greedy(2))))
            assert isinstance(error, QueueFullError), error
            assert error.retry_after >= 1
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        for t in tasks:
            assert _joined(await t)[2] == "length"

    narrow.run(main())


def test_queue_timeout(narrow: Harness) -> None:
    async def main() -> None:
        hog = _long(narrow, "hog2")
        await _first(hog)
        # Read the hog as a client would while the test goes on.
        reader = asyncio.ensure_future(_collect(hog))
        with paused(narrow):  # the hog holds the only slot until the block ends
            t0 = time.monotonic()
            with pytest.raises(QueueTimeoutError):
                await _first(
                    narrow.llm.generate(GenerateRequest("late", [5, 6], _greedy(2), timeout_s=0.2))
                )
            assert time.monotonic() - t0 >= 0.2
            assert narrow.llm.stats().queued == 0
            assert not reader.done()  # failed by its own deadline, not let in by the hog's end
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    narrow.run(main())


def test_priority_order(narrow: Harness) -> None:
    llm = narrow.llm

    async def scheduled_at(rid: str, priority: int) -> float:
        params = _greedy(3)
        deltas = await _collect(
            llm.generate(GenerateRequest(rid, [5, 6, 7], params, priority=priority))
        )
        assert _joined(deltas)[2] == "length"
        first = deltas[-1].metrics.first_scheduled_time
        assert first is not None
        return first

    async def main() -> list[float]:
        hog = _long(narrow, "hog3")
        await _first(hog)
        # Read the hog as a client would while the test goes on.
        reader = asyncio.ensure_future(_collect(hog))
        with paused(narrow):  # all three wait in the queue behind the hog
            tasks = [
                asyncio.ensure_future(scheduled_at(r, p))
                for r, p in [("lo1", 1), ("lo2", 1), ("hi", 0)]
            ]
            await until(lambda: llm.stats().queued == 3)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        return list(await asyncio.gather(*tasks))

    lo1, lo2, hi = narrow.run(main())
    # The order the engine scheduled them in, by its own clock.
    assert hi < lo1 < lo2


def test_slow_reader_is_aborted(backlog: Harness) -> None:
    async def main() -> None:
        stream = _long(backlog, "slow")
        await _first(stream)
        # The engine runs on; past 16 unread tokens the front drops the request's stream.
        await until(lambda: "slow" not in backlog.llm._streams, timeout_s=60)
        with pytest.raises(OutputBacklogError):
            await _collect(stream)
        deadline = time.monotonic() + 5
        while backlog.llm.stats().running:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    backlog.run(main())


def test_engine_death_fails_in_flight(narrow: Harness) -> None:
    llm = narrow.llm

    async def main() -> None:
        stream = _long(narrow, "doomed")
        queued = llm.generate(GenerateRequest("queued", [5, 6], _greedy(2)))
        waiter = asyncio.ensure_future(_first(queued))
        await _first(stream)
        pid = llm._core.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(stream), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 5)
        assert llm.dead and not llm.ready
        with pytest.raises(EngineDeadError):
            await _first(llm.generate(GenerateRequest("after", [5, 6], _greedy(2))))

    narrow.run(main())


def test_stopping_a_core_that_never_connected_does_not_block() -> None:
    # A core that failed to load and is still tearing down (seconds on a GPU) has closed its
    # sockets while its process lives. Stopping it must not wait on a send nobody receives.
    core = EngineCoreClient()
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    core._proc = proc
    try:
        assert not core.send(ShutdownCore())
        t0 = time.monotonic()
        asyncio.run(asyncio.wait_for(core.stop(), timeout=30))
        assert not proc.is_alive()
        assert time.monotonic() - t0 < 5.0, "stop waited out the grace period for a reply"
    finally:
        proc.kill()
        core.close()
