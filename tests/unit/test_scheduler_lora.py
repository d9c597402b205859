"""The scheduler with LoRA adapters: at most `max_loras` distinct adapters a step; a request whose
adapter would be one too many is passed over keeping its place, and the base model's requests are
never held back by the limit. CPU, faked model output."""

from __future__ import annotations

import pytest
from test_scheduler import (
    assert_all_free,
    expected_outputs,
    make_request,
    run_to_completion,
    scheduled,
    step,
)

from inferd.config import SchedulerConfig
from inferd.kv_cache.block_manager import BlockManager
from inferd.scheduler.output import SchedulerOutput
from inferd.scheduler.request import Request
from inferd.scheduler.scheduler import Scheduler

BS = 4


def lora_scheduler(max_loras: int, policy: str = "fcfs") -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, BlockManager(64, BS), max_model_len=256, max_loras=max_loras)


def lora_request(
    rid: str,
    lora: str | None,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
) -> Request:
    request = make_request(rid, 6, max_tokens, priority=priority, arrival=arrival)
    request.lora_name = lora
    return request


def adapters(out: SchedulerOutput) -> set[str]:
    return {c.request.lora_name for c in out.chunks if c.request.lora_name is not None}


def ids(out: SchedulerOutput) -> list[str]:
    return [rid for rid, _, _ in scheduled(out)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_step_never_runs_more_than_max_loras_adapters(policy: str) -> None:
    s = lora_scheduler(max_loras=2, policy=policy)
    reqs = [
        lora_request(f"r{i}", lora, max_tokens=1 + i % 3, arrival=i)
        for i, lora in enumerate(["x", "y", "z", None, "x", "z", "y", None])
    ]
    for r in reqs:
        s.add_request(r)
    seen: set[str] = set()
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert len(adapters(out)) <= 2
        seen |= adapters(out)
    assert seen == {"x", "y", "z"}
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r, r.max_tokens)
    assert_all_free(s)


def test_a_passed_over_request_keeps_its_place_and_runs_when_a_slot_frees() -> None:
    s = lora_scheduler(max_loras=2)
    for r in (
        lora_request("x", "x", max_tokens=6, arrival=0),
        lora_request("y", "y", max_tokens=1, arrival=1),  # done after its prefill
        lora_request("z", "z", arrival=2),
        lora_request("q", "q", arrival=3),
    ):
        s.add_request(r)
    out, _ = step(s)
    assert ids(out) == ["x", "y"] and s.num_waiting == 2
    # y's slot is free: z, first in line, takes it; q (behind it) still waits.
    out, _ = step(s)
    assert ids(out) == ["x", "z"] and adapters(out) == {"x", "z"} and s.num_waiting == 1
    run_to_completion(s)
    assert_all_free(s)


def test_the_base_models_requests_are_never_held_back_by_the_adapter_limit() -> None:
    s = lora_scheduler(max_loras=1)
    for r in (
        lora_request("x", "x", arrival=0),
        lora_request("y", "y", arrival=1),
        lora_request("base", None, arrival=2),
        lora_request("z", "z", arrival=3),
        lora_request("x2", "x", arrival=4),
        lora_request("base2", None, arrival=5),
    ):
        s.add_request(r)
    out, _ = step(s)
    # Passed over: y and z (a second adapter); admitted past them: the base and x's own.
    assert ids(out) == ["x", "base", "x2", "base2"] and s.num_waiting == 2
    run_to_completion(s)
    assert_all_free(s)


def test_priority_a_passed_over_request_keeps_its_rank_and_preempts_nothing_for_a_slot() -> None:
    s = lora_scheduler(max_loras=1, policy="priority")
    s.add_request(lora_request("x", "x", max_tokens=2, priority=5, arrival=0))
    step(s)
    # y outranks everything, but its adapter has no slot: the running x is not preempted for
    # it, and the requests that fit go ahead.
    for r in (
        lora_request("y", "y", priority=0, arrival=1),
        lora_request("base", None, priority=5, arrival=2),
        lora_request("w", "w", priority=3, arrival=3),
    ):
        s.add_request(r)
    out, _ = step(s)
    assert out.preempted_ids == [] and ids(out) == ["x", "base"]
    # x is done: y (best rank) takes the slot before w, which waits again.
    out, _ = step(s)
    assert "y" in ids(out) and "w" not in ids(out) and adapters(out) == {"y"}
    run_to_completion(s)
    assert_all_free(s)
