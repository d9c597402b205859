"""Paged attention for the flattened, padding-free batch, one backend per way of reading the cache.

The batch is T real tokens from several sequences laid end to end: first one token per decoding
sequence (B of them), then each prefill chunk. K/V for token t are written to cache slot
`slot_mapping[t]` (slot = block_id * block_size + offset), then every query attends to its own
sequence's cached K/V: query position p sees keys [0, p], or (p - W, p] in a layer with a sliding
window W.

KV cache layout, per layer: [2, num_blocks + 1, block_size, num_kv_heads, head_dim] (K then V; the
extra block is the CUDA-graph scratch block), so one block of one layer is a contiguous
[block_size, H_kv, D] tile. The cache's dtype may differ from the model's (`--kv-cache-dtype`);
an int8 cache's rows are D + 4 bytes, each with its own scale (models/kv_int8.py).

- base.py: the layer (`PagedAttention`), the backend interface, the builders' input, KV I/O;
- native.py: the native CPU kernel (`NativeMetadata`: `PagedBatch`es);
- sdpa.py: PyTorch SDPA (`SdpaMetadata`: decode length groups, prefill spans; windows, sinks);
- varlen.py: CUDA's one varlen call a layer (`VarlenMetadata`), CUDA-graph decode included;
- select.py: which backend runs, the rule.
"""

from inferd.models.attention.base import AttentionMetadata, PagedAttention, ScheduledBatch

__all__ = ["AttentionMetadata", "PagedAttention", "ScheduledBatch"]
