"""The native CPU kernel's backend (inferd/models/kernels): every row of the batch in one call per
layer (decode rows, prefill chunks with or without a cached prefix), K/V read in place through
the block table after this step's write. Plain prefill goes through it too: it skips the masked
half of the causal square, and measured faster than SDPA at 64-1024 tokens
(bench/attention_kernel.py, "prefill plain"). A sliding window W is the kernel's argument: it
skips the keys before each query's window. So are attention sinks (gpt-oss), as float32: they
join each row's softmax denominator where the kernel writes the row out.

On the fused path (models/layers.py) the fused RoPE + KV-write op has put this step's K/V in the
cache already, and `forward_cached` reads it; the model's last layer can attend for the sampling
rows alone (`NativeMetadata.sampled`, LlamaModel.forward's `out_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from inferd.models.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    ScheduledBatch,
)
from inferd.models.kernels import PagedBatch
from inferd.models.kernels.fused import padded_empty


class NativeBackend:
    def forward(
        self, layer: PagedAttention, q: Tensor, k: Tensor, v: Tensor, meta: NativeMetadata
    ) -> Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if meta.paged is not None:
            assert layer.kernel is not None, "a paged batch needs the native kernel"
            layer.kernel(
                out,
                q.contiguous(),
                layer.kv_cache,
                meta.paged,
                layer.scale,
                layer.window,
                _sinks(layer),
            )
        return out

    def forward_cached(
        self, layer: PagedAttention, q: Tensor, meta: NativeMetadata, out_rows: int
    ) -> Tensor:
        """The kernel over K/V already in the cache. q: [T, Hq, D] contiguous -> [out_rows, Hq,
        D], rows past T zero (they feed the padded rows of o_proj)."""
        assert layer.kernel is not None and meta.paged is not None
        shape = (layer.num_heads, layer.head_dim)
        out = padded_empty(q.shape[0], out_rows, shape, q.dtype)
        layer.kernel(out, q, layer.kv_cache, meta.paged, layer.scale, layer.window, _sinks(layer))
        return out


def _sinks(layer: PagedAttention) -> Tensor | None:
    """The layer's sinks as the kernel takes them (float32: no copy for a float32 model)."""
    return None if layer.sinks is None else layer.sinks.detach().float()


NATIVE = NativeBackend()


@dataclass
class NativeMetadata(AttentionMetadata):
    backend: ClassVar[AttentionBackend[NativeMetadata]] = NATIVE
    # Every row of the batch, read in place (None: an empty batch).
    paged: PagedBatch | None = None
    # Where some rows do not sample: the sampling rows' queries alone (each the last row of its
    # sequence's chunk, q_len 1), in the order of the rows that sample.
    sampled: PagedBatch | None = None

    def sampled_rows(self, rows: Tensor) -> NativeMetadata:
        """The metadata of the sampling rows `rows` alone (their slots, `sampled` as the batch)."""
        return NativeMetadata(slot_mapping=self.slot_mapping[rows], paged=self.sampled)


class NativeBuilder:
    """PagedBatch metadata for every row, and for the sampling rows where some rows do not
    sample. All int32 on the CPU."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, batch: ScheduledBatch) -> NativeMetadata:
        meta = NativeMetadata(slot_mapping=batch.slot_mapping, num_decode_tokens=batch.num_decode)
        if batch.q_lens:
            meta.paged, meta.sampled = _paged_batches(batch, self.block_size)
        return meta


def _paged_batches(batch: ScheduledBatch, bs: int) -> tuple[PagedBatch, PagedBatch | None]:
    q_len = np.array(batch.q_lens, dtype=np.int32)
    starts = np.cumsum(q_len, dtype=np.int32) - q_len
    ctx = np.array(batch.starts, dtype=np.int32) + q_len
    nbs = (ctx + bs - 1) // bs
    table = np.zeros((len(q_len), int(nbs.max())), dtype=np.int32)
    for r, ids in enumerate(batch.block_ids):
        table[r, : nbs[r]] = ids[: nbs[r]]
    paged = PagedBatch(
        block_tables=torch.from_numpy(table),
        q_start=torch.from_numpy(starts),
        q_len=torch.from_numpy(q_len),
        ctx_len=torch.from_numpy(ctx),
    )
    rows = np.array(batch.sample_rows, dtype=np.int64)
    n = int(rows.sum())
    if n == int(q_len.sum()):
        return paged, None  # every row samples
    owner = np.repeat(np.arange(len(q_len)), rows)
    # A sampling row's context ends at its own position: the chunk's end minus the rows after it.
    after = np.cumsum(rows)[owner] - 1 - np.arange(n)
    sampled = PagedBatch(
        block_tables=torch.from_numpy(np.ascontiguousarray(table[owner])),
        q_start=torch.from_numpy(np.arange(n, dtype=np.int32)),
        q_len=torch.from_numpy(np.ones(n, dtype=np.int32)),
        ctx_len=torch.from_numpy((ctx[owner] - after).astype(np.int32)),
    )
    return paged, sampled
