"""The fused elementwise kernels of `fused_ops.cpp`, as tensor-in, tensor-out calls, and an MoE
layer past its router in one call (`moe_layer`, `moe_experts.cpp`).

Each call replaces several eager PyTorch ops of a decoder layer with one pass over the rows (the
C++ file lists them). Inputs are checked here (shape, dtype, contiguity): the C side trusts them.

Row-bucketed outputs: `rms_norm` and `silu_mul` can allocate their output with `out_rows >= rows`
rows, the extra rows zeroed. The next op is a linear layer whose oneDNN kernel runs only a fixed
set of row counts (models/linear.py row_buckets); handing it a tensor already of that size saves
the pad (an allocation, a fill and a copy) it would otherwise make. Callers slice `[:rows]` of the
linear's result.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from inferd.models import kv_int8

# The element types every native kernel takes, as their C side numbers them (simd.h `DType`).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The KV cache may also be float8_e5m2 (--kv-cache-dtype fp8): simd.h's kFP8E5M2, or int8 rows
# with their scale (--kv-cache-dtype int8, models/kv_int8.py): kI8.
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e5m2: 2, torch.int8: 3}


# The kernels an MoE layer's experts run in one call (moe_experts.cpp's MoeKernel), and the
# addresses each expert's weight takes: a PanelWeight's packed panels; an Int8Weight's q, scale,
# row_sum and bias (0: none).
MoEKernel = Literal["panel", "gemv_int8"]
MOE_KERNEL_CODES: dict[MoEKernel, int] = {"panel": 0, "gemv_int8": 1}
MOE_ADDRESSES: dict[MoEKernel, int] = {"panel": 1, "gemv_int8": 4}


@dataclass(frozen=True)
class MoEPanels:
    """Where every expert of an MoE layer keeps the copies `kernel` reads (MOE_ADDRESSES per
    expert, by expert id), and the most rows per expert their plans send to that kernel."""

    gate_up: list[int]
    down: list[int]
    max_rows: int
    kernel: MoEKernel = "panel"

    @property
    def experts(self) -> int:
        return len(self.gate_up) // MOE_ADDRESSES[self.kernel]


class PanelCopy(Protocol):
    """What grouped_panels reads of a weight: gemv.py's PanelWeight."""

    @property
    def packed(self) -> Tensor: ...
    @property
    def bias(self) -> Tensor | None: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...


