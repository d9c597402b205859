"""The low-rank term of many adapters in one batch: each linear layer adds its adapters' terms to
their own rows only (S-LoRA / Punica's segmented GEMM, SGMV).

The base GEMM runs once over every row of the step, whatever adapter each row runs under; then
for each adapter present (its slot s, its rows), small GEMMs: one shrink, and one expand per
shard it targets (q/k/v or gate/up), over that shard's output columns only (adapter.py):

    v = x[rows] at_s;   y[rows, c0:c1] += v[:, r0:r1] bt_s,i

The runner orders the step's rows so each adapter's rows come together (its decode rows, then
its prompt chunks): one run of rows is a view, rows in both parts are gathered by an index built
once per step and shared by every layer. Base-model rows are in no segment and cost nothing; a
step with no adapter rows costs one attribute check per layer.

On CPU these GEMMs run on one thread: between the native kernels' steps, each small GEMM
measured 4-8x slower per call on two threads than on one (the thread pools hand over), and a
native kernel for them measured no faster end to end, its decode rows bound by reading the
adapters' weights from memory (bench/NOTES.md, "LoRA").

Slots: a layer holds `max_loras` slots, each an adapter's packed factors for it (adapter.py) or
none. A slot refers to the adapter's own tensors on the model's device (no copy on CPU); the
manager fills a slot when a step first needs its adapter.
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

    def __init__(self, batch: LoRABatch, num_slots: int, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self._factors: list[LinearFactors | None] = [None] * num_slots

    @property
    def active(self) -> bool:
        return self.batch.active

    def load(self, slot: int, factors: LinearFactors | None) -> None:
        """Puts an adapter's factors for this layer in `slot` (None: it has none here)."""
        self._factors[slot] = None if factors is None else factors.to(self.device)

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each segment's term. x: [T', in], y: [T', out] (T' >= the real rows: padded
        rows are in no segment)."""
        if x.device.type != "cpu":
            self._add(x, y)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._add(x, y)
        finally:
            torch.set_num_threads(threads)

    def _add(self, x: Tensor, y: Tensor) -> None:
        for slot, rows in self.batch.segments:
            factors = self._factors[slot]
            if factors is None:
                continue
            shrunk = x[rows] @ factors.at  # [n, w]
            if isinstance(rows, slice):
                out = y[rows]
                for b in factors.blocks:
                    out[:, b.c0 : b.c1].addmm_(shrunk[:, b.r0 : b.r1], b.bt)
                continue
            delta = y.new_zeros(shrunk.shape[0], y.shape[1])
            for b in factors.blocks:
                delta[:, b.c0 : b.c1] = shrunk[:, b.r0 : b.r1] @ b.bt
            y.index_add_(0, rows, delta)
