"""The admission queue: bounds, priority/FIFO order, deadlines, removal (examples + hypothesis).

The property test replays random operations against a plain list model (sorted on demand, O(n)),
which is the independent reference for order, bounds and expiry.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.admission import AdmissionQueue
from inferd.errors import QueueFullError


def test_priority_then_fifo() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_requests=10, max_prompt_tokens=100)
    for rid, prio in [("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        q.push(rid, None, num_prompt_tokens=1, priority=prio)
    popped = []
    while (entry := q.pop()) is not None:
        popped.append(entry.request_id)
    assert popped == ["e", "b", "d", "a", "c"]
    assert len(q) == 0 and q.num_prompt_tokens == 0


def test_request_bound_rejects_and_changes_nothing() -> None:
    q: AdmissionQueue[int] = AdmissionQueue(max_requests=2, max_prompt_tokens=100)
    q.push("a", 1, num_prompt_tokens=5)
    q.push("b", 2, num_prompt_tokens=5)
    with pytest.raises(QueueFullError) as info:
        q.push("c", 3, num_prompt_tokens=5)
    assert info.value.reason == "requests"
    assert len(q) == 2 and q.num_prompt_tokens == 10 and "c" not in q


def test_token_bound() -> None:
    q: AdmissionQueue[int] = AdmissionQueue(max_requests=10, max_prompt_tokens=10)
    q.push("a", 1, num_prompt_tokens=6)
    with pytest.raises(QueueFullError) as info:
        q.push("b", 2, num_prompt_tokens=5)
    assert info.value.reason == "tokens"
    q.push("c", 3, num_prompt_tokens=4)  # exactly at the bound is allowed
    assert q.num_prompt_tokens == 10
    q.remove("a")
    q.push("b", 2, num_prompt_tokens=5)
    assert q.num_prompt_tokens == 9


def test_expire_and_next_deadline() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_requests=10, max_prompt_tokens=100)
    q.push("late", None, num_prompt_tokens=1, deadline=20.0)
    q.push("never", None, num_prompt_tokens=1)
    q.push("soon", None, num_prompt_tokens=1, deadline=10.0)
    assert q.next_deadline() == 10.0
    assert q.time_to_next_deadline(4.0) == 6.0
    assert q.expire(9.9) == []
    assert [e.request_id for e in q.expire(10.0)] == ["soon"]
    q.remove("late")
    assert q.next_deadline() is None
    assert q.time_to_next_deadline(0.0) == float("inf")
    assert [e.request_id for e in q.expire(1e9)] == []
    assert [q.pop().request_id for _ in range(1)] == ["never"]  # type: ignore[union-attr]


def test_duplicate_id_and_remove_unknown() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_requests=10, max_prompt_tokens=100)
    q.push("a", None, num_prompt_tokens=1)
    with pytest.raises(ValueError):
        q.push("a", None, num_prompt_tokens=1)
    assert q.remove("zzz") is None
    assert q.peek() is not None and q.peek().request_id == "a"  # type: ignore[union-attr]


def test_heaps_stay_compact_under_churn() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_requests=10, max_prompt_tokens=1000)
    for i in range(10_000):
        q.push(str(i), None, num_prompt_tokens=1, deadline=float(i))
        q.remove(str(i))
    assert len(q) == 0
    assert len(q._by_priority) + len(q._by_deadline) <= 64 + 2


# -- properties ----------------------------------------------------------------------------------


@dataclass
class _Model:
    """The reference: a list of (request_id, tokens, priority, deadline, seq)."""

    entries: list[tuple[str, int, int, float | None, int]]

    def first(self) -> tuple[str, int, int, float | None, int] | None:
        return min(self.entries, key=lambda e: (e[2], e[4])) if self.entries else None


_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.integers(0, 30),  # tokens
            st.integers(-2, 2),  # priority
            st.one_of(st.none(), st.integers(0, 50).map(float)),  # deadline
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 60)),
        st.tuples(st.just("expire"), st.integers(0, 50).map(float)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, max_requests=st.integers(1, 8), max_tokens=st.integers(1, 80))
def test_queue_matches_reference(
    ops: list[tuple[object, ...]], max_requests: int, max_tokens: int
) -> None:
    q: AdmissionQueue[int] = AdmissionQueue(max_requests, max_tokens)
    model = _Model([])
    pushed: list[str] = []
    gone: list[str] = []  # every id that left: popped, removed or expired
    for n, op in enumerate(ops):
        _apply(q, model, op, n, pushed, gone)
        assert len(q) == len(model.entries) <= max_requests
        assert q.num_prompt_tokens == sum(e[1] for e in model.entries) <= max_tokens
        first = model.first()
        peeked = q.peek()
        assert (peeked.request_id if peeked else None) == (first[0] if first else None)
    while (entry := q.pop()) is not None:
        gone.append(entry.request_id)
    # Nothing lost, nothing twice: each accepted id left exactly once.
    assert sorted(gone) == sorted(pushed)


def _apply(
    q: AdmissionQueue[int],
    model: _Model,
    op: tuple[object, ...],
    n: int,
    pushed: list[str],
    gone: list[str],
) -> None:
    kind = op[0]
    if kind == "push":
        _, tokens, prio, deadline = op
        assert isinstance(tokens, int) and isinstance(prio, int)
        assert deadline is None or isinstance(deadline, float)
        _push(q, model, str(n), tokens, prio, deadline, pushed)
    elif kind == "pop":
        entry, first = q.pop(), model.first()
        assert (entry.request_id if entry else None) == (first[0] if first else None)
        if first is not None:
            model.entries.remove(first)
            gone.append(first[0])
    elif kind == "remove":
        rid = str(op[1])
        entry = q.remove(rid)
        match = [e for e in model.entries if e[0] == rid]
        assert (entry is not None) == bool(match)
        if match:
            model.entries.remove(match[0])
            gone.append(rid)
    else:
        now = op[1]
        assert isinstance(now, float)
        expired = [e.request_id for e in q.expire(now)]
        due = [e for e in model.entries if e[3] is not None and e[3] <= now]
        assert sorted(expired) == sorted(e[0] for e in due)
        for e in due:
            model.entries.remove(e)
        gone.extend(expired)


def _push(
    q: AdmissionQueue[int],
    model: _Model,
    rid: str,
    tokens: int,
    prio: int,
    deadline: float | None,
    pushed: list[str],
) -> None:
    fits = (
        len(model.entries) < q.max_requests
        and sum(e[1] for e in model.entries) + tokens <= q.max_prompt_tokens
    )
    try:
        q.push(rid, 0, num_prompt_tokens=tokens, priority=prio, deadline=deadline)
    except QueueFullError:
        assert not fits
        return
    assert fits
    model.entries.append((rid, tokens, prio, deadline, len(pushed)))
    pushed.append(rid)
