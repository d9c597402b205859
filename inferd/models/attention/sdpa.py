"""The PyTorch backend: gathers from the cache, then SDPA with a padding / causal mask.

Decode rows run in groups of similar context length (each a [B_g, nb_g] block table and a
[B_g, 1, 1, nb_g * block_size] mask), so one short sequence does not pay for the longest one's
padding; each group's whole tiles are gathered with one index_select. A prefill chunk runs as its
own span: plain causal when it is its whole context, else its context gathered slot by slot with
a [query_len, context_len] mask. A CUDA-graph decode batch is one group over its fixed, padded
block table (`graph_decode_metadata`).

A sliding window W (`PagedAttention.window`) narrows the masks: query position p sees keys
(p - W, p] only; one narrowed mask per window and step, shared by the layers with that window.
Builders read contexts from the first block a sequence's window still reads (released blocks are
never gathered).

Attention sinks (gpt-oss, `PagedAttention.sinks`): each query head has a learned logit that joins
its softmax's denominator and adds nothing to the output, i.e. a key whose score is the sink and
whose value is zero. This backend appends exactly that key: one zero K/V row after the gathered
keys, with the mask turned into a float bias whose extra column is the head's sink (the zero key
scores 0, plus the bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from inferd.kv_cache.block_manager import first_kept_block
from inferd.models.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    ScheduledBatch,
    cache_slots,
    device_tensor,
    load_rows,
)

# A decode group keeps adding (shorter) sequences while their block count is at least this share of
# the group's longest, bounding the padded keys each group reads to 1 / ratio of the real ones.
_DECODE_GROUP_RATIO = 0.85


@dataclass
class PrefillSpan:
    """One prefill chunk: queries [query_start, query_start + query_len) of the flat batch."""

    query_start: int
    query_len: int
    # Tokens of this sequence in the cache after this step's write (cached prefix + this chunk).
    context_len: int
    # [context_len] cache slots of the whole context; None when the chunk is the whole context.
    context_slots: Tensor | None = None
    # [query_len, context_len] bool, True = may attend; None when plain causal.
    mask: Tensor | None = None
    # The mask narrowed to a sliding window, per window (built by the first layer that needs it).
    window_masks: dict[int, Tensor] = field(default_factory=dict)

    def window_mask(self, window: int, device: torch.device) -> Tensor:
        """[query_len, context_len] bool: query i (position context_len - query_len + i) sees
        keys (position - window, position]. Key index = position in either form of span."""
        mask = self.window_masks.get(window)
        if mask is None:
            pos = torch.arange(self.context_len, device=device)
            q_pos = pos[self.context_len - self.query_len :, None]
            mask = (pos[None, :] <= q_pos) & (pos[None, :] > q_pos - window)
            self.window_masks[window] = mask
        return mask


class SdpaBackend:
    def forward(
        self, layer: PagedAttention, q: Tensor, k: Tensor, v: Tensor, meta: SdpaMetadata
    ) -> Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        start = 0
        masks = meta.decode_masks(layer.window) if meta.decode_groups else []
        for (block_table, _), mask in zip(meta.decode_groups, masks, strict=True):
            n = block_table.shape[0]
            out[start : start + n] = _decode(layer, q[start : start + n], block_table, mask)
            start += n
        for span in meta.prefills:
            sl = slice(span.query_start, span.query_start + span.query_len)
            out[sl] = _prefill(layer, q[sl], k[sl], v[sl], span)
        return out


SDPA = SdpaBackend()


@dataclass
class SdpaMetadata(AttentionMetadata):
    backend: ClassVar[AttentionBackend[SdpaMetadata]] = SDPA
    # Decode groups: each a [B_g, nb_g] block table with a [B_g, 1, 1, nb_g * block_size] bool
    # mask (True = attend), over the first num_decode_tokens tokens in order.
    decode_groups: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Decode groups' masks narrowed to a sliding window: window -> one mask per group.
    window_decode_masks: dict[int, list[Tensor]] = field(default_factory=dict)

    def decode_masks(self, window: int | None) -> list[Tensor]:
        """The decode groups' [B, 1, 1, L] masks, narrowed to `window` (a row of context c sees
        keys [c - window, c)) when one is given."""
        masks = [mask for _, mask in self.decode_groups]
        if window is None:
            return masks
        narrowed = self.window_decode_masks.get(window)
        if narrowed is None:
            narrowed = [_narrow(mask, window) for mask in masks]
            self.window_decode_masks[window] = narrowed
        return narrowed


class SdpaBuilder:
    """Decode length groups and prefill spans; `kv_window`: the model's widest window (None: a
    layer without one), which bounds the blocks a sequence still reads."""

    def __init__(self, block_size: int, kv_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.kv_window = kv_window
        self.device = device

    def build(self, batch: ScheduledBatch) -> SdpaMetadata:
        meta = SdpaMetadata(slot_mapping=batch.slot_mapping, num_decode_tokens=batch.num_decode)
        meta.decode_groups = self._decode_groups(batch)
        query_start = batch.num_decode
        for s in range(batch.num_decode, len(batch.q_lens)):
            meta.prefills.append(self._prefill_span(batch, s, query_start))
            query_start += batch.q_lens[s]
        return meta

    def _decode_groups(self, batch: ScheduledBatch) -> list[tuple[Tensor, Tensor]]:
        """Cut decode rows (sorted longest first, per adapter) into groups of similar block
        counts."""
        groups: list[tuple[Tensor, Tensor]] = []
        bs, n = self.block_size, batch.num_decode
        starts, block_ids = batch.starts[:n], batch.block_ids
        # Each row's blocks from the first its window reads (released ones are never gathered).
        first = [first_kept_block(start, self.kv_window, bs) for start in starts]
        width = [start // bs + 1 - f for start, f in zip(starts, first, strict=True)]
        i = 0
        while i < n:
            max_nb = width[i]
            j = i
            # Rows come longest first, within each LoRA adapter's run (the runner's order).
            while j < n and _DECODE_GROUP_RATIO * max_nb <= width[j] <= max_nb:
                j += 1
            table = np.zeros((j - i, max_nb), dtype=np.int64)
            ctx = np.empty(j - i, dtype=np.int64)
            for r in range(j - i):
                fb, w = first[i + r], width[i + r]
                table[r, :w] = block_ids[i + r][fb : fb + w]
                ctx[r] = starts[i + r] + 1 - fb * bs
            keys = np.arange(max_nb * bs)
            mask = torch.from_numpy(keys[None, :] < ctx[:, None]).view(j - i, 1, 1, max_nb * bs)
            groups.append((device_tensor(table, self.device), mask.to(self.device)))
            i = j
        return groups

    def _prefill_span(self, batch: ScheduledBatch, s: int, query_start: int) -> PrefillSpan:
        """Sequence s's span, its context from the first block its window reads (key index =
        position - lo)."""
        start, q_len = batch.starts[s], batch.q_lens[s]
        end = start + q_len
        lo = first_kept_block(start, self.kv_window, self.block_size) * self.block_size
        span = PrefillSpan(query_start=query_start, query_len=q_len, context_len=end - lo)
        if start > 0:
            # Queries are the last q_len positions; query i sees keys 0 .. start + i.
            slots = cache_slots(batch.block_ids[s], lo, end, self.block_size)
            span.context_slots = device_tensor(slots, self.device)
            pos, q_pos = np.arange(lo, end), np.arange(start, end)
            span.mask = torch.from_numpy(pos[None, :] <= q_pos[:, None]).to(self.device)
        return span


def graph_decode_metadata(
    slots: Tensor, tables: Tensor, ctx_lens: Tensor, block_size: int
) -> SdpaMetadata:
    """A CUDA-graph decode batch (static buffers, B rows of [nb] blocks) as one decode group:
    row r sees keys [0, ctx_lens[r]) of its table's blocks."""
    b, nb = tables.shape
    keys = torch.arange(nb * block_size, device=tables.device)
    mask = (keys[None, :] < ctx_lens[:, None]).view(b, 1, 1, -1)
    return SdpaMetadata(slot_mapping=slots, num_decode_tokens=b, decode_groups=[(tables, mask)])


