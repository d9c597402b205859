"""The batched GEMMs PyTorch reaches on CPU, each over its own prepacked copy of a weight, as
models/linear.py's dispatch plan runs them: oneDNN (float32, bfloat16) and fbgemm's dynamic int8.

    fn = onednn_gemm(weight, bias)      # y = fn(x), any row count
    fn = int8_gemm(q, scale, bias)      # 8-bit weights and activations (VNNI)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

LinearKind = Literal["dense", "onednn", "int8"]
LinearFn = Callable[[Tensor], Tensor]

# oneDNN builds (JIT-compiles) a primitive per input shape and caches it. Most shapes cost little,
# but some row counts cost ~12 MiB each here (measured: 270 odd counts from 129 to 2048 grew the
# process by 3.2 GiB), so a server that met every count up to max_num_batched_tokens would grow by
# GBs. Rows are therefore padded to a bounded set of counts: up to 128, one of `row_buckets(dtype)`;
# above, the next multiple of 128 (measured: those 31 counts to 4096 together 32 MiB for one weight
# shape), in chunks of at most _ONEDNN_CHUNK rows. `warm_up` builds the small buckets at start
# (decode steps meet them all within seconds); the large ones are built on first use, a few ms.
# One call over all rows instead of 128-row chunks and a concatenation: 26.3 vs 28.6 ms at 2048
# rows of the tiny model's gate/up projection (2 threads).
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
# bfloat16 GEMMs take time in proportion to their rows from ~8 rows up (AVX512_BF16 dot products
# make them compute-bound sooner): padding 17 rows to 24 cost the Qwen2-0.5B shape's decode layers
# 12-25 % (2 threads). The finer counts below 64 run its 32-request mix 2-7 % faster offline,
# llama-32m's 1-2 %, for 13-58 MiB more of oneDNN primitives. float32 keeps the coarser set: the
# finer one measured 3-6 % slower on llama-32m (docs/benchmarks.md, "Finer row counts for
# bfloat16 oneDNN GEMMs").
BF16_ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
_LARGE_STEP = 128
_ONEDNN_CHUNK = 2048


def row_buckets(dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts up to 128 that oneDNN GEMMs of weights in `dtype` run."""
    return BF16_ROW_BUCKETS if dtype == torch.bfloat16 else ROW_BUCKETS


def _row_bucket(rows: int, buckets: tuple[int, ...]) -> int:
    if rows > buckets[-1]:
        return -(-rows // _LARGE_STEP) * _LARGE_STEP
    return next(b for b in buckets if b >= rows)


def padded_rows(kind: LinearKind, rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows an input of `rows` rows is padded to before this kind's GEMM on `dtype` weights (if
    it fits one chunk).

    A caller that produces its activations with this many rows (extra rows zeroed) saves the
    linear layer its pad copy; it slices the first `rows` rows of the result."""
    if kind != "onednn" or rows > _ONEDNN_CHUNK:
        return rows
    return _row_bucket(rows, row_buckets(dtype))


def onednn_gemm(weight: Tensor, bias: Tensor | None) -> LinearFn:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    op = torch.ops.mkldnn._linear_pointwise.default
    out_features = weight.shape[0]
    buckets = row_buckets(weight.dtype)

    def chunk(x: Tensor) -> Tensor:
        rows = x.shape[0]
        pad = _row_bucket(rows, buckets) - rows
        if pad == 0:
            return op(x, packed, bias, "none", [], "")
        return op(F.pad(x, (0, 0, 0, pad)), packed, bias, "none", [], "")[:rows]

    def run(x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows <= _ONEDNN_CHUNK:
            return chunk(x) if rows else x.new_empty((0, out_features))
        return torch.cat([chunk(x[i : i + _ONEDNN_CHUNK]) for i in range(0, rows, _ONEDNN_CHUNK)])

    return run


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scale float32 [out]): a symmetric scale per output row, W ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_gemm(q: Tensor, scale: Tensor, bias: Tensor | None) -> LinearFn:
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # Quantized tensors are deprecated as a user-facing type; fbgemm's prepacked linear is
        # still the fastest int8 GEMM reachable from PyTorch on CPU, and this is its input.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
    op = torch.ops.quantized.linear_dynamic.default
    out_features = q.shape[0]

    def run(x: Tensor) -> Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, out_features))
        # reduce_range=False: 8-bit activations. Safe from int16 saturation only with VNNI's
        # int32 accumulation, which `resolve_linear_kind` checks before choosing int8.
        return op(x.float(), packed, False).to(x.dtype)

    return run


def has_int8_gemm() -> bool:
    """Whether this CPU has VNNI (int8 dot products accumulated in int32)."""
    if "VNNI" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_vnni" in flags or " avx_vnni" in flags
