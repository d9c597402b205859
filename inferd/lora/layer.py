"""The low-rank term of many adapters in one batch: each linear layer adds its adapters' terms to
their own rows only (S-LoRA / Punica's segmented GEMV, SGMV).

The base GEMM runs once over every row of the step, whatever adapter each row runs under; then
for each adapter present, one pair of small GEMMs on its rows:

    y[rows] += (x[rows] a_s^T) bt_s        s: the adapter's slot, rows: its rows

The runner orders the step's rows so each adapter's rows come together: its decode rows, then
its prompt chunks. An adapter whose rows are one run reads them as a view (`slice`); one with
rows in both parts gathers them by index (a tensor built once per step, shared by every layer),
so each adapter costs four ops per layer whatever its number of requests: the per-op overhead,
not the arithmetic, is what a small model's step pays for LoRA (bench/lora.py). Base-model rows
are in no segment and cost nothing; a step with no adapter rows costs one attribute check per
layer.

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

# The rows of the flat batch one adapter runs: a run of them, or their indices [n] int64.
Rows = slice | Tensor


@dataclass
class LoRABatch:
    """Which rows of the step being run use which slot: set by the runner before each forward,
    read by every LoRA layer."""

    segments: list[tuple[int, Rows]] = field(default_factory=list)

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
        # Each slot's (a^T [in, w], bt [w, out]) views, made once per load; None: width 0.
        self._views: list[tuple[Tensor, Tensor] | None] = [None] * num_slots

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
            self._views[slot] = None
            return
        w = factors.width
        self.a[slot, :w].copy_(factors.a)
        self.bt[slot, :w].copy_(factors.bt)
        self.width[slot] = w
        self._views[slot] = (self.a[slot, :w].t(), self.bt[slot, :w])

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each segment's term. x: [T', in], y: [T', out] (T' >= the real rows: padded
        rows are in no segment).

        On one thread: these GEMMs are small, and handing each to the thread pool measured
        4-8x slower per call than running it inline, between the native kernels' steps."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._add(x, y)
        finally:
            torch.set_num_threads(threads)

    def _add(self, x: Tensor, y: Tensor) -> None:
        for slot, rows in self.batch.segments:
            views = self._views[slot]
            if views is None:
                continue
            a_t, bt = views
            shrunk = x[rows] @ a_t  # [n, w]
            if isinstance(rows, slice):
                y[rows].addmm_(shrunk, bt)
            else:
                y.index_add_(0, rows, shrunk @ bt)
