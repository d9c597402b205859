"""N-gram (prompt lookup) drafts: the tokens that followed an earlier occurrence of the suffix.

The rule, for a sequence s = prompt + output and bounds [n_min, n_max]:
  for n = n_max down to n_min: if s[-n:] occurred earlier in s (an occurrence that ends before
  the last token), the draft is the up-to-k tokens that followed its latest such occurrence;
  the first n that matches wins (the longest suffix n-gram). No match: no draft.

    >>> NgramProposer(1, 3).propose([5, 6, 7, 8, 5, 6], k=3)
    [7, 8, 5]

The latest occurrence rather than the first, because text that repeats (code under edit, a
quoted passage) repeats its most recent form. Only the last `_WINDOW` tokens are searched, so a
proposal costs O(window * n_max) numpy work whatever the context length.

Pure Python + numpy: the engine calls it once per decoding request and step, on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from inferd.scheduler.request import Request

# Tokens searched back from the end: enough for a long quoted document, bounded per step.
_WINDOW = 4096


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        if not 0 < n_min <= n_max:
            raise ValueError(f"need 0 < n_min <= n_max, got [{n_min}, {n_max}]")
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (see the module docstring)."""
        if k <= 0 or len(token_ids) <= self.n_min:
            return []
        s = np.asarray(token_ids[-_WINDOW:], dtype=np.int64)
        for n in range(min(self.n_max, len(s) - 1), self.n_min - 1, -1):
            start = _latest_match(s, n)
            if start is not None:
                follow = start + n
                return s[follow : follow + k].tolist()  # type: ignore[no-any-return]
        return []

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """drafter.Proposer: each request's drafts, one lookup each."""
        return [self.propose(r.all_token_ids, k) for r, k in zip(requests, ks, strict=True)]

    def release(self, request_ids: Sequence[str]) -> None:
        """drafter.Proposer: no per-request state."""


def _latest_match(s: np.ndarray, n: int) -> int | None:
    """Start of the latest window s[i:i+n] == s[-n:] with i + n < len(s), None if none."""
    # Windows starting at 0 .. len(s) - n - 1: each ends before the last token.
    windows = sliding_window_view(s[:-1], n)
    hits = np.flatnonzero((windows == s[-n:]).all(axis=1))
    return None if hits.size == 0 else int(hits[-1])
