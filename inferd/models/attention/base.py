"""What every attention backend shares: the layer, the interface, the builders' input, KV I/O.

`PagedAttention` is the layer (KV cache, window, sinks, native kernel, all bound per layer). It
writes this step's K/V into the cache, then hands the queries to the backend its metadata names
(`AttentionMetadata.backend`): the metadata's type is the backend, fixed when the runner chose
its builder at load (select.py), so no call inspects which fields are set.

A builder turns the runner's `ScheduledBatch` (each sequence's queries, context and block table,
in the flat batch's order) into its backend's metadata once per step; every layer reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from inferd.models import kv_int8
from inferd.models.kernels import PagedAttentionKernel


@dataclass
class AttentionMetadata:
    """One step's attention metadata; each backend's subclass adds its own fields and names its
    backend."""

    # The backend that reads this metadata's type (each subclass sets its own).
    backend: ClassVar[AttentionBackend[Any]]
    slot_mapping: Tensor  # [T] int64: the cache slot each token's K/V is written to
    # The first num_decode_tokens rows are decode rows (one per sequence).
    num_decode_tokens: int = 0


M_contra = TypeVar("M_contra", bound=AttentionMetadata, contravariant=True)
M_co = TypeVar("M_co", bound=AttentionMetadata, covariant=True)


class AttentionBackend(Protocol[M_contra]):
    """One way to read the paged cache."""

    def forward(
        self, layer: PagedAttention, q: Tensor, k: Tensor, v: Tensor, meta: M_contra
    ) -> Tensor:
        """q: [T, Hq, D]  k, v: [T, Hkv, D] (already in the cache)  ->  [T, Hq, D]."""
        ...


class MetadataBuilder(Protocol[M_co]):
    """Builds its backend's metadata for one step (configured once, at load)."""

    def build(self, batch: ScheduledBatch) -> M_co: ...


@dataclass(frozen=True)
class ScheduledBatch:
    """A step's sequences in the flat batch's order: the decode rows (one query each) first,
    then each prefill chunk. Sequence s's queries are positions [starts[s], starts[s] +
    q_lens[s]); after this step's write its context is starts[s] + q_lens[s] tokens."""

    starts: list[int]
    q_lens: list[int]
    # Each sequence's block table (entries before its window may be released, < 0).
    block_ids: Sequence[list[int]]
    # Rows at the end of each sequence's queries that sample (its drafts + 1; 0: none).
    sample_rows: list[int]
    num_decode: int
    slot_mapping: Tensor  # [T] int64


def cache_slots(block_ids: list[int], lo: int, hi: int, block_size: int) -> np.ndarray:
    """Cache slots of positions [lo, hi): block_ids[pos // bs] * bs + pos % bs."""
    bs = block_size
    pos = np.arange(lo, hi)
    blocks = np.asarray(block_ids[lo // bs : (hi + bs - 1) // bs], dtype=np.int64)
    result: np.ndarray = blocks[pos // bs - lo // bs] * bs + pos % bs
    return result


def device_tensor(
    values: list[int] | np.ndarray, device: torch.device, dtype: type = np.int64
) -> Tensor:
    """Host values as a tensor on `device` (copied without waiting on a GPU)."""
    t = torch.from_numpy(np.asarray(values, dtype=dtype))
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


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
            write_kv(self.kv_cache, k, v, meta.slot_mapping)
        return meta.backend.forward(self, q, k, v, meta)


def write_kv(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
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


def load_rows(rows: Tensor, like: Tensor) -> Tensor:
    """Cache rows read back in like's dtype (no copy when the dtypes agree)."""
    if rows.dtype == torch.int8:
        return kv_int8.dequantize(rows, like.dtype)
    return rows if rows.dtype == like.dtype else rows.to(like.dtype)
