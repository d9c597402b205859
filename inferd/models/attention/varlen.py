"""The CUDA varlen backend: every row of the batch in one varlen flash-attention call per layer
(memory-efficient attention in float32), each sequence's context gathered from the cache with one
index_select. The causal mask is aligned bottom-right, so a decode row or a chunk after a cached
prefix sees its whole context. It has no sliding window and no sinks.

Half precision gathers whole cache blocks (one tile copy per block, not per key) and `seqused_k`
keeps each span's unused tail out; float32, which FlashAttention does not serve, gathers key by
key. A half-precision CUDA-graph decode batch takes the same call over its fixed, padded spans
(`graph_decode_metadata`).
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
    cache_slots,
    device_tensor,
    load_rows,
)


@dataclass
class VarlenBatch:
    """Every row of a CUDA batch for one varlen attention call: sequence i's queries are rows
    cu_q[i]:cu_q[i+1] of the flat batch, its keys the cache slots kv_slots[cu_k[i]:cu_k[i+1]] (its
    whole context after this step's write), causal from the bottom right."""

    cu_q: Tensor  # [N + 1] int32
    cu_k: Tensor  # [N + 1] int32
    max_q: int
    max_k: int
    # [total_k] int64; None when kv_blocks names the keys instead.
    kv_slots: Tensor | None = None
    # [total_k / block_size] int64: the same keys as whole cache blocks (one tile copy per block,
    # not per key); every span is then a whole number of blocks.
    kv_blocks: Tensor | None = None
    # [N] int32: how many keys of each cu_k span are real, the rest padding (a CUDA-graph decode
    # batch has fixed spans); None when every span is all real. Half precision only.
    seqused_k: Tensor | None = None


class VarlenBackend:
    def forward(
        self, layer: PagedAttention, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata
    ) -> Tensor:
        assert layer.window is None, "the varlen call has no sliding window"
        vb = meta.batch
        if vb is None:
            return torch.empty_like(q, memory_format=torch.contiguous_format)
        cache = layer.kv_cache
        if vb.kv_blocks is not None:
            k = load_rows(cache[0].index_select(0, vb.kv_blocks).flatten(0, 1), q)
            v = load_rows(cache[1].index_select(0, vb.kv_blocks).flatten(0, 1), q)
        else:
            assert vb.kv_slots is not None
            k = load_rows(cache[0].flatten(0, 1).index_select(0, vb.kv_slots), q)
            v = load_rows(cache[1].flatten(0, 1).index_select(0, vb.kv_slots), q)
        return varlen_attention(q.contiguous(), k, v, vb, layer.scale)


VARLEN = VarlenBackend()


@dataclass
class VarlenMetadata(AttentionMetadata):
    backend: ClassVar[AttentionBackend[VarlenMetadata]] = VARLEN
    batch: VarlenBatch | None = None  # None: an empty batch


class VarlenBuilder:
    """Each sequence's queries against its whole context (cached prefix + this step's tokens), in
    the flat batch's order; `blocks`: gather whole blocks (half precision), else slot by slot."""

    def __init__(self, block_size: int, device: torch.device, blocks: bool) -> None:
        self.block_size = block_size
        self.device = device
        self.blocks = blocks

    def build(self, batch: ScheduledBatch) -> VarlenMetadata:
        meta = VarlenMetadata(slot_mapping=batch.slot_mapping, num_decode_tokens=batch.num_decode)
        if batch.q_lens:
            meta.batch = self._batch(batch)
        return meta

    def _batch(self, batch: ScheduledBatch) -> VarlenBatch:
        q_len = batch.q_lens
        ctx = [s + n for s, n in zip(batch.starts, q_len, strict=True)]
        cu_q = device_tensor(np.cumsum([0, *q_len]), self.device, np.int32)
        if self.blocks:
            # Whole blocks (a tile copy each); each span ends in its last block's unused slots.
            bs = self.block_size
            nbs = [(n + bs - 1) // bs for n in ctx]
            blocks = [b for ids, nb in zip(batch.block_ids, nbs, strict=True) for b in ids[:nb]]
            return VarlenBatch(
                cu_q=cu_q,
                cu_k=device_tensor(np.cumsum([0, *nbs]) * bs, self.device, np.int32),
                max_q=max(q_len),
                max_k=max(nbs) * bs,
                kv_blocks=device_tensor(blocks, self.device),
                seqused_k=device_tensor(ctx, self.device, np.int32),
            )
        slots = np.concatenate(
            [
                cache_slots(ids, 0, n, self.block_size)
                for ids, n in zip(batch.block_ids, ctx, strict=True)
            ]
        )
        return VarlenBatch(
            cu_q=cu_q,
            cu_k=device_tensor(np.cumsum([0, *ctx]), self.device, np.int32),
            max_q=max(q_len),
            max_k=max(ctx),
            kv_slots=device_tensor(slots, self.device),
        )


def graph_decode_metadata(
    slots: Tensor, tables: Tensor, ctx_lens: Tensor, block_size: int
) -> VarlenMetadata:
    """A CUDA-graph decode batch (static buffers, B rows of [nb] blocks): row r's span is its nb
    blocks' slots; seqused_k keeps the keys past its context out."""
    b, nb = tables.shape
    offsets = torch.arange(b + 1, dtype=torch.int32, device=tables.device)
    span = nb * block_size
    vb = VarlenBatch(
        cu_q=offsets,
        cu_k=offsets * span,
        max_q=1,
        max_k=span,
        seqused_k=ctx_lens.to(torch.int32),
        kv_blocks=tables.flatten(),
    )
    return VarlenMetadata(slot_mapping=slots, num_decode_tokens=b, batch=vb)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, vb: VarlenBatch, scale: float) -> Tensor:
    """q [total_q, Hq, D], k / v [total_k, Hkv, D] packed by vb's offsets -> [total_q, Hq, D].

    Half precision runs FlashAttention-2's varlen kernel (GQA native); float32, which flash does
    not serve, the memory-efficient kernel with K/V heads repeated to Hq. Both are PyTorch's own
    kernels (the ones its nested-tensor SDPA calls), causal from the bottom right."""
    group = q.shape[1] // k.shape[1]
    if q.dtype in (torch.float16, torch.bfloat16):
        if vb.max_q == 1 and group > 1:
            # Decode rows only: the G query heads that share a KV head become G query rows of
            # that head (non-causal: one position sees every key), so a tile holds G rows, not 1.
            n, hq, d = q.shape
            rows = q.view(n, -1, group, d).transpose(1, 2).reshape(n * group, -1, d)
            o: Tensor = torch.ops.aten._flash_attention_forward(
                rows,
                k,
                v,
                vb.cu_q * group,
                vb.cu_k,
                group,
                vb.max_k,
                0.0,
                False,
                False,
                scale=scale,
                seqused_k=vb.seqused_k,
            )[0]
            return o.view(n, group, -1, d).transpose(1, 2).reshape(n, hq, d)
        out: Tensor = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            vb.cu_q,
            vb.cu_k,
            vb.max_q,
            vb.max_k,
            0.0,
            True,
            False,
            scale=scale,
            seqused_k=vb.seqused_k,
        )[0]
        return out
    assert vb.seqused_k is None, "padded spans need FlashAttention (half precision)"
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.ops.aten._efficient_attention_forward(
        q[None],
        k[None],
        v[None],
        None,
        vb.cu_q,
        vb.cu_k,
        vb.max_q,
        vb.max_k,
        0.0,
        _CAUSAL_FROM_BOTTOM_RIGHT,
        False,
        scale=scale,
    )[0]
    return out[0]


# The memory-efficient kernel's custom_mask_type: 2 = causal aligned to the bottom-right corner
# (query i of a q_len-row block sees keys up to k_len - q_len + i).
_CAUSAL_FROM_BOTTOM_RIGHT = 2


def varlen_supported(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether varlen_attention runs here: CUDA only, checked by one tiny call (an old GPU, a
    head size the kernel lacks, or a PyTorch build without the kernel fall back to SDPA)."""
    if device.type != "cuda":
        return False
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    vb = VarlenBatch(cu_q=cu, cu_k=cu, max_q=2, max_k=2, kv_slots=torch.empty(0))
    q = torch.zeros(3, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(3, num_kv_heads, head_dim, dtype=dtype, device=device)
    try:
        varlen_attention(q, kv, kv, vb, 1.0)
    except (RuntimeError, NotImplementedError):
        return False
    return True
