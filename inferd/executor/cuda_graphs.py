"""Decode steps replayed from captured CUDA graphs.

A pure-decode step's launch overhead dominates on a GPU (hundreds of small kernels per step), so
pure-decode batches run from CUDA graphs, one per (batch bucket, block bucket). Inputs are copied
into static buffers; padded rows write their K/V into a scratch block that no request owns and
attend to one key only, so they never touch real cache contents.

Graphs are captured lazily, on the first step that needs a bucket, into one shared memory pool.
The same static-buffer path runs eagerly when no GPU is present (`capture=False`), which is how
the CPU test suite checks the padding and scratch logic that the graphs replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from inferd.models.attention.sdpa import graph_decode_metadata as sdpa_decode
from inferd.models.attention.varlen import graph_decode_metadata as varlen_decode
from inferd.scheduler.output import ScheduledChunk

if TYPE_CHECKING:
    from inferd.models.registry import CausalLM

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def _block_buckets(max_blocks: int) -> list[int]:
    out, nb = [], 4
    while nb < max_blocks:
        out.append(nb)
        nb *= 2
    return [*out, max_blocks]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        scratch_block: int,
        capture: bool,
        varlen: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.capture = capture
        # Attention by the varlen kernel over each row's padded span, reading only its real keys
        # (no padding mask), else SDPA with a padding mask (models/attention/select.py's rule).
        self.varlen = varlen
        self.batch_buckets = [b for b in _BATCH_BUCKETS if b <= max_num_seqs] or [1]
        if self.batch_buckets[-1] < min(max_num_seqs, _BATCH_BUCKETS[-1]):
            self.batch_buckets.append(min(max_num_seqs, _BATCH_BUCKETS[-1]))
        self.block_buckets = _block_buckets(-(-max_model_len // block_size))
        bmax, nbmax = self.batch_buckets[-1], self.block_buckets[-1]
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.slots = torch.full((bmax,), self.scratch_slot, dtype=torch.int64, device=device)
        self.tables = torch.zeros(bmax, nbmax, dtype=torch.int64, device=device)
        self.ctx_lens = torch.ones(bmax, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], Callable[[], Tensor]] = {}
        self.pool: Any = None

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def can_run(self, decode: list[ScheduledChunk], num_tokens: int) -> bool:
        return 0 < len(decode) == num_tokens and len(decode) <= self.max_batch

    def run(self, decode: list[ScheduledChunk]) -> Tensor:
        """Hidden states [B, hidden] for decode rows (any order; output rows follow it)."""
        n = len(decode)
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]
        need = max(c.start // self.block_size + 1 for c in decode)
        nb = self.block_buckets[bisect.bisect_left(self.block_buckets, need)]
        self._fill(decode, b, nb)
        key = (b, nb)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._build(b, nb)
            self.graphs[key] = graph
        return graph()[:n]

    def _fill(self, decode: list[ScheduledChunk], b: int, nb: int) -> None:
        n, bs = len(decode), self.block_size
        ids = [c.request.all_token_ids[c.start] for c in decode]
        pos = [c.start for c in decode]
        slots = [c.block_ids[c.start // bs] * bs + c.start % bs for c in decode]
        table = torch.zeros(b, nb, dtype=torch.int64)
        for r, c in enumerate(decode):
            # Released entries (kv_cache OUT_OF_WINDOW, < 0) read block 0 under the window mask.
            blocks = [max(b, 0) for b in c.block_ids[: c.start // bs + 1]]
            table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        pad = b - n
        self.input_ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [self.scratch_slot] * pad), non_blocking=True)
        self.ctx_lens[:b].copy_(torch.tensor([p + 1 for p in pos] + [1] * pad), non_blocking=True)
        self.tables[:b, :nb].copy_(table, non_blocking=True)

    def _forward(self, b: int, nb: int) -> Tensor:
        build = varlen_decode if self.varlen else sdpa_decode
        meta = build(self.slots[:b], self.tables[:b, :nb], self.ctx_lens[:b], self.block_size)
        hidden: Tensor = self.model(self.input_ids[:b], self.positions[:b], meta)
        return hidden

    def _build(self, b: int, nb: int) -> Callable[[], Tensor]:
        if not self.capture:
            return lambda: self._forward(b, nb)
        # Warm up on a side stream (allocator, lazy kernels), then capture into the shared pool.
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(b, nb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b, nb)
        self.pool = graph.pool()

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay
