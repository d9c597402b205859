"""The image lane's pure parts: the step policy, request checks, preview spacing, the model
index allow-list and the tiny tokenizer's vocabulary. No model runs (well under a second)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.diffusion.loader import ImageModelSpec, derive_limits, read_model_index
from inferd.diffusion.request import ImageParams
from inferd.diffusion.step_scheduler import Slot, StepPolicy, preview_steps
from inferd.diffusion.tiny import clip_vocab_and_merges
from inferd.diffusion.validate import ImageSpec, resolve
from inferd.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError

A, B = (64, 64), (128, 64)


def slot(rid: str, bucket: tuple[int, int] = A, rows: int = 2, prio: int = 0, seq: int = 0) -> Slot:
    return Slot(rid, bucket, rows, prio, seq)


def test_nothing_admitted_plans_nothing() -> None:
    assert StepPolicy(8).plan([]) is None


def test_rows_fill_the_budget_in_arrival_order_skipping_what_does_not_fit() -> None:
    policy = StepPolicy(8)
    plan = policy.plan(
        [slot("a", rows=4, seq=0), slot("b", rows=6, seq=1), slot("c", rows=2, seq=2)]
    )
    assert plan is not None
    assert plan.request_ids == ("a", "c") and plan.rows == 6


def test_higher_priority_overtakes_at_a_step_boundary() -> None:
    policy = StepPolicy(4)
    running = [slot("old", rows=4, prio=1, seq=0)]
    plan = policy.plan([*running, slot("urgent", rows=4, prio=0, seq=5)])
    assert plan is not None and plan.request_ids == ("urgent",)


def test_buckets_of_one_priority_take_turns() -> None:
    policy = StepPolicy(8)
    slots = [slot("a", A, seq=0), slot("b", B, seq=1)]
    buckets = []
    for _ in range(4):
        plan = policy.plan(slots)
        assert plan is not None
        buckets.append(plan.bucket)
    assert buckets == [A, B, A, B]


def test_a_bucket_with_a_more_urgent_request_runs_first() -> None:
    policy = StepPolicy(8)
    slots = [slot("a", A, prio=1, seq=0), slot("b", B, prio=0, seq=1)]
    plans = [policy.plan(slots) for _ in range(3)]
    assert [p.bucket for p in plans if p is not None] == [B, B, B]


def test_at_most_max_loras_styles_a_forward_and_unstyled_rows_never_count() -> None:
    policy = StepPolicy(16, max_loras=2)
    slots = [
        Slot("ink-1", A, 2, 0, 0, "ink"),
        Slot("oil", A, 2, 0, 1, "oil"),
        Slot("pastel", A, 2, 0, 2, "pastel"),  # a third style: waits
        Slot("base", A, 2, 0, 3),
        Slot("ink-2", A, 2, 0, 4, "ink"),  # a style already in the forward: joins
    ]
    plan = policy.plan(slots)
    assert plan is not None and plan.request_ids == ("ink-1", "oil", "base", "ink-2")
    # Once "oil" leaves, "pastel" takes its slot.
    plan = policy.plan([s for s in slots if s.request_id != "oil"])
    assert plan is not None and plan.request_ids == ("ink-1", "pastel", "base", "ink-2")


def test_the_first_request_runs_whatever_its_style() -> None:
    policy = StepPolicy(8, max_loras=1)
    plan = policy.plan([Slot("a", A, 2, 0, 0, "ink"), Slot("b", A, 2, 0, 1, "oil")])
    assert plan is not None and plan.request_ids == ("a",)
    with pytest.raises(ValueError, match="max_loras"):
        StepPolicy(8, max_loras=0)


slots_strategy = st.lists(
    st.builds(
        Slot,
        request_id=st.uuids().map(str),
        bucket=st.sampled_from([A, B, (64, 128)]),
        rows=st.integers(1, 8),
        priority=st.integers(0, 2),
        seq=st.integers(0, 100),
        style=st.sampled_from([None, "ink", "oil", "pastel"]),
    ),
    max_size=12,
    unique_by=lambda s: s.request_id,
)


@settings(max_examples=200, deadline=None)
@given(slots_strategy, st.integers(8, 16), st.integers(1, 3))
def test_plan_invariants(slots: list[Slot], budget: int, max_loras: int) -> None:
    """One bucket, within budget and `max_loras` styles, never empty, and the most urgent
    request of the chosen bucket always runs; every bucket runs within (number of buckets)
    steps when priorities are equal."""
    policy = StepPolicy(budget, max_loras)
    plan = policy.plan(slots)
    if not slots:
        assert plan is None
        return
    assert plan is not None and plan.request_ids
    chosen = [s for s in slots if s.request_id in plan.request_ids]
    assert {s.bucket for s in chosen} == {plan.bucket}
    assert plan.rows == sum(s.rows for s in chosen) <= budget
    assert len({s.style for s in chosen} - {None}) <= max_loras
    in_bucket = [s for s in slots if s.bucket == plan.bucket]
    first = min(in_bucket, key=lambda s: (s.priority, s.seq))
    assert first.request_id in plan.request_ids
    assert min(s.priority for s in in_bucket) == min(s.priority for s in slots)
    flat = [Slot(s.request_id, s.bucket, s.rows, 0, s.seq, s.style) for s in slots]
    buckets = {s.bucket for s in flat}
    seen = set()
    for _ in range(len(buckets)):
        step = policy.plan(flat)
        assert step is not None
        seen.add(step.bucket)
    assert seen == buckets


def test_preview_steps_are_spread_before_the_last() -> None:
    assert preview_steps(20, 3) == (5, 10, 15)
    assert preview_steps(8, 1) == (4,)
    assert preview_steps(2, 3) == (1,)
    assert preview_steps(50, 0) == ()


LIMITS = derive_limits(512, 8, ImageModelSpec(default_steps=30, max_steps=100))


def check(params: ImageParams) -> ImageSpec:
    return resolve(params, LIMITS, max_rows=8, seed_source=lambda bits: 42)


def test_defaults_are_the_models() -> None:
    spec = check(ImageParams("a fox"))
    assert (spec.width, spec.height, spec.steps) == (512, 512, 30)
    assert spec.guidance_scale == 7.5 and spec.seed == 42 and spec.rows == 2
    assert LIMITS.max_width == 1024 and LIMITS.size_multiple == 8


def test_no_guidance_halves_the_rows() -> None:
    spec = check(ImageParams("a fox", n=4, guidance_scale=1.0))
    assert spec.rows == 4


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (ImageParams("x", width=500), "size"),
        (ImageParams("x", height=2048), "size"),
        (ImageParams("x", num_inference_steps=101), "num_inference_steps"),
        (ImageParams("x", n=0), "n"),
        (ImageParams("x", n=5), "n"),  # 10 rows with guidance, over the budget of 8
        (ImageParams("x", seed=-1), "seed"),
        (ImageParams("x", guidance_scale=-1.0), "guidance_scale"),
        (ImageParams("x", partial_images=4), "partial_images"),
    ],
)
def test_out_of_range_is_a_400_naming_the_parameter(params: ImageParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check(params)
    assert err.value.param == param


def test_unknown_style_is_a_404() -> None:
    with pytest.raises(ModelNotFoundError):
        check(ImageParams("x", lora_name="anime"))


def write_index(tmp_path: Path, **changes: object) -> Path:
    index: dict[str, object] = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
        "feature_extractor": [None, None],
    }
    index.update(changes)
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return tmp_path


def test_model_index_allows_sd_and_ignores_the_safety_checker(tmp_path: Path) -> None:
    components = read_model_index(write_index(tmp_path))
    assert set(components) == {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}


@pytest.mark.parametrize(
    "changes",
    [
        {"unet": ["my_module", "EvilUNet"]},
        {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]},
        {"_class_name": "StableDiffusionXLPipeline"},
        {"controlnet": ["diffusers", "ControlNetModel"]},
        {"vae": ["diffusers"]},
    ],
)
def test_model_index_refuses_what_is_not_allowed(tmp_path: Path, changes: object) -> None:
    with pytest.raises(ModelLoadError):
        read_model_index(write_index(tmp_path, **changes))  # type: ignore[arg-type]


def test_tiny_tokenizer_vocabulary_is_deterministic() -> None:
    vocab, merges = clip_vocab_and_merges()
    again = clip_vocab_and_merges()
    assert (vocab, merges) == again
    assert "fox</w>" in vocab and vocab["<|endoftext|>"] == len(vocab) - 1


def test_max_image_size_rounds_down_to_the_multiple() -> None:
    limits = derive_limits(512, 8, ImageModelSpec(max_image_size=1000, max_steps=20))
    assert limits.max_width == limits.max_height == 1000
    limits = derive_limits(512, 64, ImageModelSpec(max_image_size=1000, default_steps=50))
    assert limits.max_width == 960 and limits.default_steps == 50
    assert derive_limits(512, 8, ImageModelSpec(default_steps=50, max_steps=20)).default_steps == 20