def _narrow(mask: Tensor, window: int) -> Tensor:
    # mask: [B, 1, 1, L], True for keys [0, ctx) of each row -> only keys [ctx - window, ctx)
    keys = torch.arange(mask.shape[-1], device=mask.device)
    ctx = mask.sum(-1, keepdim=True)
    return mask & (keys >= ctx - window)


def _decode(layer: PagedAttention, q: Tensor, block_table: Tensor, mask: Tensor) -> Tensor:
    # GQA without copying K/V per query head: the G = Hq / Hkv query heads that share one KV
    # head become G query rows against that head.  q: [B, Hq, D] -> [B, Hkv, G, D]
    b, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
    qg = q.view(b, hkv, -1, d)
    # Gather whole [bs, Hkv, D] tiles of the group's blocks. SDPA reads the transposed views
    # directly; making them contiguous first would cost another copy.
    # [B * nb, bs, Hkv, D] -> [B, L, Hkv, D] -> [B, Hkv, L, D]
    flat = block_table.flatten()
    shape = (b, -1, hkv, d)
    k = load_rows(layer.kv_cache[0].index_select(0, flat), q).view(shape).transpose(1, 2)
    v = load_rows(layer.kv_cache[1].index_select(0, flat), q).view(shape).transpose(1, 2)
    bias: Tensor | None = mask
    if layer.sinks is not None:  # query head h = kv head * G + g
        k, v, bias = _with_sinks(k, v, mask, layer.sinks.view(1, hkv, -1, 1))
    o = _sdpa(qg, k, v, attn_mask=bias, scale=layer.scale)
    return o.reshape(b, layer.num_heads, d)


