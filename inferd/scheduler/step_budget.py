"""The step's token budget from a step-time target: chunked prefill sized by time, not a count.

A fixed `max_num_batched_tokens` (vLLM's 2,048 on CPU) is a step of ~0.3 s on a 32 M-parameter
model but of ~1 s on a 0.5 B one (bfloat16, two cores). Two things pay for a long step:
  - every running stream waits the whole step for its next token (inter-token latency), and
  - in a burst, a request whose prompt is done early in a step still gets its first token at
    the step's end, with the prompts scheduled after it (time to first token).
Sarathi-Serve sizes the chunks from a latency target for the same reason. Here the target is
`SchedulerConfig.step_time_target_ms` and the step cost comes from the engine's own timings:

  step seconds ~= decode + per_token * prompt_tokens

  - `decode`: an average of recent steps that computed no prompt token (the running streams'
    cost; it rises with their number);
  - `per_token`: an average, over recent steps with at least `min_tokens / 2` prompt tokens, of
    (seconds - decode) / prompt tokens.

`tokens()`, the step's budget (running decodes included, as `max_num_batched_tokens`), is then
`max_tokens`, halved while a step of that many prompt tokens is predicted to take longer than the
target, never below `min_tokens`. Halving rather than any count, and 512 at least: GEMM speed per
row is not smooth in the row count (oneDNN's bfloat16 GEMMs over the Qwen2-0.5B shape's 24
layers: 0.29 ms a row at 512 and 2,048 rows, 0.37-0.39 ms at 768-1,280, 0.35 ms at 256;
`bench/gemv_rows.py --layers-only`, docs/benchmarks.md). Going back up a level needs the
prediction under `_RAISE` of the target, so one estimate near the target does not flip the budget
every step.

Until a step with enough prompt tokens has been timed, the budget is `max_tokens`: a model whose
steps are fast never leaves it, and one whose steps are slow leaves it after its first one.

Pure Python: the engine feeds `observe` with its step timings; tests feed it numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest observation in each running average.
_NEW = 0.5
# Back up a level only when the prediction there is under this share of the target.
_RAISE = 0.8
_MIN_TOKENS = 512


@dataclass
class StepBudget:
    """The next step's token budget from a step-time target; see the module docstring."""

    max_tokens: int
    target_s: float  # 0: always `max_tokens` (a fixed budget, vLLM's behaviour)
    min_tokens: int = _MIN_TOKENS
    decode_s: float = 0.0
    per_token_s: float | None = None
    _level: int = 0  # the budget is max_tokens >> _level

    def __post_init__(self) -> None:
        self.min_tokens = min(self.min_tokens, self.max_tokens)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """One finished step: the prompt tokens it computed and its wall time."""
        if prompt_tokens == 0:
            self.decode_s += _NEW * (seconds - self.decode_s)
            return
        if prompt_tokens * 2 < self.min_tokens:
            return
        rate = max(0.0, seconds - self.decode_s) / prompt_tokens
        old = self.per_token_s
        self.per_token_s = rate if old is None else old + _NEW * (rate - old)
        self._level = self._choose_level()

    def tokens(self) -> int:
        """The next step's token budget, running decodes included (as `max_num_batched_tokens`).

        `max_tokens` or a half, a quarter... of it, so the step's GEMMs keep a row count they run
        well (with decodes in, the rows equal the budget whenever prompts fill it)."""
        return self._tokens_at(self._level)

    def predicted_s(self, prompt_tokens: int) -> float | None:
        """The model's seconds for a step of `prompt_tokens`; None before any estimate."""
        if self.per_token_s is None:
            return None
        return self.decode_s + self.per_token_s * prompt_tokens

    def _choose_level(self) -> int:
        if self.target_s <= 0:
            return 0
        level = self._level
        # Down while the current level is predicted over the target (and a level is left).
        while self._over(level, 1.0) and self._tokens_at(level) > self.min_tokens:
            level += 1
        # Up one level at a time while the level above fits well under the target.
        while level > 0 and not self._over(level - 1, _RAISE):
            level -= 1
        return level

    def _over(self, level: int, share: float) -> bool:
        predicted = self.predicted_s(self._tokens_at(level))
        return predicted is not None and predicted > share * self.target_s

    def _tokens_at(self, level: int) -> int:
        return max(self.min_tokens, self.max_tokens >> level)
