"""The native paged-attention kernel against a naive reference (float64, keys gathered by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from inferd.cli import build_parser, engine_config
from inferd.config import CacheConfig, EngineConfig, read_environment
from inferd.executor.kv_pool import kv_cache_dtype
from inferd.models import kernels, kv_int8
from inferd.models.kernels import PagedAttentionKernel, PagedBatch

# The kernel tests run on AMX tiles and without (tests/conftest.py's panel_path): bfloat16 prefill
# items take the tiles where the CPU has them.
pytestmark = pytest.mark.unit


@pytest.fixture
def kernel(native_kernels: kernels.NativeKernels, panel_path: str) -> PagedAttentionKernel:
    """Every test of the kernel runs on both paths where the CPU has AMX (tests/conftest.py's
    panel_path); the pure-Python ones (selection, the fallback when no build is possible) run
    everywhere, above all where the kernel cannot be built."""
    return native_kernels.attention


def _case(
    seqs: list[tuple[int, int]],  # (q_len, ctx_len) per sequence
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    kv_dtype: torch.dtype,
    act_dtype: torch.dtype,
    seed: int = 0,
) -> tuple[Tensor, Tensor, PagedBatch]:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // bs) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
    kv = kv_int8.quantize(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g)  # shuffled block tables
    max_nb = max(blocks_per_seq)
    tables = torch.zeros(len(seqs), max_nb, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    q_len = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    q_start = torch.cumsum(q_len, 0, dtype=torch.int32) - q_len
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    q = torch.randn(int(q_len.sum()), hq, d, generator=g).to(act_dtype)
    return q, kv, PagedBatch(tables, q_start, q_len, ctx)


def _reference(
    q: Tensor,
    kv: Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """`sinks`: [Hq], each head's extra softmax logit with a zero value (gpt-oss, as
    transformers' eager attention: a column of the scores, dropped after the softmax)."""
    if kv.dtype == torch.int8:  # the values the rows hold (dequantized as the PyTorch path does)
        kv = kv_int8.dequantize(kv, torch.float64)
    _, _, bs, hkv, _ = kv.shape
    hq = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(batch.num_seqs):
        qs, ql, ctx = (int(x[s]) for x in (batch.q_start, batch.q_len, batch.ctx_len))
        pos = torch.arange(ctx)
        slots = batch.block_tables[s].long()[pos // bs] * bs + pos % bs
        k = kv[0].flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, dim=1)
        v = kv[1].flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, dim=1)
        for j in range(ql):
            keys = ctx - ql + j + 1
            lo = 0 if window is None else max(0, keys - window)  # the last `window` keys
            qj = q[qs + j].double()  # [Hq, D]
            w = torch.einsum("hd,khd->hk", qj, k[lo:keys]) * scale
            if sinks is not None:
                w = torch.cat([w, sinks.double()[:, None]], dim=1)
            p = w.softmax(-1)[:, : keys - lo]
            out[qs + j] = torch.einsum("hk,khd->hd", p, v[lo:keys])
    return out


def _check(
    kernel: PagedAttentionKernel,
    seqs: list[tuple[int, int]],
    hq: int = 8,
    hkv: int = 4,
    d: int = 64,
    bs: int = 16,
    kv_dtype: torch.dtype = torch.float32,
    act_dtype: torch.dtype = torch.float32,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> None:
    q, kv, batch = _case(seqs, hq, hkv, d, bs, kv_dtype, act_dtype)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    kernel(out, q, kv, batch, scale, window, sinks)
    ref = _reference(q, kv, batch, scale, window, sinks)
    tol = 1e-5 if act_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("bs", [16, 5, 32])
def test_decode_ragged_contexts(kernel: PagedAttentionKernel, group: int, bs: int) -> None:
    seqs = [(1, n) for n in (1, 7, 16, 17, 100, 333, 64)]
    _check(kernel, seqs, hq=2 * group, hkv=2, bs=bs)


@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, "bf16 model"])
def test_many_decode_rows_group_kv_heads(
    kernel: PagedAttentionKernel, group: int, kv_dtype: torch.dtype | str
) -> None:
    # Enough sequences that an item takes several kv heads (rows of 4 heads x G).
    seqs = [(1, 1 + (37 * i) % 300) for i in range(48)]
    if kv_dtype == "bf16 model":
        _check(kernel, seqs, 4 * group, 4, 64, 16, torch.bfloat16, torch.bfloat16)
    else:
        assert isinstance(kv_dtype, torch.dtype)
        _check(kernel, seqs, hq=4 * group, hkv=4, bs=16, kv_dtype=kv_dtype)


