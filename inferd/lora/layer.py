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

Per adapter that is a handful of small ops per layer, and with many adapters in a step their
fixed cost, not their arithmetic, is what the step pays. So adapters with few rows each (decode)
run grouped when there are enough of them: every slot at once, rows padded to a common count,
one batched GEMM for the shrink and one per shard for the expand (`GroupedRows`); their cost is
then reading every slot's factors, which the layer keeps stacked for it (a copy of each resident
adapter's factors). A native kernel for these GEMMs measured no faster end to end: decode rows
are bound by reading the adapters' weights from memory (bench/NOTES.md, "LoRA").

Slots: a layer holds `max_loras` slots, each an adapter's packed factors for it (adapter.py) or
none: the adapter's own tensors on the model's device for one adapter at a time, and the stacked
copy for the grouped pass (allocated when a grouped pass first runs). The manager fills a slot
when a step first needs its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from inferd.lora.adapter import LinearFactors
from inferd.models.linear import LowRankTerm

# The rows of the flat batch one adapter runs: a run of them, or their indices [n] int64.
Rows = slice | Tensor


class LoRATarget(Protocol):
    """A linear layer adapters may target: inferd's `Linear` (inferd/models/linear.py) or the
    image lane's wrapped `nn.Linear` (inferd/diffusion/lora.py). `shards` names the checkpoint
    layers stacked along its output dim, with their rows; `lora` is the term it adds."""

    in_features: int
    out_features: int
    shards: list[tuple[str, int]]
    lora: LowRankTerm | None


@dataclass(frozen=True)
class GroupedRows:
    """Adapters with few rows each, every slot at once: slot s's rows go to positions
    [s * max_rows, ...) of a zero-padded [num_slots * max_rows] batch. `src`: their rows of the
    flat batch, `dst`: their positions there (both [n] int64)."""

    src: Tensor
    dst: Tensor
    max_rows: int
    # The slots the grouped rows run (their adapters).
    slots: tuple[int, ...] = ()
    # (lo, hi) when src is exactly rows lo..hi-1 in order: an add into a view, no scatter.
    run: tuple[int, int] | None = None


@dataclass
class LoRABatch:
    """Which rows of the step being run use which slot: set by the runner before each forward,
    read by every LoRA layer. `segments` run one adapter at a time; `grouped`, all at once."""

    segments: list[tuple[int, Rows]] = field(default_factory=list)
    grouped: GroupedRows | None = None

    @property
    def active(self) -> bool:
        return bool(self.segments) or self.grouped is not None


