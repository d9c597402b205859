"""The shared admission helpers: the shorten-only timeout rule, Retry-After, the lazy heap."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.admission.lazy_heap import LazyHeap
from inferd.admission.retry_after import CompletionRate
from inferd.admission.timeouts import deadline_at, effective_timeout


def test_a_request_timeout_only_shortens_the_server_default() -> None:
    assert effective_timeout(30.0, 5.0) == 5.0
    assert effective_timeout(30.0, 90.0) == 30.0
    assert effective_timeout(None, 5.0) == 5.0
    assert effective_timeout(30.0, None) == 30.0
    assert effective_timeout(None, None) is None
    assert deadline_at(100.0, 30.0, 5.0) == 105.0
    assert deadline_at(100.0, None, None) is None


def test_retry_after_is_one_second_without_history() -> None:
    rate = CompletionRate()
    assert rate.retry_after(100) == 1.0
    rate.record(0.0)
    assert rate.retry_after(100) == 1.0


def test_retry_after_follows_the_completion_rate_within_bounds() -> None:
    rate = CompletionRate()
    for t in range(11):  # 10 completions per 10 s after the first: 1 per second
        rate.record(float(t))
    assert rate.per_second() == pytest.approx(1.0)
    assert rate.retry_after(5) == 5.0
    assert rate.retry_after(0) == 1.0
    assert rate.retry_after(10_000) == 60.0


def test_retry_after_counts_rows() -> None:
    rate = CompletionRate()
    rate.record(0.0, 8)  # opens the window; its rows finished before it
    rate.record(2.0, 8)
    assert rate.per_second() == pytest.approx(4.0)
    assert rate.retry_after(20) == 5.0


def test_retry_after_with_all_completions_at_one_instant() -> None:
    rate = CompletionRate()
    rate.record(1.0)
    rate.record(1.0)
    assert rate.retry_after(1000) == 1.0


def test_lazy_heap_skips_dead_items_and_keeps_push_order_among_equals() -> None:
    dead: set[str] = set()
    heap: LazyHeap[int, str] = LazyHeap(lambda s: s not in dead)
    for key, item in [(2, "b"), (1, "a"), (2, "c"), (3, "d")]:
        heap.push(key, item)
    dead.add("a")
    assert heap.peek() == (2, "b")
    assert heap.pop_through(2) == ["b", "c"]
    assert heap.pop() == (3, "d")
    assert heap.pop() is None


def test_lazy_heap_compacts_dead_items() -> None:
    live: set[int] = set()
    heap: LazyHeap[int, int] = LazyHeap(lambda i: i in live)
    for i in range(1000):
        heap.push(i, i)
        heap.compact(len(live))
    assert len(heap) <= 32 + 1


@settings(deadline=None)  # a loaded 2-core box must not fail a pure test
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=60))
def test_lazy_heap_pops_live_items_in_key_then_push_order(items: list[tuple[int, bool]]) -> None:
    alive = {i for i, (_, keep) in enumerate(items) if keep}
    heap: LazyHeap[int, int] = LazyHeap(lambda i: i in alive)
    for i, (key, _) in enumerate(items):
        heap.push(key, i)
    popped = []
    while (top := heap.pop()) is not None:
        popped.append(top[1])
    assert popped == sorted(alive, key=lambda i: (items[i][0], i))