def _prefill(layer: PagedAttention, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan) -> Tensor:
    if span.context_slots is not None:
        k = load_rows(layer.kv_cache[0].flatten(0, 1).index_select(0, span.context_slots), q)
        v = load_rows(layer.kv_cache[1].flatten(0, 1).index_select(0, span.context_slots), q)
    # [S, H, D] -> [1, H, S, D]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    mask = span.mask
    if layer.window is not None and span.context_len > layer.window:
        mask = span.window_mask(layer.window, q.device)
    if layer.sinks is not None:
        if mask is None:  # plain causal: the chunk is the whole context
            mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        kt, vt, mask = _with_sinks(kt, vt, mask[None, None], layer.sinks.view(1, -1, 1, 1))
    o = _sdpa(
        qt,
        kt,
        vt,
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
    return o.squeeze(0).transpose(0, 1)


def _with_sinks(k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """K, V [..., L, D] with a zero row appended, and `mask` (bool, True = attend, broadcastable
    to the scores [..., Lq, L]) as a float bias with one more column, each head's sink (`sinks`
    broadcastable to [..., Lq, 1]): that key's score is the sink, its value adds nothing."""
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    k, v = torch.cat((k, zero), dim=-2), torch.cat((v, zero), dim=-2)
    bias = torch.zeros(mask.shape, dtype=k.dtype, device=k.device).masked_fill(~mask, -torch.inf)
    lead = [max(a, b) for a, b in zip(bias.shape[:-1], sinks.shape[:-1], strict=True)]
    sink = sinks.to(k.dtype).expand(*lead, 1)
    return k, v, torch.cat((bias.expand(*lead, bias.shape[-1]), sink), dim=-1)


# SDPA's backends on CUDA, cuDNN's left out: it builds an execution plan for every new shape
# (hundreds of milliseconds each), and every prefill chunk brings a new length. With it, bfloat16
# steps with a prefill took 0.89 s on an H100 (Qwen2-0.5B shape, 1,900 prefill tokens) against
# 0.10 s in float32, which cuDNN does not serve. None: PyTorch's own choice (bench A/B).
CUDA_SDPA_BACKENDS: list[SDPBackend] | None = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
    if not q.is_cuda or CUDA_SDPA_BACKENDS is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