class LoRALayer:
    """One linear layer's slots and its term over a step's segments (the module docstring)."""

    def __init__(
        self,
        batch: LoRABatch,
        linear: LoRATarget,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.device = device
        self.max_rank = max_rank
        self._factors: list[LinearFactors | None] = [None] * num_slots
        # Slots whose stacked copy is not made yet; the shards each slot's adapter targets here.
        self._stale: set[int] = set()
        self._shards: list[frozenset[int]] = [frozenset()] * num_slots
        # The grouped path's copy of each slot: A^T of every shard at rank columns
        # [i * max_rank, (i + 1) * max_rank), B^T per shard, zero where an adapter has less.
        self.cols: list[tuple[int, int]] = []
        start = 0
        for _, rows in linear.shards:
            self.cols.append((start, start + rows))
            start += rows
        # Allocated when a grouped pass first runs: a lane that never groups never holds them.
        self._stacked_shape = (num_slots, linear.in_features, len(self.cols) * max_rank)
        self._dtype = dtype
        self.at_slots = torch.empty(0)
        self.bt_slots: list[Tensor] = []

    @property
    def active(self) -> bool:
        return self.batch.active

    def load(self, slot: int, factors: LinearFactors | None) -> None:
        """Puts an adapter's factors for this layer in `slot` (None: it has none here). The
        stacked copy is made when a grouped pass first reads the slot, so an adapter that only
        ever runs alone (a cold adapter's first request) costs no copy."""
        self._factors[slot] = None if factors is None else factors.to(self.device)
        self._shards[slot] = (
            frozenset()
            if factors is None
            else frozenset(self.cols.index((b.c0, b.c1)) for b in factors.blocks)
        )
        self._stale.add(slot)

    def _allocate_stacked(self) -> None:
        num_slots, _, _ = self._stacked_shape
        self.at_slots = torch.zeros(self._stacked_shape, dtype=self._dtype, device=self.device)
        self.bt_slots = [
            torch.zeros(num_slots, self.max_rank, c1 - c0, dtype=self._dtype, device=self.device)
            for c0, c1 in self.cols
        ]
        self._stale = set(range(num_slots))

    def _stack(self, slot: int) -> None:
        """Copies the slot's factors into the stacked tensors the grouped pass reads."""
        factors = self._factors[slot]
        self.at_slots[slot].zero_()
        for bt in self.bt_slots:
            bt[slot].zero_()
        if factors is None:
            return
        for b in factors.blocks:
            i = self.cols.index((b.c0, b.c1))
            lo = i * self.max_rank
            self.at_slots[slot, :, lo : lo + b.r1 - b.r0] = factors.at[:, b.r0 : b.r1]
            self.bt_slots[i][slot, : b.r1 - b.r0] = b.bt

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each segment's term. x: [T', in], y: [T', out] (T' >= the real rows: padded
        rows are in no segment). On CPU on one thread: the Qwen2-0.5B shape's 8-adapter mix
        measured 0.70-0.72x base so, 0.56-0.62x on two (llama-32m's 0.61 against 0.64-0.69: the
        larger model decides; bench/NOTES.md, "LoRA")."""
        if x.device.type != "cpu":
            self._add(x, y)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._add(x, y)
        finally:
            torch.set_num_threads(threads)

    def add_batch(self, x: Tensor, y: Tensor, batch: LoRABatch) -> None:
        """y += the term of `batch`'s rows, a batch other than the layer's own (the image lane
        sets one per token count: inferd/diffusion/lora.py), on the threads the caller runs."""
        self._add(x, y, batch)

    def _add(self, x: Tensor, y: Tensor, batch: LoRABatch | None = None) -> None:
        batch = self.batch if batch is None else batch
        if batch.grouped is not None:
            self._add_grouped(x, y, batch.grouped)
        for slot, rows in batch.segments:
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

    def _add_grouped(self, x: Tensor, y: Tensor, g: GroupedRows) -> None:
        """Every slot's rows in one batched GEMM per shard (a handful of ops whatever the
        number of adapters): x [T', in] -> padded [S, M, in] -> v [S, M, w] -> y's columns."""
        # Only the shards some grouped adapter targets here (none: the layer is skipped).
        shards = frozenset().union(*(self._shards[s] for s in g.slots))
        if not shards:
            return
        if not self.bt_slots:
            self._allocate_stacked()
        for slot in self._stale:
            self._stack(slot)
        self._stale.clear()
        slots = self.at_slots.shape[0]
        padded = x.new_zeros(slots * g.max_rows, x.shape[1])
        padded.index_copy_(0, g.dst, x.index_select(0, g.src))
        v = torch.bmm(padded.view(slots, g.max_rows, -1), self.at_slots)  # [S, M, w]
        r = self.max_rank
        for i in sorted(shards):
            c0, c1 = self.cols[i]
            out = torch.bmm(v[:, :, i * r : (i + 1) * r], self.bt_slots[i])  # [S, M, c1 - c0]
            delta = out.view(-1, c1 - c0).index_select(0, g.dst)  # [n, c1 - c0], src's order
            if g.run is not None:  # the rows are one run (decode rows, sorted by adapter)
                y[g.run[0] : g.run[1], c0:c1].add_(delta)
            else:
                y[:, c0:c1].index_add_(0, g.src, delta)
