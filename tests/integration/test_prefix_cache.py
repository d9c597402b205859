"""Prefix caching on the built-in tiny model: a request that shares a long prefix with an earlier
one reports cached tokens, the engine's counters move, and KV events arrive over ZeroMQ with the
stable hashes of the prompt's blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from inferd import LLM, SamplingParams
from inferd.engine.llm_engine import TokensPrompt
from inferd.kv_cache.block_hash import block_hashes
from inferd.kv_cache.events import (
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    kv_event_batches,
)

BLOCK = 16
SHARED = [(i * 37) % 3000 + 10 for i in range(96)]  # 6 full blocks
# Events the tests publish themselves, beside the engine's: no block has a negative hash.
PROBE, MARKER = BlockRemoved([-1]), BlockRemoved([-2])


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=n)


def _prompt(suffix: list[int]) -> TokensPrompt:
    return {"prompt_token_ids": [*SHARED, *suffix]}


def _endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A socket path (short: ZeroMQ's ipc paths are bounded), so no port is raced for."""
    return f"ipc://{tmp_path_factory.mktemp('kv')}/kv"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory=64 << 20, block_size=BLOCK)


def test_a_shared_prefix_is_reported_cached_and_counted(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler.prefix_cache
    queries, hits = stats.queries, stats.hits
    (first,) = llm.generate(_prompt([5, 6, 7]), _params(), use_tqdm=False)
    (second,) = llm.generate(_prompt([8, 9]), _params(), use_tqdm=False)
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == len(SHARED)
    assert stats.queries - queries == 2 * len(SHARED) + 5
    assert stats.hits - hits == len(SHARED)


def test_n_choices_count_their_prompt_once(llm: LLM) -> None:
    (out,) = llm.generate(_prompt([11, 12, 13]), _params(n=3), use_tqdm=False)
    assert len(out.outputs) == 3
    assert out.metrics.num_cached_tokens == len(SHARED)


def _connect(publisher: KVEventPublisher, subscriber: KVEventSubscriber) -> int:
    """Publishes a probe until the subscriber receives one (PUB drops what it sends before a
    subscription has reached it), then a last probe, read up to: nothing published earlier is
    still on the way. Returns the seq the next batch will carry."""
    deadline = time.monotonic() + 30
    while subscriber.receive(timeout_s=0.05) is None:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        publisher.publish([PROBE])
    publisher.publish([MARKER])
    while (received := subscriber.receive(timeout_s=30)) is not None:
        if received.batch.events == [MARKER]:
            return received.batch.seq + 1
    raise AssertionError("the last probe never arrived")


@pytest.fixture
def llm_with_events(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LLM, KVEventSubscriber, int]]:
    endpoint = _endpoint(tmp_path_factory)
    llm = LLM(
        dtype="float32", kv_cache_memory=16 << 20, block_size=BLOCK, kv_events_endpoint=endpoint
    )
    subscriber = KVEventSubscriber(endpoint)
    publisher = llm.llm_engine.kv_events
    assert publisher is not None
    next_seq = _connect(publisher, subscriber)
    yield llm, subscriber, next_seq
    subscriber.close()
    publisher.close()


def test_kv_events_carry_the_stable_hashes_of_the_prompt_blocks(
    llm_with_events: tuple[LLM, KVEventSubscriber, int],
) -> None:
    llm, subscriber, expected_seq = llm_with_events
    prompt = [*SHARED, 3, 4]
    llm.generate(_prompt([3, 4]), _params(), use_tqdm=False)
    # A marker after the generation: what arrives before it is all the generation published.
    publisher = llm.llm_engine.kv_events
    assert publisher is not None
    publisher.publish([MARKER])
    stored: list[int] = []
    while (received := subscriber.receive(timeout_s=30)) is not None:
        assert not received.gap and received.batch.seq == expected_seq
        expected_seq += 1
        if received.batch.events == [MARKER]:
            break
        for event in received.batch.events:
            assert isinstance(event, BlockStored) and event.block_size == BLOCK
            stored += event.block_hashes
    assert stored == block_hashes(prompt, BLOCK)


def test_an_asyncio_subscriber_sees_numbered_batches_and_a_gap_when_it_joins_late(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    endpoint = _endpoint(tmp_path_factory)
    publisher = KVEventPublisher(endpoint)
    stored = BlockStored([1, 2], None, list(range(2 * BLOCK)), BLOCK)

    async def receive() -> list[ReceivedBatch]:
        batches = kv_event_batches(endpoint)
        first = asyncio.ensure_future(anext(batches))
        # Publish until the subscription has reached the publisher (PUB drops until then).
        while not first.done():
            publisher.publish([stored])
            await asyncio.sleep(0.05)
        publisher.publish([BlockRemoved([1])])
        received = [first.result()]
        while received[-1].batch.events != [BlockRemoved([1])]:
            received.append(await asyncio.wait_for(anext(batches), 5.0))
        await batches.aclose()
        return received

    try:
        received = asyncio.run(receive())
    finally:
        publisher.close()
    first, *rest = received
    assert first.batch.events == [stored]
    assert first.gap == (first.batch.seq != 0)
    for before, batch in zip(received, rest, strict=False):
        assert not batch.gap and batch.batch.seq == before.batch.seq + 1
