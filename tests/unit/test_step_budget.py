"""The step-time budget (scheduler/step_budget.py): its cost model, its levels, and the scheduler
taking it; with faked step timings."""

from __future__ import annotations

import pytest
from test_scheduler import make_request, make_scheduler, scheduled, step

from inferd.config import SchedulerConfig
from inferd.kv_cache.block_manager import BlockManager
from inferd.scheduler.scheduler import Scheduler
from inferd.scheduler.step_budget import StepBudget


def timed_steps(budget: StepBudget, decode_s: float, per_token_s: float, steps: int = 6) -> None:
    """Steps that take decode_s + per_token_s * prompt tokens, each at the current budget."""
    for _ in range(steps):
        budget.observe(0, decode_s)
        tokens = budget.tokens()
        budget.observe(tokens, decode_s + per_token_s * tokens)


def test_no_estimate_keeps_the_whole_budget() -> None:
    b = StepBudget(2048, target_s=0.5)
    assert b.tokens() == 2048 and b.predicted_s(1024) is None
    b.observe(0, 0.05)  # decode steps alone estimate nothing per prompt token
    b.observe(200, 1.0)  # under min_tokens / 2 prompt tokens: not a prefill sample
    assert b.tokens() == 2048 and b.per_token_s is None


def test_the_cost_model_is_decode_plus_per_token() -> None:
    b = StepBudget(2048, target_s=0.5)
    b.observe(0, 0.05)
    b.observe(1000, 0.55)
    assert b.decode_s == pytest.approx(0.025)  # half-way from 0: a running average
    assert b.per_token_s == pytest.approx((0.55 - 0.025) / 1000)
    assert b.predicted_s(2000) == pytest.approx(0.025 + 2 * 0.525)


@pytest.mark.parametrize(
    ("per_token_ms", "expected"),
    [
        (0.16, 2048),  # 0.36 s at 2,048 tokens: under the target, the whole budget
        (0.49, 512),  # 1.05 s at 2,048, 0.55 s at 1,024: halved twice
        (0.3, 1024),  # 0.65 s at 2,048, 0.33 s at 1,024
        (2.0, 512),  # over the target even at 512: never under min_tokens
    ],
)
def test_halves_while_a_step_is_predicted_over_the_target(
    per_token_ms: float, expected: int
) -> None:
    b = StepBudget(2048, target_s=0.5)
    timed_steps(b, 0.03, per_token_ms / 1000)
    assert b.tokens() == expected


def test_goes_back_up_only_well_under_the_target() -> None:
    b = StepBudget(2048, target_s=0.5)
    timed_steps(b, 0.03, 0.49e-3)
    assert b.tokens() == 512
    # 1,024 tokens predicted at 0.03 + 0.45 s: under the target but not under 80 % of it.
    timed_steps(b, 0.03, 0.45e-3, steps=12)
    assert b.tokens() == 512
    timed_steps(b, 0.03, 0.2e-3, steps=12)  # the machine got faster: 0.44 s at 2,048
    assert b.tokens() == 1024
    timed_steps(b, 0.03, 0.15e-3, steps=12)  # 0.34 s at 2,048
    assert b.tokens() == 2048


def test_target_zero_is_a_fixed_budget() -> None:
    b = StepBudget(2048, target_s=0.0)
    timed_steps(b, 0.05, 5e-3)
    assert b.tokens() == 2048


def test_a_small_max_is_its_own_floor() -> None:
    b = StepBudget(256, target_s=0.01)
    timed_steps(b, 0.05, 5e-3)
    assert b.tokens() == 256


def test_the_scheduler_steps_take_the_budget_and_decodes_still_run() -> None:
    s = make_scheduler(num_blocks=64, budget=64, max_seqs=8)
    s.step_budget = StepBudget(64, target_s=0.05, min_tokens=8)
    a, b = make_request("a", 40), make_request("b", 40)
    s.add_request(a)
    out, _ = step(s)
    assert scheduled(out) == [("a", 0, 40)]
    s.step_budget.observe(40, 0.2)  # 5 ms a prompt token: 64 tokens take 0.32 s, 8 take 0.04
    assert s.step_budget.tokens() == 8
    s.add_request(b)
    out, _ = step(s)
    assert scheduled(out) == [("a", 40, 1), ("b", 0, 7)]  # running decodes count in the budget


def test_running_requests_each_get_a_token_past_a_small_budget() -> None:
    s = make_scheduler(num_blocks=64, budget=64, max_seqs=8)
    s.step_budget = StepBudget(64, target_s=0.05, min_tokens=2)
    reqs = [make_request(f"r{i}", 3, max_tokens=8) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    step(s)
    s.step_budget.observe(12, 10.0)
    assert s.step_budget.tokens() == 2
    out, _ = step(s)
    assert [n for _, _, n in scheduled(out)] == [1, 1, 1, 1]


def test_without_chunked_prefill_the_budget_stays_fixed() -> None:
    config = SchedulerConfig(max_num_batched_tokens=2048, enable_chunked_prefill=False)
    s = Scheduler(config, BlockManager(64, 4, True), max_model_len=256)
    timed_steps(s.step_budget, 0.05, 5e-3)
    assert s.step_budget.tokens() == 2048
