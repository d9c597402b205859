"""How many draft tokens the next step verifies per request: k in [0, k_max], from measurements.

A request that verifies k drafts computes k + 1 rows and, when each draft is accepted with
probability a (independently, the usual model), gains

    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)   tokens per step (E(0) = 1).

Those rows are not free: the step's seconds grow with its rows. With N decoding requests the
engine predicts the step as

    T(k) = D + c * N * k

  - D: the seconds of a recent step without drafts (an average; it grows with N),
  - c: the marginal seconds of one verified row, measured on steps with drafts as
       (seconds - D) / (draft rows) (an average; it includes leaving the one-call decode path),
  - a: the acceptance rate, accepted / proposed draft tokens (an average over steps).

and picks the k that maximises tokens per second, N * E(k) / T(k), over 0 .. k_max. A full
batch has a large N * c, so k falls to 0 there: a batch that cannot afford the extra rows does
not pay for them. A single stream on a CPU reads every weight once per step whatever its rows
(c much smaller than D), so k stays high while drafts are accepted.

The first decoding step runs without drafts (it measures D); until a step with drafts has
measured c, the policy assumes c = 0 (it tries k_max, which measures c); before any draft,
a = 0.5. While k is 0 nothing measures a, so a drifts back
towards that prior (by `_RECOVER` a step), which lets speculation be tried again when the load
falls.

Pure Python: the engine feeds `observe_*` with its step timings and acceptance counts.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest observation in each running average.
_NEW = 0.3
_PRIOR_ACCEPTANCE = 0.5
# Per step without drafts, the share of the distance to the prior that a recovers.
_RECOVER = 0.02


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens a request gains from a step verifying k drafts (the module docstring)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class AdaptiveK:
    """The next step's k; see the module docstring. `adaptive=False`: always `k_max`."""

    k_max: int
    adaptive: bool = True
    acceptance: float = _PRIOR_ACCEPTANCE
    decode_s: float | None = None  # D
    row_s: float = 0.0  # c

    def choose(self, num_decoding: int) -> int:
        """k for a step with `num_decoding` requests that could draft."""
        if not self.adaptive:
            return self.k_max
        if self.decode_s is None:
            return 0  # measure D first: one step without drafts
        return max(range(self.k_max + 1), key=lambda k: self._rate(k, num_decoding))

    def _rate(self, k: int, n: int) -> float:
        seconds = self.decode_s or 0.0
        return n * expected_tokens(self.acceptance, k) / max(seconds + self.row_s * n * k, 1e-9)

    def observe_step(self, draft_rows: int, seconds: float) -> None:
        """A step of decodes only (no prompt tokens): its verified draft rows and its time."""
        if draft_rows == 0:
            self.decode_s = _average(self.decode_s, seconds)
            self.acceptance += _RECOVER * (_PRIOR_ACCEPTANCE - self.acceptance)
        elif self.decode_s is not None:
            per_row = max(0.0, seconds - self.decode_s) / draft_rows
            self.row_s = (
                per_row if self.row_s == 0.0 else self.row_s + _NEW * (per_row - self.row_s)
            )

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        """One step's draft tokens verified and accepted, all requests together."""
        if proposed > 0:
            self.acceptance += _NEW * (accepted / proposed - self.acceptance)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _NEW * (new - old)
