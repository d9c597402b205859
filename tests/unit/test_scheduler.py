"""Scheduler on CPU with a faked model output: batching, chunking, preemption, aborts, stops."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from inferd.config import SchedulerConfig
from inferd.errors import InvalidRequestError
from inferd.kv_cache.block_manager import BlockManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.output import SchedulerOutput
from inferd.scheduler.request import Request, RequestStatus
from inferd.scheduler.scheduler import Scheduler
from inferd.types import ModelRunnerOutput

BS = 4
EOS = 2
TokenFn = Callable[[Request, int], int]
_PROMPT_BASES = itertools.count(1000, 1000)


def fake_token(request: Request, position: int) -> int:
    """The faked model's token for `position` of `request`: never EOS, same on recompute."""
    return 100 + (sum(map(ord, request.request_id)) * 31 + position * 7) % 50


def make_request(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    **params: Any,
) -> Request:
    if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix sharing
        base = next(_PROMPT_BASES)
        prompt = list(range(base, base + prompt))
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        rid,
        prompt,
        sp,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(
    num_blocks: int = 64,
    *,
    budget: int = 64,
    max_seqs: int = 8,
    chunked: bool = True,
    policy: str = "fcfs",
    prefix: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, BlockManager(num_blocks, BS, prefix), max_model_len=256)


