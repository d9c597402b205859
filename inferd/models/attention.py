"""Paged attention for the flattened, padding-free batch.

The batch is T real tokens from several sequences laid end to end: first one token per decoding
sequence (B of them), then each prefill chunk. K/V for token t are written to cache slot
`slot_mapping[t]` (slot = block_id * block_size + offset), then every query attends to its own
sequence's cached K/V.

KV cache layout, per layer: [2, num_blocks + 1, block_size, num_kv_heads, head_dim] (K then V; the
extra block is the CUDA-graph scratch block), so one block of one layer is a contiguous
[block_size, H_kv, D] tile. The cache's dtype may differ from the model's (`--kv-cache-dtype`);
an int8 cache's rows are D + 4 bytes, each with its own scale (models/kv_int8.py).

Two ways to read it:
- the native CPU kernel (`meta.paged`, inferd/models/kernels): every row of the batch in one
  call per layer (decode rows, prefill chunks with or without a cached prefix), K/V read in place
  through the block table after this step's write. Plain prefill goes through it too: it skips
  the masked half of the causal square, and measured faster than SDPA at 64-1024 tokens
  (bench/attention_kernel.py, "prefill plain");
- CUDA, eager steps (`meta.varlen`): every row of the batch in one varlen flash-attention call
  per layer (memory-efficient attention in float32), each sequence's context gathered from the
  cache with one index_select; the causal mask is aligned bottom-right, so a decode row or a
  chunk after a cached prefix sees its whole context;
- PyTorch (CUDA-graph decode, or no kernel): decode rows in length groups and prefixed chunks
  gather whole tiles with index_select, then SDPA with a padding / causal mask.

A layer with a sliding window W (`PagedAttention.window`) lets query position p see keys
(p - W, p] only: the native kernel takes W and skips the keys before it; the PyTorch path narrows
its masks (one mask per window and step, shared by the layers with that window). The varlen call
has no window, so the runner leaves it off for models with one.

Attention sinks (gpt-oss, `PagedAttention.sinks`): each query head has a learned logit that joins
its softmax's denominator and adds nothing to the output, i.e. a key whose score is the sink and
whose value is zero. The PyTorch path appends exactly that key: one zero K/V row after the gathered
keys, with the mask turned into a float bias whose extra column is the head's sink (the zero key
scores 0, plus the bias). The native kernel and the varlen call have no sinks: a model with them
runs the PyTorch path (the engine does not load the kernel for it; the runner keeps varlen off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from inferd.models import kv_int8
from inferd.models.kernels import PagedAttentionKernel, PagedBatch
from inferd.models.kernels.fused import padded_empty


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


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64
    num_decode_tokens: int = 0
    # Decode groups: each a [B_g, nb_g] block table with a [B_g, 1, 1, nb_g * block_size] bool
    # mask (True = attend), over the first num_decode_tokens tokens in order. Sequences are grouped
    # by length so one short sequence does not pay for the longest one's padding.
    decode_groups: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Native-kernel path: every row of the batch, read in place (decode_groups and prefills are
    # then empty).
    paged: PagedBatch | None = None
    # Native-kernel path, where some rows do not sample: the sampling rows' queries alone (each
    # the last row of its sequence's chunk, q_len 1), in the order of the rows that sample. The
    # model's last layer attends for these rows only (LlamaModel.forward, `out_rows`).
    sampled: PagedBatch | None = None
    # CUDA varlen path: every row of the batch in one call (decode_groups and prefills empty).
    varlen: VarlenBatch | None = None
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


def _narrow(mask: Tensor, window: int) -> Tensor:
    # mask: [B, 1, 1, L], True for keys [0, ctx) of each row -> only keys [ctx - window, ctx)
    keys = torch.arange(mask.shape[-1], device=mask.device)
    ctx = mask.sum(-1, keepdim=True)
    return mask & (keys >= ctx - window)


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; holds no parameters. `kv_cache` is bound by the runner."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
        sinks: bool = False,
    ) -> None:
        """`window`: each query sees its last `window` positions only (None: all before it).
        `sinks`: a learned logit per query head in each softmax (the parameter `sinks`)."""
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.kv_cache: Tensor = torch.empty(0)
        self.kernel: PagedAttentionKernel | None = None
        self.sinks = nn.Parameter(torch.empty(num_heads), False) if sinks else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        # q: [T, Hq, D]  k, v: [T, Hkv, D]  ->  out: [T, Hq, D]
        if self.kv_cache.numel():
            _write_kv(self.kv_cache, k, v, meta.slot_mapping)
        if meta.varlen is not None:
            assert self.window is None, "the varlen call has no sliding window"
            return self._varlen(q, meta.varlen)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if meta.paged is not None:
            assert self.kernel is not None, "a paged batch needs the native kernel"
            self.kernel(out, q.contiguous(), self.kv_cache, meta.paged, self.scale, self.window)
        start = 0
        masks = meta.decode_masks(self.window) if meta.decode_groups else []
        for (block_table, _), mask in zip(meta.decode_groups, masks, strict=True):
            n = block_table.shape[0]
            out[start : start + n] = self._decode(q[start : start + n], block_table, mask)
            start += n
        for span in meta.prefills:
            sl = slice(span.query_start, span.query_start + span.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], span)
        return out

    def forward_cached(self, q: Tensor, meta: AttentionMetadata, out_rows: int) -> Tensor:
        """The native kernel over K/V already in the cache (the fused RoPE + KV-write op put this
        step's there). q: [T, Hq, D] contiguous -> [out_rows, Hq, D], rows past T zero (they feed
        the padded rows of o_proj)."""
        assert self.kernel is not None and meta.paged is not None
        out = padded_empty(q.shape[0], out_rows, (self.num_heads, self.head_dim), q.dtype)
        self.kernel(out, q, self.kv_cache, meta.paged, self.scale, self.window)
        return out

    def _decode(self, q: Tensor, block_table: Tensor, mask: Tensor) -> Tensor:
        # GQA without copying K/V per query head: the G = Hq / Hkv query heads that share one KV
        # head become G query rows against that head.  q: [B, Hq, D] -> [B, Hkv, G, D]
        b = q.shape[0]
        qg = q.view(b, self.num_kv_heads, -1, self.head_dim)
        # Gather whole [bs, Hkv, D] tiles of the group's blocks. SDPA reads the transposed views
        # directly; making them contiguous first would cost another copy.
        # [B * nb, bs, Hkv, D] -> [B, L, Hkv, D] -> [B, Hkv, L, D]
        flat = block_table.flatten()
        shape = (b, -1, self.num_kv_heads, self.head_dim)
        k = _load(self.kv_cache[0].index_select(0, flat), q).view(shape).transpose(1, 2)
        v = _load(self.kv_cache[1].index_select(0, flat), q).view(shape).transpose(1, 2)
        bias: Tensor | None = mask
        if self.sinks is not None:  # query head h = kv head * G + g
            k, v, bias = _with_sinks(k, v, mask, self.sinks.view(1, self.num_kv_heads, -1, 1))
        o = _sdpa(qg, k, v, attn_mask=bias, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)

    def _varlen(self, q: Tensor, vb: VarlenBatch) -> Tensor:
        if vb.kv_blocks is not None:
            k = _load(self.kv_cache[0].index_select(0, vb.kv_blocks).flatten(0, 1), q)
            v = _load(self.kv_cache[1].index_select(0, vb.kv_blocks).flatten(0, 1), q)
        else:
            assert vb.kv_slots is not None
            k = _load(self.kv_cache[0].flatten(0, 1).index_select(0, vb.kv_slots), q)
            v = _load(self.kv_cache[1].flatten(0, 1).index_select(0, vb.kv_slots), q)
        return varlen_attention(q.contiguous(), k, v, vb, self.scale)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan) -> Tensor:
        if span.context_slots is not None:
            k = _load(self.kv_cache[0].flatten(0, 1).index_select(0, span.context_slots), q)
            v = _load(self.kv_cache[1].flatten(0, 1).index_select(0, span.context_slots), q)
        # [S, H, D] -> [1, H, S, D]
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        mask = span.mask
        if self.window is not None and span.context_len > self.window:
            mask = span.window_mask(self.window, q.device)
        if self.sinks is not None:
            if mask is None:  # plain causal: the chunk is the whole context
                mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
            kt, vt, mask = _with_sinks(kt, vt, mask[None, None], self.sinks.view(1, -1, 1, 1))
        o = _sdpa(
            qt,
            kt,
            vt,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
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


def _write_kv(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    _raw(kv_cache[0].flatten(0, 1)).index_copy_(0, slot_mapping, _raw(_store(k, kv_cache)))
    _raw(kv_cache[1].flatten(0, 1)).index_copy_(0, slot_mapping, _raw(_store(v, kv_cache)))


def _raw(t: Tensor) -> Tensor:
    """A float8 tensor's bytes (index_copy_ has no float8 kernel on the CPU); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _store(x: Tensor, cache: Tensor) -> Tensor:
    """K or V rows [T, Hkv, D] as the cache holds them (no copy when the dtypes agree)."""
    if cache.dtype == torch.int8:
        return kv_int8.quantize(x)
    return x if x.dtype == cache.dtype else x.to(cache.dtype)


def _load(rows: Tensor, like: Tensor) -> Tensor:
    """Cache rows read back in like's dtype (no copy when the dtypes agree)."""
    if rows.dtype == torch.int8:
        return kv_int8.dequantize(rows, like.dtype)
    return rows if rows.dtype == like.dtype else rows.to(like.dtype)
