"""The low-rank term of many adapters in one batch: each linear layer adds its adapters' terms to
their own rows only (S-LoRA / Punica's segmented GEMV, SGMV).

The base GEMM runs once over every row of the step, whatever adapter each row runs under; then
for each adapter present, one pair of small GEMMs on its rows:

    y[lo:hi] += (x[lo:hi] a_s^T) bt_s        s: the adapter's slot, [lo, hi): its rows

The runner orders the step's rows so each adapter's rows are contiguous (its decode rows, then
its prompt chunks: at most two segments per adapter), so a segment is a view, never a gather.
Base-model rows are in no segment and cost nothing; a step with no adapter rows costs one
attribute check per layer.

Slots: every LoRA-capable layer holds `max_loras` slots of factors, stacked, sized for
`max_lora_rank` per shard: a [slots, w_max, in] and bt [slots, w_max, out]; slot s holds one
adapter's packed factors (adapter.py) in its first `width[s]` rows. The manager copies an
adapter into a free slot when a step first needs it (a few MB, well under a step), so a step
reads only the slots, as a CUDA graph would (the slot tensors are fixed; what changes are their
contents and the segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferd.lora.adapter import LinearFactors


@dataclass
class LoRABatch:
    """Which rows of the step being run use which slot: set by the runner before each forward,
    read by every LoRA layer. `segments`: (slot, lo, hi), rows [lo, hi) of the flat batch."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.segments)


class LoRALayer:
    """One linear layer's slots and its term over a step's segments (the module docstring)."""

    def __init__(
        self,
        batch: LoRABatch,
        in_features: int,
        out_features: int,
        max_width: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.a = torch.zeros(num_slots, max_width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(num_slots, max_width, out_features, dtype=dtype, device=device)
        # Rows of each slot's factors in use; 0: the slot's adapter does not touch this layer.
        self.width = [0] * num_slots

    @property
    def active(self) -> bool:
        return self.batch.active

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.bt.nbytes

    def load(self, slot: int, factors: LinearFactors | None) -> None:
        """Puts an adapter's factors for this layer in `slot` (None: it has none here)."""
        if factors is None:
            self.width[slot] = 0
            return
        w = factors.width
        self.a[slot, :w].copy_(factors.a)
        self.bt[slot, :w].copy_(factors.bt)
        self.width[slot] = w

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each segment's term. x: [T', in], y: [T', out] (T' >= the real rows: padded
        rows are in no segment)."""
        for slot, lo, hi in self.batch.segments:
            w = self.width[slot]
            if w:
                shrunk = x[lo:hi] @ self.a[slot, :w].t()  # [rows, w]
                y[lo:hi].addmm_(shrunk, self.bt[slot, :w])
