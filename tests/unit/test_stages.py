"""The one stage vocabulary: every lane's order, the timings carrier, and its `timings` form."""

from __future__ import annotations

import pytest

from inferd.telemetry.stages import (
    CLASSIC_STAGES,
    IMAGE_STAGES,
    LLM_STAGES,
    ROUTER_STAGES,
    STAGE_HELP,
    Stage,
    StageTimings,
    ordered,
)
from inferd.telemetry.timeline import RequestTimeline


def test_every_stage_has_help_and_a_lane() -> None:
    assert set(STAGE_HELP) == set(Stage)
    lanes = (LLM_STAGES, CLASSIC_STAGES, IMAGE_STAGES, ROUTER_STAGES)
    assert set().union(*lanes) == set(Stage)
    for lane in lanes:
        assert list(lane) == ordered(lane)  # each lane lists its stages in lifecycle order


def test_the_route_stage_comes_first_in_timings() -> None:
    t = StageTimings()
    t.add(Stage.RECEIVE, 0.1)
    t.add(Stage.ROUTE, 0.2)
    assert list(t.as_dict()) == ["route", "receive"]


@pytest.mark.parametrize("lane", [LLM_STAGES, CLASSIC_STAGES])
def test_each_lane_is_in_lifecycle_order(lane: tuple[Stage, ...]) -> None:
    assert ordered(reversed(lane)) == list(lane)


def test_a_stage_is_its_name() -> None:
    name: str = "queue"  # a plain str, as code that only has the name holds it
    by_name: dict[str, int] = {Stage.QUEUE: 1}
    assert name == Stage.QUEUE
    assert by_name[name] == 1
    assert f"inferd.{Stage.PREFILL}" == "inferd.prefill"


def test_timings_sum_pieces_keep_first_start_and_order_output() -> None:
    t = StageTimings()
    t.add(Stage.STREAM, 0.25, start=10.0)
    t.add(Stage.STREAM, 0.5, start=11.0)
    t.add(Stage.RECEIVE, 0.1234567, start=9.0)
    t.add(Stage.QUEUE, -1.0)  # clock noise never makes a negative stage
    assert t.as_dict() == {"receive": 0.123457, "queue": 0.0, "stream": 0.75}
    assert t.starts == {Stage.STREAM: 10.0, Stage.RECEIVE: 9.0}
    assert list(t.as_dict()) == ["receive", "queue", "stream"]


def test_set_replaces_and_merge_sums() -> None:
    a = StageTimings()
    a.add(Stage.INFER, 1.0)
    a.set(Stage.INFER, 0.5, start=3.0)
    b = StageTimings()
    b.add(Stage.INFER, 0.25, start=2.0)
    b.add(Stage.POSTPROCESS, 0.1)
    a.merge(b)
    assert a.seconds == {Stage.INFER: 0.75, Stage.POSTPROCESS: 0.1}
    assert a.starts == {Stage.INFER: 3.0}


def test_from_mapping_refuses_unknown_stages() -> None:
    assert StageTimings.from_mapping({"infer": 1}).seconds == {Stage.INFER: 1.0}
    with pytest.raises(ValueError):
        StageTimings.from_mapping({"warmup": 1.0})


def test_llm_timeline_merges_front_and_engine_stages() -> None:
    tl = RequestTimeline("r", arrival=100.0)
    tl.add(Stage.RECEIVE, 0.001, 100.0)
    tl.add(Stage.TOKENIZE, 0.002, 100.001)
    tl.mark_enqueued(100.003)
    tl.first_scheduled, tl.first_token, tl.engine_finished = 100.013, 100.05, 100.25
    tl.finish(100.26)
    stages = tl.all_stages()
    assert stages.starts[Stage.QUEUE] == 100.003
    assert stages.starts[Stage.DECODE] == 100.05
    out = tl.as_dict()
    assert list(out) == ["receive", "tokenize", "queue", "prefill", "decode", "ttft", "e2e"]
    assert out["queue"] == pytest.approx(0.01)
    assert out["e2e"] == pytest.approx(0.26)
