"""Which admitted requests run the next UNet forward (pure Python, no torch).

    policy = StepPolicy(max_rows=32, max_loras=8)
    plan = policy.plan([Slot("a", (512, 512), rows=2, priority=0, seq=0, style="ink"), ...])
    plan.bucket, plan.request_ids          # one resolution, the rows that run this step

Every engine step runs ONE UNet forward over requests of ONE resolution (a bucket: the latents of
one forward share a shape), each request at its own denoising step. The rule:

1. **Bucket**: among the buckets with admitted requests, the one whose most urgent request has
   the lowest priority value; among equals, the bucket that ran least recently (a bucket that
   never ran counts as the oldest). So buckets of one priority take turns, one forward each,
   and every admitted request of that priority advances once per round; a higher-priority
   bucket runs first.
2. **Rows**: within the bucket, requests in (priority, arrival) order join the forward while their
   rows fit `max_rows` (the role `max_num_batched_tokens` plays for the LLM); one that does not
   fit is skipped and smaller later ones may still fill the budget. The first always runs (the
   engine refuses requests larger than the budget, so it fits). A request left out simply
   waits at its step boundary with its latents: that is preemption, at no cost but time, and
   it is how a later higher-priority request overtakes.
3. **Styles**: a forward runs at most `max_loras` distinct LoRA styles (the slots of the batched
   LoRA layer, `--max-loras`); requests without a style never count. A request whose style
   would be one too many is skipped like one whose rows do not fit, and later ones of styles
   already in the forward may still join; it runs once the styles ahead of it in (priority,
   arrival) order leave (the first request always runs, so none waits forever). None: no bound.

Previews: a request asking for k partial images gets them after k steps spread evenly before its
last (`preview_steps`).

A request's rows are its images, doubled under classifier-free guidance (the uncond and cond
rows of each image). Nothing here knows about tensors, so the rule is unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Bucket = tuple[int, int]  # (width, height) in pixels


@dataclass(frozen=True, slots=True)
class Slot:
    """An admitted request, as the policy sees it."""

    request_id: str
    bucket: Bucket
    rows: int  # UNet rows a step: n, or 2n with classifier-free guidance
    priority: int  # lower runs first
    seq: int  # arrival order, the tie-break within one priority
    style: str | None = None  # its LoRA style; None runs the base UNet


@dataclass(frozen=True, slots=True)
class StepPlan:
    bucket: Bucket
    request_ids: tuple[str, ...]
    rows: int


class StepPolicy:
    """The step rule above; remembers when each bucket last ran (its only state)."""

    def __init__(self, max_rows: int, max_loras: int | None = None) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if max_loras is not None and max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_rows = max_rows
        self.max_loras = max_loras
        self._last_run: dict[Bucket, int] = {}
        self._iteration = 0

    def plan(self, slots: Iterable[Slot]) -> StepPlan | None:
        """The next forward's bucket and requests; None when nothing is admitted."""
        by_bucket: dict[Bucket, list[Slot]] = {}
        for slot in slots:
            by_bucket.setdefault(slot.bucket, []).append(slot)
        if not by_bucket:
            self._last_run.clear()
            return None
        bucket = min(by_bucket, key=lambda b: self._bucket_key(b, by_bucket[b]))
        chosen = self._fill(sorted(by_bucket[bucket], key=lambda s: (s.priority, s.seq)))
        self._iteration += 1
        self._last_run = {b: t for b, t in self._last_run.items() if b in by_bucket}
        self._last_run[bucket] = self._iteration
        return StepPlan(bucket, tuple(s.request_id for s in chosen), sum(s.rows for s in chosen))

    def _bucket_key(self, bucket: Bucket, slots: list[Slot]) -> tuple[int, int]:
        return min(s.priority for s in slots), self._last_run.get(bucket, -1)

    def _fill(self, ordered: list[Slot]) -> list[Slot]:
        chosen = [ordered[0]]
        rows = ordered[0].rows
        styles = {ordered[0].style} - {None}
        for slot in ordered[1:]:
            if rows + slot.rows > self.max_rows:
                continue
            new_style = slot.style is not None and slot.style not in styles
            if new_style and self.max_loras is not None and len(styles) >= self.max_loras:
                continue
            chosen.append(slot)
            rows += slot.rows
            if slot.style is not None:
                styles.add(slot.style)
        return chosen


def preview_steps(num_steps: int, k: int) -> tuple[int, ...]:
    """k steps spread evenly before the last (which brings the final image), e.g. 20 steps, 3
    previews: (5, 10, 15). Fewer when the steps are too few to space them."""
    steps = {round(num_steps * (i + 1) / (k + 1)) for i in range(k)}
    return tuple(sorted(s for s in steps if 1 <= s < num_steps))
