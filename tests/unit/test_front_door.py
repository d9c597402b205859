"""The front door without an engine process: admission bounds, Retry-After, queue deadlines and
the release policy, driven by `(now, engine load)`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from inferd.admission.front_door import KV_HIGH_WATERMARK, FrontDoor
from inferd.config import AdmissionConfig
from inferd.errors import QueueFullError


@dataclass(frozen=True)
class Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_added_total: int = 0


def door(max_num_seqs: int = 4, **limits: float | int | None) -> FrontDoor[str]:
    return FrontDoor(AdmissionConfig(**limits), max_num_seqs)  # type: ignore[arg-type]


def fill(d: FrontDoor[str], n: int, *, deadline: float | None = None, priority: int = 0) -> None:
    for i in range(len(d), len(d) + n):
        d.enqueue(f"r{i}", f"item{i}", num_prompt_tokens=1, priority=priority, deadline=deadline)


def everyone(_: str) -> bool:
    return True


def test_a_request_timeout_only_shortens_the_server_default() -> None:
    d = door(request_timeout_s=30.0)
    assert d.deadline_for(100.0, None) == 130.0
    assert d.deadline_for(100.0, 5.0) == 105.0
    assert d.deadline_for(100.0, 90.0) == 130.0
    assert door(request_timeout_s=None).deadline_for(100.0, None) is None


def test_full_queue_rejects_with_retry_after_from_the_completion_rate() -> None:
    d = door(max_queued_requests=4)
    fill(d, 4)
    with pytest.raises(QueueFullError) as no_history:
        fill(d, 1)
    assert no_history.value.retry_after == 1.0 and no_history.value.reason == "requests"
    for t in range(3):  # two completions per second after the first
        d.record_finish(float(t) / 2)
    with pytest.raises(QueueFullError) as with_history:
        fill(d, 1)
    assert with_history.value.retry_after == 2.0  # 4 queued at 2/s
    assert len(d) == 4


def test_token_bound_rejects_with_reason_tokens() -> None:
    d = door(max_queued_tokens=10)
    d.enqueue("a", "A", num_prompt_tokens=8, priority=0, deadline=None)
    with pytest.raises(QueueFullError) as e:
        d.enqueue("b", "B", num_prompt_tokens=3, priority=0, deadline=None)
    assert e.value.reason == "tokens" and d.num_prompt_tokens == 8


def test_expire_returns_only_requests_past_their_deadline() -> None:
    d = door()
    d.enqueue("soon", "S", num_prompt_tokens=1, priority=0, deadline=10.0)
    d.enqueue("later", "L", num_prompt_tokens=1, priority=0, deadline=20.0)
    d.enqueue("never", "N", num_prompt_tokens=1, priority=0, deadline=None)
    assert d.time_to_next_deadline(4.0) == 6.0
    assert d.expire(9.0) == []
    assert [e.request_id for e in d.expire(10.0)] == ["soon"]
    assert d.time_to_next_deadline(25.0) == 0.0
    assert [e.request_id for e in d.expire(25.0)] == ["later"]
    assert d.time_to_next_deadline(25.0) == math.inf and len(d) == 1


def test_release_fills_free_sequence_slots_in_priority_order() -> None:
    d = door(max_num_seqs=3, min_engine_waiting=0)
    d.enqueue("low", "L", num_prompt_tokens=1, priority=5, deadline=None)
    fill(d, 3, priority=0)
    released = d.release(Load(), everyone)
    assert [e.item for e in released] == ["item1", "item2", "item3"]
    # Released but not yet received by the engine: they fill the slots, nothing more goes.
    assert d.release(Load(), everyone) == []
    assert d.release(Load(num_running=3, num_added_total=3), everyone) == []
    assert [e.item for e in d.release(Load(num_running=2, num_added_total=3), everyone)] == ["L"]


def test_release_keeps_min_engine_waiting_in_the_engine() -> None:
    d = door(max_num_seqs=2, min_engine_waiting=4)
    fill(d, 10)
    assert len(d.release(Load(num_running=2), everyone)) == 4
    assert d.release(Load(num_running=2, num_waiting=4, num_added_total=4), everyone) == []
    assert len(d.release(Load(num_running=2, num_waiting=1, num_added_total=4), everyone)) == 3


def test_release_past_the_kv_watermark_ignores_free_slots() -> None:
    d = door(max_num_seqs=8, min_engine_waiting=1)
    fill(d, 10)
    full = Load(num_running=1, kv_cache_usage=KV_HIGH_WATERMARK)
    assert len(d.release(full, everyone)) == 1
    roomy = Load(num_running=1, kv_cache_usage=0.5, num_added_total=1)
    assert len(d.release(roomy, everyone)) == 7


def test_release_drops_requests_nobody_waits_for_without_counting_them() -> None:
    d = door(max_num_seqs=2, min_engine_waiting=0)
    fill(d, 4)
    released = d.release(Load(), lambda rid: rid != "r0")
    assert [e.request_id for e in released] == ["r1", "r2"]
    assert len(d) == 1 and d.engine_room(Load(num_added_total=2)) == 2


def test_remove_and_clear() -> None:
    d = door()
    fill(d, 3)
    entry = d.remove("r1")
    assert entry is not None and entry.item == "item1" and "r1" not in d
    assert d.remove("r1") is None
    assert [e.request_id for e in d.clear()] == ["r0", "r2"]
    assert len(d) == 0 and d.num_prompt_tokens == 0
