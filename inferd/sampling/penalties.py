"""Logits processors that run before greedy and random sampling alike (they can change the argmax).

All of them work in place on logits [N, V] float32 and touch only the rows that need them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inferd.sampling.metadata import PenaltyTensors


def apply_min_tokens(logits: Tensor, index: tuple[Tensor, Tensor]) -> Tensor:
    """Bans EOS / stop token ids of rows still below min_tokens: logits[rows, ids] = -inf.

    A ban never leaves a row with no token: where the stop ids were all that remained (a finished
    grammar allows only EOS), that row keeps them, and ends as its grammar says."""
    rows, token_ids = index
    kept = logits[rows, token_ids]
    logits[rows, token_ids] = float("-inf")
    emptied = logits[rows].amax(dim=-1) == float("-inf")
    if bool(emptied.any()):
        logits[rows[emptied], token_ids[emptied]] = kept[emptied]
    return logits


def apply_penalties(logits: Tensor, pen: PenaltyTensors) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output only) penalties.

    Repetition follows Hugging Face (CTRL paper): a seen token's logit is divided by the
    penalty when positive and multiplied by it otherwise. Frequency and presence follow OpenAI:
    logit -= frequency * count + presence * (count > 0).
    """
    if pen.repetition is not None:
        logits = _apply_repetition(logits, pen)
    if pen.frequency is not None:
        logits.sub_(pen.frequency.unsqueeze(1) * pen.output_counts)
    if pen.presence is not None:
        logits.sub_(pen.presence.unsqueeze(1) * (pen.output_counts > 0))
    return logits


def _apply_repetition(logits: Tensor, pen: PenaltyTensors) -> Tensor:
    assert pen.repetition is not None and pen.prompt_mask is not None
    seen = pen.prompt_mask | (pen.output_counts > 0)
    # factor: [N, V], the row's penalty on seen tokens and 1 elsewhere (x / 1 and x * 1 are exact).
    factor = torch.where(seen, pen.repetition.unsqueeze(1), 1.0)
    penalized = torch.where(logits > 0, logits / factor, logits * factor)
    return logits.copy_(penalized)
