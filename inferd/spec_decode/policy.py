"""How many draft tokens a request verifies in the next step: k in [0, k_max], from measurements.

A request whose drafts are each accepted with probability a (independently, the usual model)
gains from its j-th draft a^j expected tokens: E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens a step. Each draft is one more row in the step, and the step's seconds grow with its rows:

    step seconds ~= D + c * (draft rows)

  - D: the seconds of a recent step without drafts (an average; it grows with the batch),
  - c: the marginal seconds of one verified row, measured on steps with drafts as
       (seconds - D) / (draft rows) (an average; it includes leaving the one-call decode path,
       and with a draft model the draft's forwards, which run within the step's time).

Without drafts the step makes N / D tokens a second (N decoding requests). The rule: a request
verifies its j-th draft only if that draft's expected tokens per second of its own cost beat the
step's rate without it,

    a_r^j / c > N / D,   so   k_r = the largest k <= k_max with a_r^k > N c / D.

A full batch has N c / D near or above 1 and drafts nothing: it does not pay for rows it cannot
afford. A single stream on a CPU reads every weight once per step whatever its rows (c much
smaller than D), so it drafts k_max while its drafts are accepted.

a_r is the request's own acceptance (accepted / verified drafts, a running average), starting
from `_PRIOR`: what n-gram drafts predict depends on the text. While a request does not draft,
its a_r drifts back to the prior by `_RECOVER` a step, so one that stopped drafting tries again.
The first decoding step runs without drafts (it measures D); until a step with drafts has
measured c, c = 0 (k_max, which measures it).

Pure Python: the engine feeds `observe_step` with its step timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest observation in each running average.
_NEW = 0.3
_PRIOR = 0.5
# Per step without drafts, the share of the distance to the prior that a request's a recovers.
_RECOVER = 0.05


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens a request gains from a step verifying k drafts (the module docstring)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class AdaptiveK:
    """Each request's k for the next step; see the module docstring. `adaptive=False`: always
    `k_max`."""

    k_max: int
    adaptive: bool = True
    decode_s: float | None = None  # D
    row_s: float = 0.0  # c

    def choose(self, acceptance: float | None, num_decoding: int) -> int:
        """k for a request with acceptance a_r (None: none measured) among `num_decoding`."""
        if not self.adaptive:
            return self.k_max
        if self.decode_s is None:
            return 0  # measure D first: one step without drafts
        a = _PRIOR if acceptance is None else acceptance
        threshold = num_decoding * self.row_s / self.decode_s
        if threshold <= 0.0:
            return self.k_max
        if a <= 0.0 or threshold >= 1.0 or a <= threshold:
            return 0
        if a >= 1.0:
            return self.k_max
        # a^k > threshold  <=>  k < log(threshold) / log(a)
        k = math.ceil(math.log(threshold) / math.log(a)) - 1
        return max(0, min(self.k_max, k))

    def observe_step(self, draft_rows: int, seconds: float) -> None:
        """A step of decodes only (no prompt tokens): its verified draft rows and its time."""
        if draft_rows == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            per_row = max(0.0, seconds - self.decode_s) / draft_rows
            self.row_s = per_row if self.row_s == 0.0 else _average(self.row_s, per_row)


def updated_acceptance(acceptance: float | None, proposed: int, accepted: int) -> float:
    """A request's acceptance after a step that verified `proposed` of its drafts."""
    a = _PRIOR if acceptance is None else acceptance
    return a + _NEW * (accepted / proposed - a) if proposed else a


def recovered_acceptance(acceptance: float | None) -> float | None:
    """A request's acceptance after a step in which it verified no draft."""
    return None if acceptance is None else acceptance + _RECOVER * (_PRIOR - acceptance)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _NEW * (new - old)
