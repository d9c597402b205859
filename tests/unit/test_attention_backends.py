"""Each attention backend's builder on one small mixed batch, and the backends against each other.

The batch: two decode rows (contexts 10 and 6), a prefill chunk after a cached prefix of 8 and a
plain prompt chunk that does not sample, block size 4. The builders' metadata is checked field by
field; then the native kernel and SDPA (and, on CUDA, varlen) attend over the same cache, with and
without a sliding window, and must agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from inferd.kv_cache.block_manager import OUT_OF_WINDOW
from inferd.models import kernels
from inferd.models.attention import AttentionMetadata, PagedAttention, ScheduledBatch
from inferd.models.attention.base import cache_slots
from inferd.models.attention.native import NativeBuilder, NativeMetadata
from inferd.models.attention.sdpa import SdpaBuilder, SdpaMetadata
from inferd.models.attention.select import graph_varlen, select_attention
from inferd.models.attention.varlen import VarlenBuilder, VarlenMetadata
from inferd.models.config import ArchConfig

pytestmark = pytest.mark.unit

BS, HQ, HKV, D = 4, 4, 2, 16
CPU = torch.device("cpu")
STARTS = [9, 5, 8, 0]  # decode, decode, chunk after a cached prefix, plain chunk
Q_LENS = [1, 1, 4, 3]
SAMPLE_ROWS = [1, 1, 1, 0]
TABLES = [[3, 7, 1], [5, 0], [2, 9, 4], [8]]
NUM_BLOCKS = 10


def _batch(tables: list[list[int]] = TABLES) -> ScheduledBatch:
    slots = torch.cat(
        [
            torch.from_numpy(cache_slots(ids, start, start + n, BS))
            for ids, start, n in zip(TABLES, STARTS, Q_LENS, strict=True)
        ]
    )
    return ScheduledBatch(STARTS, Q_LENS, tables, SAMPLE_ROWS, num_decode=2, slot_mapping=slots)


def _window_tables() -> list[list[int]]:
    """TABLES with the blocks wholly before each sequence's window of 4 released (the block
    manager's OUT_OF_WINDOW): position 9's window starts at 6 (block 1), 8's at 5 (block 1)."""
    return [[OUT_OF_WINDOW, 7, 1], [5, 0], [OUT_OF_WINDOW, 9, 4], [8]]


def test_native_builder_covers_every_row_and_the_sampling_rows() -> None:
    meta = NativeBuilder(BS).build(_batch())
    assert isinstance(meta, NativeMetadata) and meta.num_decode_tokens == 2
    assert meta.paged is not None and meta.sampled is not None
    assert meta.paged.block_tables.tolist() == [[3, 7, 1], [5, 0, 0], [2, 9, 4], [8, 0, 0]]
    assert meta.paged.q_start.tolist() == [0, 1, 2, 6]
    assert meta.paged.q_len.tolist() == [1, 1, 4, 3]
    assert meta.paged.ctx_len.tolist() == [10, 6, 12, 3]
    assert all(t.dtype == torch.int32 for t in (meta.paged.block_tables, meta.paged.q_len))
    # The plain chunk does not sample: the sampling rows get their own batch, one query each.
    assert meta.sampled.block_tables.tolist() == [[3, 7, 1], [5, 0, 0], [2, 9, 4]]
    assert meta.sampled.q_start.tolist() == [0, 1, 2]
    assert meta.sampled.q_len.tolist() == [1, 1, 1]
    assert meta.sampled.ctx_len.tolist() == [10, 6, 12]
    rows = torch.tensor([0, 1, 5])
    part = meta.sampled_rows(rows)
    assert part.paged is meta.sampled and torch.equal(part.slot_mapping, meta.slot_mapping[rows])


def test_sdpa_builder_groups_decode_rows_and_spans_chunks() -> None:
    meta = SdpaBuilder(BS, None, CPU).build(_batch())
    assert isinstance(meta, SdpaMetadata) and meta.num_decode_tokens == 2
    # 3 blocks against 2: under the 0.85 ratio, two groups.
    (t0, m0), (t1, m1) = meta.decode_groups
    assert t0.tolist() == [[3, 7, 1]] and t1.tolist() == [[5, 0]]
    assert m0.shape == (1, 1, 1, 12) and m0.flatten().tolist() == [True] * 10 + [False] * 2
    assert m1.flatten().tolist() == [True] * 6 + [False] * 2
    prefixed, plain = meta.prefills
    assert (prefixed.query_start, prefixed.query_len, prefixed.context_len) == (2, 4, 12)
    assert prefixed.context_slots is not None and prefixed.mask is not None
    assert prefixed.context_slots.tolist() == cache_slots(TABLES[2], 0, 12, BS).tolist()
    # Query i (position 8 + i) sees keys 0 .. 8 + i.
    assert prefixed.mask.sum(1).tolist() == [9, 10, 11, 12]
    assert (plain.query_start, plain.query_len, plain.context_len) == (6, 3, 3)
    assert plain.context_slots is None and plain.mask is None