class FusedOps:
    """Bound to a loaded kernel library (kernels.load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._norm = lib.inferd_rms_norm
        self._norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i32, i64, i64, f32]
        self._silu = lib.inferd_silu_mul
        self._silu.argtypes = [ptr, ptr, i32, i64, i64]
        self._argmax = lib.inferd_argmax
        self._argmax.argtypes = [ptr, i32, i64, i64, i64, ptr]
        self._rope = lib.inferd_rope_qkv
        self._rope.argtypes = [ptr, i64, i32, i64, i32, i32, i32, ptr, ptr, ptr, i64]
        self._rope.argtypes += [ptr, ptr, f32, ptr, ptr, i32, i64, ptr]
        self._moe = lib.inferd_moe_layer
        self._moe.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i32, i64, i64, i64]
        self._moe.argtypes += [ptr, ptr, ptr, i32]
        self._grouped = lib.inferd_grouped_panels
        self._grouped.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i32]
        for fn in (self._norm, self._silu, self._argmax, self._rope, self._moe, self._grouped):
            fn.restype = ctypes.c_int

    def rms_norm(
        self,
        x: Tensor,
        weight: Tensor,
        eps: float,
        residual: Tensor | None = None,
        out_rows: int | None = None,
    ) -> Tensor:
        """rms_norm(x [+ residual]) * weight -> [out_rows or T, dim]; with `residual` ([T, dim]
        contiguous), residual <- x + residual first, in place. x may be a row-strided view."""
        rows, dim = x.shape
        _check_rows(x, weight.dtype)
        if residual is not None:
            assert residual.shape == x.shape and residual.is_contiguous()
            assert residual.dtype == x.dtype
        out = padded_empty(rows, out_rows or rows, (dim,), x.dtype)
        rc = self._norm(
            out.data_ptr(),
            dim,
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            DTYPE_CODES[x.dtype],
            rows,
            dim,
            eps,
        )
        check_rc(rc, "rms_norm")
        return out

    def silu_mul(self, gate_up: Tensor, out_rows: int | None = None) -> Tensor:
        """[T, 2I] (gate, up) -> silu(gate) * up, [out_rows or T, I]."""
        rows, width = gate_up.shape
        assert gate_up.is_contiguous() and width % 2 == 0
        out = padded_empty(rows, out_rows or rows, (width // 2,), gate_up.dtype)
        rc = self._silu(
            out.data_ptr(), gate_up.data_ptr(), DTYPE_CODES[gate_up.dtype], rows, width // 2
        )
        check_rc(rc, "silu_mul")
        return out

    def moe_layer(
        self, x: Tensor, experts: Tensor, weights: Tensor, panels: MoEPanels, inter: int
    ) -> tuple[Tensor, list[int]] | None:
        """An MoE layer past its router in one call (moe_experts.cpp): x [T, H] (unit-stride
        rows), each token's experts [T, k] int64 and routing weights [T, k] in x's dtype, and
        every expert's weight copies by expert id (`panels`: [2I, H] gate/up and [H, I] down,
        panels in x's dtype or int8) -> (y [T, H], the rows each expert received); None where an
        expert received more than `panels.max_rows` rows (nothing was run)."""
        t, h = x.shape
        k = experts.shape[1]
        e = panels.experts
        assert x.stride(1) == 1 and x.dtype in DTYPE_CODES and weights.dtype == x.dtype
        assert experts.shape == weights.shape == (t, k) and len(panels.down) == len(panels.gate_up)
        experts, weights = experts.contiguous(), weights.contiguous()
        counts = torch.empty(e, dtype=torch.int64)
        scratch = x.new_empty(t * k * (2 * h + 3 * inter))
        y = x.new_empty(t, h)
        ptrs = ctypes.c_void_p * len(panels.gate_up)
        rc = self._moe(
            x.data_ptr(),
            x.stride(0),
            t,
            experts.data_ptr(),
            weights.data_ptr(),
            e,
            k,
            ptrs(*panels.gate_up),
            ptrs(*panels.down),
            MOE_KERNEL_CODES[panels.kernel],
            panels.max_rows,
            h,
            inter,
            counts.data_ptr(),
            scratch.data_ptr(),
            y.data_ptr(),
            DTYPE_CODES[x.dtype],
        )
        if rc == 1:
            return None
        if rc == -2:
            raise IndexError("moe_layer: an expert id is out of range")
        check_rc(rc, "moe_layer")
        return y, counts.tolist()

    def grouped_panels(self, xs: Tensor, counts: list[int], weights: list[PanelCopy]) -> Tensor:
        """xs [sum(counts), in] (contiguous, grouped: counts[e] rows for weights[e]) -> [.., out],
        each group through its own panel weight and bias in one call (moe_experts.cpp's
        inferd_grouped_panels); each row's values are Gemv.panel's. Groups of 0 rows skip."""
        active = [(n, w) for n, w in zip(counts, weights, strict=True) if n]
        first = weights[0]
        assert xs.is_contiguous() and xs.dtype == first.packed.dtype
        assert xs.shape == (sum(counts), first.in_features)
        y = xs.new_empty(xs.shape[0], first.out_features)
        if not active:
            return y
        rows = torch.tensor([n for n, _ in active], dtype=torch.int64)
        ptrs = ctypes.c_void_p * len(active)
        packed = ptrs(*(w.packed.data_ptr() for _, w in active))
        bias = ptrs(*(None if w.bias is None else w.bias.data_ptr() for _, w in active))
        rc = self._grouped(
            xs.data_ptr(),
            rows.data_ptr(),
            len(active),
            packed,
            bias,
            first.out_features,
            first.in_features,
            y.data_ptr(),
            DTYPE_CODES[xs.dtype],
        )
        check_rc(rc, "grouped_panels")
        return y

    def argmax(self, x: Tensor) -> Tensor:
        """[N] int64: the index of the largest value of each row of x [N, V] (float32 or
        bfloat16; the first on ties, the first NaN if any, as torch.argmax)."""
        rows, n = x.shape
        _check_rows(x, x.dtype)
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._argmax(x.data_ptr(), DTYPE_CODES[x.dtype], rows, n, x.stride(0), out.data_ptr())
        check_rc(rc, "argmax")
        return out

    def rope_qkv(
        self,
        qkv: Tensor,
        num_heads: int,
        num_kv_heads: int,
        positions: Tensor,
        cos_cache: Tensor,
        sin_cache: Tensor,
        kv_cache: Tensor,
        slot_mapping: Tensor,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
        eps: float = 0.0,
    ) -> Tensor:
        """The fused qkv projection's output [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]
        (contiguous); rotated k and v are written into `kv_cache` [2, slots, Hkv, D]-shaped
        (any leading block dims) at `slot_mapping`. `q_norm` / `k_norm`: per-head RMSNorm weights
        applied before RoPE (Qwen3)."""
        t = qkv.shape[0]
        d = cos_cache.shape[1] * 2
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d and qkv.stride(1) == 1
        assert positions.dtype == slot_mapping.dtype == torch.int64
        assert positions.shape == slot_mapping.shape == (t,)
        assert positions.is_contiguous() and slot_mapping.is_contiguous()
        assert cos_cache.is_contiguous() and sin_cache.is_contiguous()
        assert cos_cache.dtype == sin_cache.dtype == qkv.dtype and kv_cache.is_contiguous()
        for w in (q_norm, k_norm):
            assert w is None or (w.shape == (d,) and w.dtype == qkv.dtype and w.is_contiguous())
        plane_slots = kv_cache[0].numel() // (num_kv_heads * kv_int8.row_width(d, kv_cache.dtype))
        q = torch.empty(t, num_heads, d, dtype=qkv.dtype)
        rc = self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            DTYPE_CODES[qkv.dtype],
            t,
            num_heads,
            num_kv_heads,
            d,
            positions.data_ptr(),
            cos_cache.data_ptr(),
            sin_cache.data_ptr(),
            cos_cache.shape[0],
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            q.data_ptr(),
            kv_cache.data_ptr(),
            KV_DTYPE_CODES[kv_cache.dtype],
            plane_slots,
            slot_mapping.data_ptr(),
        )
        check_rc(rc, "rope_qkv")
        return q


def _check_rows(x: Tensor, dtype: torch.dtype) -> None:
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype == dtype and x.device.type == "cpu"


def padded_empty(rows: int, out_rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """[out_rows, *shape] for a kernel to fill rows [0, rows) of; rows past `rows` are zeroed (a
    linear layer computes them and the caller drops them: zeros, not garbage)."""
    assert out_rows >= rows
    out = torch.empty(out_rows, *shape, dtype=dtype)
    if out_rows > rows:
        out[rows:].zero_()
    return out


def check_rc(rc: int, name: str) -> None:
    """Raises for a native kernel's nonzero return code (-2: an index out of range)."""
    if rc == -2:
        raise IndexError(f"{name}: a position or KV slot is out of range")
    if rc != 0:
        raise RuntimeError(f"{name} kernel rejected its arguments (rc={rc})")