def step(s: Scheduler, token: TokenFn = fake_token) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a faked model: one token per chunk that samples."""
    out = s.schedule()
    sampling = [c for c in out.chunks if c.samples]
    runner_out = ModelRunnerOutput(
        req_ids=[c.request.request_id for c in sampling],
        sampled_token_ids=[[token(c.request, c.request.num_tokens)] for c in sampling],
    )
    s.block_manager.check_invariants()
    return out, s.update_from_output(out, runner_out)


def run_to_completion(s: Scheduler, token: TokenFn = fake_token, max_steps: int = 500) -> int:
    for n in range(max_steps):
        if not s.has_unfinished_requests():
            return n
        step(s, token)
    raise AssertionError("requests did not finish")


def expected_outputs(request: Request, n: int) -> list[int]:
    return [fake_token(request, request.num_prompt_tokens + i) for i in range(n)]


def scheduled(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def assert_all_free(s: Scheduler) -> None:
    bm = s.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


# -- batching ----------------------------------------------------------------------------------


def test_decode_and_prefill_mixed_in_one_step() -> None:
    s = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 7)
    s.add_request(a)
    out, updated = step(s)
    assert scheduled(out) == [("a", 0, 5)] and updated == [a]
    s.add_request(b)
    out, updated = step(s)
    assert scheduled(out) == [("a", 5, 1), ("b", 0, 7)]
    assert out.num_batched_tokens == 8 and updated == [a, b]
    assert len(out.chunks[0].block_ids) == 2 and len(out.chunks[1].block_ids) == 2
    assert a.num_computed_tokens == 6 and b.num_computed_tokens == 7
    assert a.output_token_ids == expected_outputs(a, 2)


def test_long_prompt_is_chunked_over_several_steps() -> None:
    s = make_scheduler(budget=8)
    a = make_request("a", 20)
    s.add_request(a)
    for start, n in [(0, 8), (8, 8)]:
        out, updated = step(s)
        assert scheduled(out) == [("a", start, n)] and updated == []
        assert not out.chunks[0].samples and a.num_computed_tokens == start + n
        assert len(out.chunks[0].block_ids) * BS >= start + n
    out, updated = step(s)
    assert scheduled(out) == [("a", 16, 4)] and updated == [a]
    assert a.num_output_tokens == 1


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    s = make_scheduler(budget=8)
    a, b = make_request("a", 3), make_request("b", 12)
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    assert scheduled(out) == [("a", 3, 1), ("b", 0, 7)]
    out, _ = step(s)
    assert scheduled(out) == [("a", 4, 1), ("b", 7, 5)]


def test_num_computed_tokens_advances_only_in_update() -> None:
    s = make_scheduler()
    a = make_request("a", 6)
    s.add_request(a)
    out = s.schedule()
    assert a.num_computed_tokens == 0 and out.chunks[0].start == 0
    s.update_from_output(out, ModelRunnerOutput(["a"], [[7]]))
    assert a.num_computed_tokens == 6 and a.output_token_ids == [7]


def test_token_budget_and_max_num_seqs() -> None:
    s = make_scheduler(budget=10, max_seqs=3)
    reqs = [make_request(f"r{i}", 4, max_tokens=3, arrival=i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert scheduled(out) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 2)]
    assert out.num_batched_tokens == 10 and s.num_running == 3 and s.num_waiting == 2
    out, _ = step(s)
    assert scheduled(out) == [("r0", 4, 1), ("r1", 4, 1), ("r2", 2, 2)]  # seq cap: no r3
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert out.num_batched_tokens <= 10 and len(out.chunks) <= 3 and s.num_running <= 3
    assert all(r.output_token_ids == expected_outputs(r, 3) for r in reqs)
    assert_all_free(s)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    s = make_scheduler(budget=10, chunked=False)
    a, b = make_request("a", 4, max_tokens=2), make_request("b", 9, max_tokens=2)
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    assert scheduled(out) == [("a", 4, 1), ("b", 0, 9)]  # 9 left after a's decode: fits whole
    s2 = make_scheduler(budget=10, chunked=False)
    c, d = make_request("c", 4, max_tokens=2), make_request("d", 10, max_tokens=1)
    s2.add_request(c)
    step(s2)
    s2.add_request(d)
    out, _ = step(s2)
    assert scheduled(out) == [("c", 4, 1)] and s2.num_waiting == 1  # 9 < 10: d waits
    out, _ = step(s2)
    assert scheduled(out) == [("d", 0, 10)]


# -- preemption --------------------------------------------------------------------------------


def fill_pool(s: Scheduler, reqs: list[Request]) -> None:
    """Admits every request with its prompt exactly filling its blocks."""
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert [c.request for c in out.chunks] == reqs


def test_preemption_victim_is_lowest_priority_then_newest() -> None:
    s = make_scheduler(num_blocks=6)
    a = make_request("a", 8, max_tokens=6, priority=0, arrival=0)
    b = make_request("b", 8, max_tokens=6, priority=1, arrival=1)
    c = make_request("c", 8, max_tokens=6, priority=0, arrival=2)
    fill_pool(s, [a, b, c])  # 6 blocks in use; every decode now needs a new block
    out, _ = step(s)
    assert out.preempted_ids == ["b"]  # lowest priority, though not the newest
    assert scheduled(out) == [("a", 8, 1), ("c", 8, 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == expected_outputs(b, 1)
    assert s.num_waiting == 1 and s.block_manager.block_table("b") == []
    run_to_completion(s)
    for r in (a, b, c):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_outputs(r, 6)
    assert_all_free(s)


def test_preemption_among_equal_priorities_takes_the_newest() -> None:
    s = make_scheduler(num_blocks=4)
    a, b = make_request("a", 8, arrival=0), make_request("b", 8, arrival=1)
    fill_pool(s, [a, b])
    out, _ = step(s)
    assert out.preempted_ids == ["b"] and scheduled(out) == [("a", 8, 1)]


def test_victim_being_scheduled_stops_scheduling_of_running() -> None:
    s = make_scheduler(num_blocks=4)
    x = make_request("x", 8, priority=5, arrival=0)
    y = make_request("y", 8, priority=0, arrival=1)
    fill_pool(s, [x, y])
    s.add_request(make_request("z", 1))
    out, _ = step(s)
    # x comes first in running, needs a block, and is itself the victim: nothing else runs,
    # and no waiting request is admitted in a step that preempted.
    assert out.preempted_ids == ["x"] and out.chunks == [] and s.num_waiting == 2
    out, _ = step(s)
    assert scheduled(out)[0] == ("y", 8, 1)


def test_victim_already_scheduled_this_step_gives_its_tokens_back() -> None:
    s = make_scheduler(num_blocks=4)
    x = make_request("x", 7, priority=5, arrival=0)  # its next token still fits its blocks
    y = make_request("y", 8, priority=0, arrival=1)
    fill_pool(s, [x, y])
    out, _ = step(s)
    assert out.preempted_ids == ["x"] and scheduled(out) == [("y", 8, 1)]
    assert out.num_batched_tokens == 1


def test_fcfs_preempted_request_resumes_before_newer_waiting_ones() -> None:
    s = make_scheduler(num_blocks=4, prefix=False)  # no cached prefix: recompute from 0
    a, b = make_request("a", 8, max_tokens=3, arrival=0), make_request("b", 8, arrival=1)
    fill_pool(s, [a, b])
    s.add_request(make_request("c", 2, arrival=2))
    out, _ = step(s)
    assert out.preempted_ids == ["b"]
    while a.is_finished is False:
        step(s)
    out, _ = step(s)
    assert out.chunks[0].request is b
    assert out.chunks[0].start == 0  # recompute: prompt + the output kept from before


def test_fcfs_waiting_request_does_not_preempt_running() -> None:
    s = make_scheduler(num_blocks=4)
    a = make_request("a", 7, priority=9)
    s.add_request(a)
    step(s)
    s.add_request(make_request("b", 9, priority=0))
    out, _ = step(s)
    assert scheduled(out) == [("a", 7, 1)] and out.preempted_ids == [] and s.num_waiting == 1


def test_priority_policy_orders_waiting_and_preempts_lower_priority_running() -> None:
    s = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", 7, priority=5, arrival=0)
    s.add_request(low)
    step(s)
    late_low = make_request("late-low", 2, priority=5, arrival=1)
    high = make_request("high", 9, priority=0, arrival=2)
    s.add_request(late_low)
    s.add_request(high)
    out, _ = step(s)
    # low decodes first, then high (better priority, though later) preempts low for blocks.
    assert out.preempted_ids == ["low"]
    assert scheduled(out) == [("high", 0, 9)]
    assert out.num_batched_tokens == 9
    run_to_completion(s)
    for r in (low, late_low, high):
        assert r.output_token_ids == expected_outputs(r, 4)
    assert_all_free(s)


def test_priority_policy_never_preempts_equal_priority_for_waiting() -> None:
    s = make_scheduler(num_blocks=4, policy="priority")
    s.add_request(make_request("a", 7, priority=1, arrival=0))
    step(s)
    s.add_request(make_request("b", 9, priority=1, arrival=1))
    out, _ = step(s)
    assert out.preempted_ids == [] and scheduled(out) == [("a", 7, 1)]


# -- abort -------------------------------------------------------------------------------------


def test_abort_in_every_state() -> None:
    s = make_scheduler(num_blocks=6, budget=8)
    waiting = make_request("waiting", 4, arrival=3)
    mid = make_request("mid", 20, arrival=0)  # prefill spans three steps
    s.add_request(mid)
    step(s)
    s.add_request(waiting)
    assert mid.num_computed_tokens == 8 and waiting.status is RequestStatus.WAITING
    aborted = s.finish_requests(["waiting", "mid"], RequestStatus.FINISHED_ABORTED)
    assert aborted == [waiting, mid]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert not s.has_unfinished_requests() and s.get_request("mid") is None
    assert_all_free(s)

    s = make_scheduler(num_blocks=6)
    a, b = make_request("a", 8, arrival=0), make_request("b", 8, arrival=1)
    fill_pool(s, [a, make_request("pad", 8, arrival=0.5), b])
    out, _ = step(s)
    assert out.preempted_ids == ["b"]
    assert s.finish_requests("b", RequestStatus.FINISHED_ABORTED) == [b]
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert s.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == []
    s.finish_requests(["a", "pad"], RequestStatus.FINISHED_ABORTED)
    assert s.num_running == 0 and s.num_waiting == 0
    assert_all_free(s)


def test_abort_between_schedule_and_update_is_skipped() -> None:
    s = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    updated = s.update_from_output(out, ModelRunnerOutput(["a", "b"], [[7], [8]]))
    assert updated == [b] and a.output_token_ids == [] and b.output_token_ids == [8]
    run_to_completion(s)
    assert_all_free(s)


def test_stop_string_finish_from_outside_keeps_status() -> None:
    s = make_scheduler()
    a = make_request("a", 5)
    s.add_request(a)
    step(s)
    a.stop_reason = "\n"
    assert s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == [a]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == "\n"
    assert_all_free(s)


# -- prefix cache ------------------------------------------------------------------------------


def test_requests_sharing_a_prefix_share_blocks() -> None:
    s = make_scheduler()
    shared = list(range(500, 508))
    a = make_request("a", [*shared, 1, 2], max_tokens=3)
    b = make_request("b", [*shared, 3, 4, 5], max_tokens=3)
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    chunk_b = out.chunks[1]
    assert (chunk_b.request, chunk_b.start, chunk_b.num_tokens) == (b, 8, 3)
    table_a = s.block_manager.block_table("a")
    assert chunk_b.block_ids[:2] == table_a[:2] and chunk_b.block_ids[2] != table_a[2]
    assert [s.block_manager.ref_count(x) for x in table_a[:3]] == [2, 2, 1]
    run_to_completion(s)
    assert b.output_token_ids == expected_outputs(b, 3)
    assert_all_free(s)
    assert s.block_manager.num_cached_blocks >= 2


def test_cached_prefix_always_leaves_the_last_token_to_compute() -> None:
    s = make_scheduler()
    prompt = list(range(500, 508))
    a = make_request("a", prompt, max_tokens=1)
    s.add_request(a)
    run_to_completion(s)
    b = make_request("b", prompt, max_tokens=1)  # both blocks cached, the last one recomputed
    s.add_request(b)
    out, updated = step(s)
    assert scheduled(out) == [("b", 4, 4)] and updated == [b] and b.is_finished


def test_prefix_caching_off_shares_nothing() -> None:
    s = make_scheduler(prefix=False)
    prompt = list(range(500, 509))
    s.add_request(make_request("a", prompt))
    step(s)
    s.add_request(make_request("b", prompt))
    out, _ = step(s)
    assert scheduled(out)[1] == ("b", 0, 9)
    assert not set(out.chunks[0].block_ids) & set(out.chunks[1].block_ids)


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    s = make_scheduler(num_blocks=4)
    p, q = list(range(500, 508)), list(range(600, 608))
    for rid, prompt in (("p", p), ("q", q)):
        s.add_request(make_request(rid, [*prompt, 1], max_tokens=1))
        run_to_completion(s)  # each leaves its two full blocks cached, at refcount 0
    bm = s.block_manager
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4  # pool of 4: p's tail evicted
    s.add_request(make_request("r", 5, max_tokens=1))  # needs two blocks: one free, one evicted
    run_to_completion(s)
    assert bm.lookup_prefix([*q, 0]).num_tokens == 8  # q, freed last, kept
    assert bm.lookup_prefix([*p, 0]).num_tokens == 0


# -- stop rules --------------------------------------------------------------------------------


def scripted(tokens: list[int]) -> TokenFn:
    """A faked model that emits `tokens` in order, whatever the request."""
    it = iter(tokens)
    return lambda request, position: next(it)


def finish(request: Request, tokens: list[int]) -> Request:
    s = make_scheduler()
    s.add_request(request)
    run_to_completion(s, scripted(tokens))
    assert_all_free(s)
    return request


def test_eos_stops() -> None:
    r = finish(make_request("a", 3, max_tokens=8), [10, 11, EOS, 12])
    assert r.output_token_ids == [10, 11, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.status.finish_reason == "stop"


def test_stop_token_ids_stop_with_reason() -> None:
    r = finish(make_request("a", 3, max_tokens=8, stop_token_ids=[42]), [10, 42, 12])
    assert r.output_token_ids == [10, 42]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_min_tokens_defers_stops() -> None:
    r = finish(
        make_request("a", 3, max_tokens=8, min_tokens=3, stop_token_ids=[42]),
        [EOS, 42, 11, EOS],
    )
    assert r.output_token_ids == [EOS, 42, 11, EOS] and r.status is RequestStatus.FINISHED_STOPPED


def test_max_tokens_finishes_with_length() -> None:
    r = finish(make_request("a", 3, max_tokens=3), [10, 11, 12, 13])
    assert r.output_token_ids == [10, 11, 12] and r.status is RequestStatus.FINISHED_LENGTH


def test_ignore_eos() -> None:
    r = finish(make_request("a", 3, max_tokens=3, ignore_eos=True), [EOS, EOS, EOS])
    assert r.output_token_ids == [EOS] * 3 and r.status is RequestStatus.FINISHED_LENGTH


def test_stop_on_the_last_allowed_token_is_a_stop() -> None:
    r = finish(make_request("a", 3, max_tokens=2), [10, EOS])
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_update_returns_requests_in_order_with_finished_ones() -> None:
    s = make_scheduler()
    reqs = [make_request(f"r{i}", 3, max_tokens=1 + i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    _, updated = step(s)
    assert updated == reqs and reqs[0].is_finished and s.num_running == 2
    assert s.get_request("r0") is None and s.get_request("r1") is reqs[1]


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "kwargs"),
    [
        (0, 4, {}),  # empty prompt
        (250, 10, {}),  # beyond max_model_len
        (30, 10, {"num_blocks": 9}),  # needs 39 slots, the pool has 36
        (8, 4, {"budget": 10, "chunked": False}),  # 11 tokens may never fit one step
    ],
)
def test_requests_that_could_never_run_are_rejected(
    prompt: int, max_tokens: int, kwargs: dict[str, Any]
) -> None:
    s = make_scheduler(**kwargs)
    with pytest.raises(InvalidRequestError):
        s.add_request(make_request("a", prompt, max_tokens=max_tokens))
    assert not s.has_unfinished_requests()


def test_duplicate_request_id_is_rejected() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    with pytest.raises(InvalidRequestError):
        s.add_request(make_request("a", 3))
    assert s.num_waiting == 1
