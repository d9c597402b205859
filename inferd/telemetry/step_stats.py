"""Where an engine step's time goes: schedule, prepare inputs, forward, sample, detokenize.

The engine records one StepStat per step into a bounded ring, so a long-running server keeps the
recent history at a fixed memory cost. Benchmarks and the metrics exporter read from it.

Stage times are host wall time. On a GPU the forward's kernels run asynchronously and the host
waits for them when sampling reads the token ids back; the runner times the forward with CUDA
events and moves that device time from `sample` to `forward` (executor/model_runner.py,
`_charge_device_time`), so the shares say where the step went, not where the host waited.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

STAGES = ("schedule", "prepare_inputs", "forward", "grammar", "sample", "detokenize")


@dataclass
class StepStat:
    num_running: int = 0
    num_waiting: int = 0
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Speculative decoding: draft tokens verified, and accepted (acceptance = their ratio).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    schedule: float = 0.0
    prepare_inputs: float = 0.0
    forward: float = 0.0
    # Structured outputs: filling and applying the grammar masks, advancing the matchers.
    grammar: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0
    total: float = 0.0
    # Mixture of experts: rows routed to each expert this step, summed over the MoE layers (the
    # load balance across experts); empty for a dense model. Not in summary().
    expert_rows: list[int] = field(default_factory=list)

    @property
    def outside_forward(self) -> float:
        return self.total - self.forward


@dataclass
class StepStats:
    """A bounded ring of the most recent steps."""

    maxlen: int = 100_000
    steps: deque[StepStat] = field(init=False)

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.maxlen)

    def record(self, stat: StepStat) -> None:
        self.steps.append(stat)

    def clear(self) -> None:
        self.steps.clear()

    def summary(self, min_running: int = 0) -> dict[str, float]:
        """Totals in seconds per stage over steps with at least `min_running` running sequences."""
        chosen = [s for s in self.steps if s.num_running >= min_running]
        out: dict[str, float] = {"steps": float(len(chosen))}
        for f in fields(StepStat):
            if f.name != "expert_rows":
                out[f.name] = float(sum(getattr(s, f.name) for s in chosen))
        return out


@contextmanager
def timed(stat: StepStat, stage: str) -> Iterator[None]:
    """Adds the block's wall time to `stat.<stage>`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        setattr(stat, stage, getattr(stat, stage) + time.perf_counter() - t0)