def test_sdpa_builder_reads_from_the_window_on() -> None:
    meta = SdpaBuilder(BS, 4, CPU).build(_batch(_window_tables()))
    # Row 0 reads blocks 1-2 (context 10 - 4 = 6 of them), row 1 blocks 0-1: one group.
    ((table, mask),) = meta.decode_groups
    assert table.tolist() == [[7, 1], [5, 0]]
    assert mask.sum(-1).flatten().tolist() == [6, 6]
    assert meta.decode_masks(4)[0].sum(-1).flatten().tolist() == [4, 4]
    prefixed = meta.prefills[0]
    assert prefixed.context_len == 8 and prefixed.context_slots is not None
    assert prefixed.context_slots.tolist() == cache_slots(TABLES[2], 4, 12, BS).tolist()
    assert prefixed.window_mask(4, CPU).sum(1).tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("blocks", [False, True])
def test_varlen_builder_packs_each_whole_context(blocks: bool) -> None:
    meta = VarlenBuilder(BS, CPU, blocks).build(_batch())
    assert isinstance(meta, VarlenMetadata) and meta.batch is not None
    vb = meta.batch
    assert vb.cu_q.tolist() == [0, 1, 2, 6, 9] and vb.max_q == 4
    if blocks:  # whole blocks, seqused_k the real keys of each span
        assert vb.kv_blocks is not None and vb.seqused_k is not None and vb.kv_slots is None
        assert vb.kv_blocks.tolist() == [3, 7, 1, 5, 0, 2, 9, 4, 8]
        assert vb.cu_k.tolist() == [0, 12, 20, 32, 36] and vb.max_k == 12
        assert vb.seqused_k.tolist() == [10, 6, 12, 3]
    else:
        assert vb.kv_slots is not None and vb.kv_blocks is None and vb.seqused_k is None
        assert vb.cu_k.tolist() == [0, 10, 16, 28, 31] and vb.max_k == 12
        want = [
            cache_slots(ids, 0, s + n, BS).tolist()
            for ids, s, n in zip(TABLES, STARTS, Q_LENS, strict=True)
        ]
        assert vb.kv_slots.tolist() == [x for w in want for x in w]


def test_the_runner_picks_the_backend_once(native_kernels: kernels.NativeKernels) -> None:
    arch = ArchConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": HQ * D,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": HQ,
            "num_key_value_heads": HKV,
        }
    )
    native = select_attention(native_kernels.attention, arch, CPU, torch.float32, BS)
    assert isinstance(native, NativeBuilder) and not graph_varlen(native)
    # No kernel on a CPU: varlen needs CUDA, so SDPA.
    assert isinstance(select_attention(None, arch, CPU, torch.float32, BS), SdpaBuilder)


def _attend(layer: PagedAttention, cache: Tensor, meta: AttentionMetadata, qkv: Tensor) -> Tensor:
    layer.kv_cache = cache.clone()  # each backend writes this step's K/V into its own copy
    q, k, v = torch.split(qkv, [HQ, HKV, HKV], dim=1)
    with torch.inference_mode():
        out: Tensor = layer(q, k, v, meta)
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_native_kernel_and_sdpa_agree(
    native_kernels: kernels.NativeKernels, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS + 1, BS, HKV, D, generator=gen)
    qkv = torch.randn(sum(Q_LENS), HQ + 2 * HKV, D, generator=gen)
    layer = PagedAttention(HQ, HKV, D, D**-0.5, window)
    layer.kernel = native_kernels.attention
    tables = TABLES if window is None else _window_tables()
    native = _attend(layer, cache, NativeBuilder(BS).build(_batch(tables)), qkv)
    sdpa = _attend(layer, cache, SdpaBuilder(BS, window, CPU).build(_batch(tables)), qkv)
    torch.testing.assert_close(native, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_and_sdpa_agree_on_cuda(dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS + 1, BS, HKV, D, generator=gen).to(cuda, dtype)
    qkv = torch.randn(sum(Q_LENS), HQ + 2 * HKV, D, generator=gen).to(cuda, dtype)
    batch = _batch()
    batch = ScheduledBatch(
        batch.starts, batch.q_lens, batch.block_ids, batch.sample_rows, 2, batch.slot_mapping.cuda()
    )
    layer = PagedAttention(HQ, HKV, D, D**-0.5)
    blocks = dtype == torch.bfloat16
    varlen = _attend(layer, cache, VarlenBuilder(BS, cuda, blocks).build(batch), qkv)
    sdpa = _attend(layer, cache, SdpaBuilder(BS, None, cuda).build(batch), qkv)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(varlen.float(), sdpa.float(), atol=tol, rtol=tol)
