"""A real `inferd serve --kv-events-endpoint`: cached prompt tokens in OpenAI usage (through the
`openai` client), the prefix-cache counters on /metrics, and a subscriber receiving the stored
blocks' stable hashes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import Server, kv_events_connected, start_server, stop_server

from inferd.kv_cache.block_hash import block_hashes
from inferd.kv_cache.events import BlockStored, KVEventSubscriber

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BLOCK = 16  # the server's default --block-size
SHARED = [(i * 53) % 2000 + 20 for i in range(80)]  # 5 full blocks
SYSTEM = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, KVEventSubscriber]]:
    tmp: Path = tmp_path_factory.mktemp("prefix")
    endpoint = f"ipc://{tmp}/kv"  # a socket path: no port to race other processes for
    server = start_server(tmp, "--kv-events-endpoint", endpoint)
    subscriber = KVEventSubscriber(endpoint)
    kv_events_connected(server, subscriber)
    yield server, subscriber
    subscriber.close()
    stop_server(server)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def cached(usage: openai.types.CompletionUsage | None) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    cached_tokens = usage.prompt_tokens_details.cached_tokens
    assert cached_tokens is not None
    return cached_tokens


def test_completions_report_cached_tokens_and_the_counters_move(
    served: tuple[Server, KVEventSubscriber],
) -> None:
    server, subscriber = served
    c = client(server)
    first = c.completions.create(model="inferd-tiny", prompt=[*SHARED, 7, 8], max_tokens=2)
    assert cached(first.usage) == 0
    want = block_hashes([*SHARED, 7, 8], BLOCK)
    stored = [h for event in _stored_events(subscriber, len(want)) for h in event.block_hashes]
    assert stored == want
    before = server.metrics()
    second = c.completions.create(model="inferd-tiny", prompt=[*SHARED, 9], max_tokens=2)
    assert cached(second.usage) == len(SHARED)
    after = server.metrics()
    hits = "inferd_prefix_cache_hits_tokens_total"
    queries = "inferd_prefix_cache_queries_tokens_total"
    assert after[hits] - before[hits] == len(SHARED)
    assert after[queries] - before[queries] == len(SHARED) + 1
    info = [k for k in after if k.startswith("inferd_cache_config_info{")]
    assert len(info) == 1 and f'block_size="{BLOCK}"' in info[0]


def test_chat_reports_cached_tokens_streamed_and_not(
    served: tuple[Server, KVEventSubscriber],
) -> None:
    server, _ = served
    c = client(server)

    def messages(question: str) -> list[openai.types.chat.ChatCompletionMessageParam]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    c.chat.completions.create(model="inferd-tiny", messages=messages("Hi"), max_tokens=2)
    full = c.chat.completions.create(model="inferd-tiny", messages=messages("Why?"), max_tokens=2)
    assert cached(full.usage) >= BLOCK
    stream = c.chat.completions.create(
        model="inferd-tiny",
        messages=messages("How?"),
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and cached(usages[0]) >= BLOCK


def _stored_events(subscriber: KVEventSubscriber, num_blocks: int) -> list[BlockStored]:
    """The BlockStored events that arrive until they name `num_blocks` blocks (the subscription
    is up and nothing older is on the way: `kv_events_connected`)."""
    events: list[BlockStored] = []
    while sum(len(e.block_hashes) for e in events) < num_blocks:
        received = subscriber.receive(timeout_s=30)
        assert received is not None, "the replica's events stopped short"
        assert not received.gap
        events += [e for e in received.batch.events if isinstance(e, BlockStored)]
    return events