@pytest.mark.parametrize("window", [1, 5, 33, 200])
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.int8, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_sliding_window(
    kernel: PagedAttentionKernel, window: int, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    # Each query sees its last `window` keys: decode rows, prefill chunks (with and without a
    # cached prefix, longer than a query tile), one long stream whose keys are split across
    # threads, rows whose window starts mid-block and mid-tile.
    kv_dtype, act_dtype = dtypes
    seqs = [(1, 50), (40, 90), (100, 612), (3, 3), (1, 1), (70, 70), (1, 1000)]
    _check(kernel, seqs, 8, 4, 64, 16, kv_dtype, act_dtype, window)
    _check(kernel, [(1, 2000)], 8, 2, 64, 16, kv_dtype, act_dtype, window)


@pytest.mark.parametrize("window", [None, 5, 200])
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_attention_sinks(
    kernel: PagedAttentionKernel, window: int | None, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    # A logit per query head joins its softmax: decode rows, prefill chunks, a long stream whose
    # keys are split across threads (the sink enters once, after the splits' merge), sinks far
    # above and below the scores (the normaliser stays finite either way).
    kv_dtype, act_dtype = dtypes
    sinks = torch.tensor([0.0, 1.5, -2.0, 3.0, -40.0, 40.0, 0.25, -0.5])
    seqs = [(1, 50), (40, 90), (3, 3), (1, 1), (70, 70), (1, 1000)]
    _check(kernel, seqs, 8, 4, 64, 16, kv_dtype, act_dtype, window, sinks)
    _check(kernel, [(1, 2000)], 8, 2, 64, 16, kv_dtype, act_dtype, window, sinks)


@pytest.mark.parametrize("group", [1, 2, 7])
def test_prefill_chunk_with_cached_prefix(kernel: PagedAttentionKernel, group: int) -> None:
    # Chunks longer than a query tile, a chunk that is the whole context, decode rows beside them.
    seqs = [(1, 50), (40, 90), (100, 612), (3, 3), (1, 1)]
    _check(kernel, seqs, hq=2 * group, hkv=2, bs=16)


@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_items_of_many_rows_take_the_tiled_path(
    kernel: PagedAttentionKernel, group: int, bs: int, dtype: torch.dtype
) -> None:
    # Items of >= 16 rows run a tiled path (kernels/x86/: bfloat16 transposed K tiles, interleaved
    # V pairs; float32 P.V in row blocks): chunks with and without a cached prefix, odd key
    # counts, rows that see no key of a tile, decode rows beside them.
    seqs = [(1, 50), (40, 90), (100, 612), (3, 3), (17, 17), (33, 33), (1, 1)]
    _check(kernel, seqs, hq=2 * group, hkv=2, bs=bs, kv_dtype=dtype, act_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_items_of_several_kv_heads(
    kernel: PagedAttentionKernel, dtype: torch.dtype
) -> None:
    # Many short chunks: an item takes several kv heads (64 rows of 4 heads, 16-key tiles).
    seqs = [(8, 8 + (13 * i) % 40) for i in range(48)]
    _check(kernel, seqs, hq=8, hkv=4, bs=16, kv_dtype=dtype, act_dtype=dtype)


@pytest.mark.parametrize("ctx", [129, 1000, 4097])
def test_single_long_stream_splits_keys(kernel: PagedAttentionKernel, ctx: int) -> None:
    # One sequence, few items: the kernel splits keys across threads and merges the splits.
    _check(kernel, [(1, ctx)], hq=14, hkv=2)
    _check(kernel, [(17, ctx)], hq=8, hkv=4, bs=32)


@pytest.mark.parametrize("d", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(kernel: PagedAttentionKernel, d: int, dtype: torch.dtype) -> None:
    # bfloat16 queries on a bfloat16 cache take the AVX512_BF16 dot-product scores where the head
    # is a whole number of 32-value pairs (32, 128 here; 16 widens as float32 does).
    _check(kernel, [(1, 77), (9, 40)], d=d, kv_dtype=dtype, act_dtype=dtype)


@pytest.mark.parametrize(
    ("kv_dtype", "act_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float8_e5m2, torch.float32),
        (torch.float8_e5m2, torch.bfloat16),
        (torch.int8, torch.float32),
        (torch.int8, torch.bfloat16),
    ],
)
def test_bfloat16_float8_and_int8(
    kernel: PagedAttentionKernel, kv_dtype: torch.dtype, act_dtype: torch.dtype
) -> None:
    # The reference reads the same rounded cache (float8_e5m2 widened exactly, int8 rows times
    # their scales); only the output rounding (bf16) differs.
    _check(kernel, [(1, 300), (20, 80), (1, 5)], kv_dtype=kv_dtype, act_dtype=act_dtype)


def test_only_covered_rows_are_written(kernel: PagedAttentionKernel) -> None:
    q, kv, batch = _case([(1, 20), (1, 30)], 8, 4, 64, 16, torch.float32, torch.float32)
    out = torch.full((4, 8, 64), 7.0)
    kernel(out, torch.cat([q, q]), kv, batch, 0.125)
    assert torch.equal(out[2:], torch.full((2, 8, 64), 7.0))


def test_supports() -> None:
    assert kernels.supports(torch.float32, torch.bfloat16, 64) is None
    assert kernels.supports(torch.bfloat16, torch.float8_e5m2, 64) is None
    assert kernels.supports(torch.float32, torch.int8, 64) is None
    assert kernels.supports(torch.float8_e5m2, torch.float32, 64) is not None
    assert kernels.supports(torch.float16, torch.float32, 64) is not None
    assert kernels.supports(torch.float32, torch.float32, 72) is not None


def test_select_honours_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    env = read_environment()
    assert kernels.select("torch", cpu, f32, f32, 64, env) is None
    assert kernels.select("auto", torch.device("cuda"), f32, f32, 64, env) is None
    assert kernels.select("auto", cpu, f32, f32, 72, env) is None  # unsupported head_dim
    monkeypatch.setenv("INFERD_DISABLE_KERNELS", "1")
    env = read_environment()  # what a server started now would read
    assert kernels.select("auto", cpu, f32, f32, 64, env) is None
    with pytest.raises(kernels.KernelUnavailable, match="INFERD_DISABLE_KERNELS"):
        kernels.select("cpu_kernel", cpu, f32, f32, 64, env)


def test_failed_build_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("INFERD_DISABLE_KERNELS", raising=False)  # the build itself must fail
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    cpu, f32, env = torch.device("cpu"), torch.float32, read_environment()
    assert kernels.select("auto", cpu, f32, f32, 64, env) is None
    with pytest.raises(kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        kernels.select("cpu_kernel", cpu, f32, f32, 64, env)


def test_build_is_cached_by_source_compiler_and_cpu(tmp_path: Path) -> None:
    cxx = kernels.compiler()
    if cxx is None:
        pytest.skip("no compiler")
    path = kernels.library_path(tmp_path, cxx)
    assert path.parent == tmp_path / "kernels"
    assert path == kernels.library_path(tmp_path, cxx)  # stable key


def test_cli_flags_reach_the_cache_config() -> None:
    argv = ["generate", "--kv-cache-dtype", "bfloat16", "--attention-backend", "torch"]
    cache = engine_config(build_parser().parse_args(argv)).cache
    assert (cache.kv_cache_dtype, cache.attention_backend) == ("bfloat16", "torch")
    assert EngineConfig.from_kwargs(kv_cache_dtype="float32").cache.kv_cache_dtype == "float32"
    assert kv_cache_dtype(CacheConfig(), torch.bfloat16) == torch.bfloat16  # auto: model dtype
    assert kv_cache_dtype(CacheConfig(kv_cache_dtype="bfloat16"), torch.float32) == torch.bfloat16
