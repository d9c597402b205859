"""The low-rank term of many adapters in one batch: each linear layer adds its adapters' terms to
their own rows only (S-LoRA / Punica's segmented GEMV, SGMV).

The base GEMM runs once over every row of the step, whatever adapter each row runs under; then
for each adapter present (its slot s, its rows):

    y[rows] += (x[rows] at_s) bt_s

Two paths, the same sums up to float32 rounding order:
- native (CPU, float32 or bfloat16, where the kernels built): one call per layer for every
  adapter with few rows in the step (decode), on torch's OpenMP pool (kernels/lora.cpp);
- PyTorch (the reference, CUDA, and adapters with many rows: prompt chunks): two GEMMs per
  adapter. The runner orders the step's rows so
  each adapter's rows come together (its decode rows, then its prompt chunks); one run of rows is
  a view, rows in both parts are gathered by an index built once per step. On CPU these small
  GEMMs run on one thread: between the native kernels, each measured 4-8x slower per call on two
  (the thread pools hand over).

Base-model rows are in no segment and cost nothing; a step with no adapter rows costs one
attribute check per layer.

Slots: a layer holds `max_loras` slots, each an adapter's packed factors for it (adapter.py) or
none. A slot refers to the adapter's own tensors (on the model's device: no copy on CPU); the
manager fills a slot when a step first needs its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inferd.lora.adapter import LinearFactors
from inferd.models.kernels.lora import SgmvKernel, SgmvStep, SgmvTable

# The rows of the flat batch one adapter runs: a run of them, or their indices [n] int64.
Rows = slice | Tensor


@dataclass
class LoRABatch:
    """Which rows of the step being run use which slot: set by the runner before each forward,
    read by every LoRA layer: `segments` run on the PyTorch path, `native` on the kernel (the
    manager splits them)."""

    segments: list[tuple[int, Rows]] = field(default_factory=list)
    native: SgmvStep | None = None

    @property
    def active(self) -> bool:
        return bool(self.segments) or self.native is not None


class LoRALayer:
    """One linear layer's slots and its term over a step's segments (the module docstring)."""

    def __init__(
        self, batch: LoRABatch, num_slots: int, device: torch.device, kernel: SgmvKernel | None
    ) -> None:
        self.batch = batch
        self.device = device
        self.kernel = kernel
        self._factors: list[LinearFactors | None] = [None] * num_slots
        self._table = SgmvTable(num_slots)

    @property
    def active(self) -> bool:
        return self.batch.active

    def load(self, slot: int, factors: LinearFactors | None) -> None:
        """Puts an adapter's factors for this layer in `slot` (None: it has none here)."""
        if factors is not None:
            factors = factors.to(self.device)
        self._factors[slot] = factors
        self._table.set(slot, None if factors is None else (factors.at, factors.bt, factors.spans))

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each segment's term. x: [T', in], y: [T', out] (T' >= the real rows: padded
        rows are in no segment)."""
        step = self.batch.native
        if step is not None:
            assert self.kernel is not None and SgmvKernel.takes(x)
            self.kernel(x, y, step, self._table)
        if not self.batch.segments:
            return
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
                y[rows].addmm_(shrunk, factors.bt)
            else:
                y.index_add_(0, rows, shrunk @ factors.bt)
