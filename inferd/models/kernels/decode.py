"""`decode_step.cpp`: a decode step through every decoder layer in one native call, of up to 128
rows when every linear layer has its panel copy (float32, and bfloat16 on AVX512_BF16: the
default, models/linear.py's plan), 1-8 when int8 layers keep the int8 GEMV's copy
(`--native-linear on`).

`DecodeLayers.plan(...)` takes a model's weights once (plain GEMV weights, norms, KV caches,
RoPE tables), checks their shapes and builds the C structures that point at them; the returned
`DecodePlan` is then called once per step with the step's embeddings and batch metadata. Its
output is bit-for-bit the Python fused path's (same kernels, same order); what it saves is the
Python around ~12 kernel calls per layer. The plan holds references to every tensor it points
at, so they stay alive as long as it does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from inferd.models.kernels.fused import DTYPE_CODES, KV_DTYPE_CODES, check_rc
from inferd.models.kernels.gemv import Int8Weight, PanelWeight, panel_rows
from inferd.models.kv_int8 import row_width

if TYPE_CHECKING:
    from inferd.models.kernels import PagedBatch

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Lin(ctypes.Structure):
    _fields_ = [
        ("w", _ptr),
        ("bias", _ptr),
        ("scale", _ptr),
        ("row_sum", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("int8", _i64),
        ("panel", _ptr),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _ptr),
        ("post_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("kv_cache", _ptr),
        ("qkv", _Lin),
        ("o", _Lin),
        ("gate_up", _Lin),
        ("down", _Lin),
        ("window", _i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _i64),
        ("final_norm", _ptr),
        ("hidden", _i64),
        ("inter", _i64),
        ("hq", _i64),
        ("hkv", _i64),
        ("d", _i64),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("max_pos", _i64),
        ("eps", _f32),
        ("qk_eps", _f32),
        ("scale", _f32),
        ("dtype", _i32),
        ("kv_dtype", _i32),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("embed", _ptr),
        ("out", _ptr),
        ("h", _ptr),
        ("residual", _ptr),
        ("x", _ptr),
        ("qkv", _ptr),
        ("q", _ptr),
        ("attn", _ptr),
        ("gate_up", _ptr),
        ("act", _ptr),
        ("positions", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("table_stride", _i64),
        ("q_start", _ptr),
        ("q_len", _ptr),
        ("ctx_len", _ptr),
    ]


@dataclass(frozen=True)
class GemvWeight:
    """One linear layer as the decode step reads it: its panel copy (float32, bfloat16), which
    every row count runs on when present, or an int8 copy (whose bias is inside it), or the plain
    model-dtype weight [n, k] and bias (tests and benchmarks; no plan of models/linear.py gives
    it). With a panel copy the plain weight is usually gone (None: Linear holds each weight
    once)."""

    weight: Tensor | Int8Weight | None
    bias: Tensor | None
    panel: PanelWeight | None = None

    def __post_init__(self) -> None:
        if self.weight is None and self.panel is None:
            raise ValueError("a GemvWeight needs the plain weight or its panel copy")

    @property
    def shape(self) -> tuple[int, int]:
        if self.weight is None:
            assert self.panel is not None
            return self.panel.out_features, self.panel.in_features
        w = self.weight.q if isinstance(self.weight, Int8Weight) else self.weight
        return int(w.shape[0]), int(w.shape[1])


@dataclass(frozen=True)
class LayerWeights:
    in_norm: Tensor  # [hidden]
    post_norm: Tensor  # [hidden]
    q_norm: Tensor | None  # [head_dim] (Qwen3) or None
    k_norm: Tensor | None
    kv_cache: Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 if int8)]
    qkv: GemvWeight
    o: GemvWeight
    gate_up: GemvWeight
    down: GemvWeight
    window: int = 0  # sliding window of the layer's attention (0: none)


@dataclass(frozen=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # the decoder's RMSNorm eps
    qk_eps: float  # the q/k norms' eps (0 without them)
    scale: float  # attention scale


class DecodeLayers:
    """Bound to a loaded kernel library (kernels.load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.inferd_decode_layers
        self._fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        self._fn.restype = ctypes.c_int
        # The most rows a step may have: the GEMV kernel's limit for the layers' weights. Up to
        # it the step beats the layer-by-layer path even where a Python-called GEMV would not
        # beat oneDNN (float32 9-16 rows: 0.88-1.0x oneDNN alone, but 12 streams of llama-32m
        # ran 1.23-1.28x faster natively, 16 of the Qwen2-0.5B shape 1.03x; docs/benchmarks.md).
        self.max_rows = int(lib.inferd_gemv_max_rows())
        self.int8_max_rows = int(lib.inferd_gemv_int8_max_rows())
        # Layers that all have their panel copies (Linear's 1-128 rows) take this many.
        self.panel_max_rows = panel_rows(lib)

    def plan(
        self,
        layers: Sequence[LayerWeights],
        final_norm: Tensor,
        cos: Tensor,
        sin: Tensor,
        shape: DecodeShape,
    ) -> DecodePlan:
        lins = [w for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        int8 = any(isinstance(w.weight, Int8Weight) for w in lins)
        rows = self.int8_max_rows if int8 else self.max_rows
        if all(w.panel is not None for w in lins):
            rows = max(rows, self.panel_max_rows[final_norm.dtype])
        return DecodePlan(self._fn, layers, final_norm, cos, sin, shape, rows)


class DecodePlan:
    """One model's decode step; `__call__` runs it. Raises ValueError at build for a layout the
    kernels do not take."""

    def __init__(
        self,
        fn: Callable[[Any, Any], int],
        layers: Sequence[LayerWeights],
        final_norm: Tensor,
        cos: Tensor,
        sin: Tensor,
        shape: DecodeShape,
        max_rows: int,
    ) -> None:
        dtype = final_norm.dtype
        kv = layers[0].kv_cache
        hidden, inter = _check_layout(layers, final_norm, cos, sin, shape)
        hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self._fn = fn  # inferd_decode_layers
        self._keep = (layers, final_norm, cos, sin)  # everything the structures point at
        self._layers = (_Layer * len(layers))(*(_layer(lw) for lw in layers))
        self._model = _Model(
            layers=self._layers,
            num_layers=len(layers),
            final_norm=final_norm.data_ptr(),
            hidden=hidden,
            inter=inter,
            hq=hq,
            hkv=hkv,
            d=d,
            num_blocks=kv.shape[1],
            block_size=kv.shape[2],
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            max_pos=cos.shape[0],
            eps=shape.eps,
            qk_eps=shape.qk_eps,
            scale=shape.scale,
            dtype=DTYPE_CODES[dtype],
            kv_dtype=KV_DTYPE_CODES[kv.dtype],
        )
        rows = max_rows
        widths = {
            "h": hidden,
            "residual": hidden,
            "x": hidden,
            "qkv": (hq + 2 * hkv) * d,
            "q": hq * d,
            "attn": hq * d,
            "gate_up": 2 * inter,
            "act": inter,
        }
        # Scratch reused by every step (a step's buffers are dead once it returns).
        self._scratch = {k: torch.empty(rows, w, dtype=dtype) for k, w in widths.items()}
        self._step = _Step(**{k: t.data_ptr() for k, t in self._scratch.items()})
        self.dtype = dtype
        self.hidden = hidden
        self.max_rows = rows

    def __call__(
        self, embed: Tensor, positions: Tensor, slots: Tensor, batch: PagedBatch
    ) -> Tensor:
        """embed [T, hidden] (T <= max_rows rows, each one decoding sequence of `batch`, in its
        order) -> the final norm's output [T, hidden]; writes this step's K/V."""
        rows = embed.shape[0]
        if not 1 <= rows <= self.max_rows or batch.num_seqs != rows:
            raise ValueError(f"decode step of {rows} rows over {batch.num_seqs} sequences")
        assert embed.dtype == self.dtype and embed.is_contiguous()
        assert positions.dtype == slots.dtype == torch.int64
        assert positions.is_contiguous() and slots.is_contiguous()
        tables = batch.block_tables
        out = torch.empty(rows, self.hidden, dtype=self.dtype)
        s = self._step
        s.rows = rows
        s.embed = embed.data_ptr()
        s.out = out.data_ptr()
        s.positions = positions.data_ptr()
        s.slots = slots.data_ptr()
        s.tables = tables.data_ptr()
        s.table_stride = tables.shape[1]
        s.q_start = batch.q_start.data_ptr()
        s.q_len = batch.q_len.data_ptr()
        s.ctx_len = batch.ctx_len.data_ptr()
        check_rc(self._fn(ctypes.byref(self._model), ctypes.byref(s)), "decode step")
        return out


def _layer(lw: LayerWeights) -> _Layer:
    return _Layer(
        in_norm=lw.in_norm.data_ptr(),
        post_norm=lw.post_norm.data_ptr(),
        q_norm=None if lw.q_norm is None else lw.q_norm.data_ptr(),
        k_norm=None if lw.k_norm is None else lw.k_norm.data_ptr(),
        kv_cache=lw.kv_cache.data_ptr(),
        qkv=_lin(lw.qkv),
        o=_lin(lw.o),
        gate_up=_lin(lw.gate_up),
        down=_lin(lw.down),
        window=lw.window,
    )


def _lin(g: GemvWeight) -> _Lin:
    n, k = g.shape
    w = g.weight
    if isinstance(w, Int8Weight):
        bias = None if w.bias is None else w.bias.data_ptr()
        return _Lin(w.q.data_ptr(), bias, w.scale.data_ptr(), w.row_sum.data_ptr(), n, k, 1)
    bias = None if g.bias is None else g.bias.data_ptr()
    panel = None if g.panel is None else g.panel.packed.data_ptr()
    return _Lin(None if w is None else w.data_ptr(), bias, None, None, n, k, 0, panel)


def _check_layout(
    layers: Sequence[LayerWeights],
    final_norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    shape: DecodeShape,
) -> tuple[int, int]:
    """(hidden, intermediate) sizes after checking every tensor the kernels will read."""
    if not layers:
        raise ValueError("a model with no layers")
    dtype = final_norm.dtype
    kv = layers[0].kv_cache
    hidden = final_norm.shape[0]
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    inter = layers[0].down.shape[1]
    if dtype not in DTYPE_CODES or kv.dtype not in KV_DTYPE_CODES:
        raise ValueError(f"dtype {dtype} / KV cache {kv.dtype}")
    if kv.dim() != 5 or kv.shape[0] != 2 or tuple(kv.shape[3:]) != (hkv, row_width(d, kv.dtype)):
        raise ValueError(f"KV cache {tuple(kv.shape)}")
    if tuple(cos.shape) != tuple(sin.shape) or cos.shape[1] * 2 != d or cos.dtype != dtype:
        raise ValueError(f"RoPE tables {tuple(cos.shape)} {cos.dtype} for head_dim {d}")
    expect = {
        "qkv": ((hq + 2 * hkv) * d, hidden),
        "o": (hidden, hq * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    for w in (cos, sin, final_norm):
        _check_contiguous(w, dtype)
    for lw in layers:
        _check_layer(lw, kv, hidden, d, dtype)
        for name, size in expect.items():
            _check_linear(getattr(lw, name), size, dtype, name)
    return hidden, inter


def _check_layer(lw: LayerWeights, kv: Tensor, hidden: int, d: int, dtype: torch.dtype) -> None:
    """The layer's KV cache like the first layer's (`kv`), its norms' shapes and dtypes."""
    if lw.kv_cache.shape != kv.shape or lw.kv_cache.dtype != kv.dtype:
        raise ValueError("KV caches of different shapes")
    _check_contiguous(lw.kv_cache, kv.dtype)
    _check_vector(lw.in_norm, hidden, dtype)
    _check_vector(lw.post_norm, hidden, dtype)
    for qk_norm in (lw.q_norm, lw.k_norm):
        if qk_norm is not None:
            _check_vector(qk_norm, d, dtype)


def _check_contiguous(t: Tensor, dtype: torch.dtype) -> None:
    if not t.is_contiguous() or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"need a contiguous {dtype} CPU tensor, got {t.dtype} {t.device}")


def _check_vector(t: Tensor, size: int, dtype: torch.dtype) -> None:
    _check_contiguous(t, dtype)
    if tuple(t.shape) != (size,):
        raise ValueError(f"norm weight {tuple(t.shape)}, expected ({size},)")


def _check_linear(g: GemvWeight, size: tuple[int, int], dtype: torch.dtype, name: str) -> None:
    if g.shape != size:
        raise ValueError(f"{name}: weight {g.shape}, expected {size}")
    w = g.weight
    if isinstance(w, Int8Weight):
        for t, dt in ((w.q, torch.int8), (w.scale, torch.float32), (w.row_sum, torch.int32)):
            _check_contiguous(t, dt)
        if w.bias is not None:
            _check_contiguous(w.bias, torch.float32)
        return
    if w is not None:
        _check_contiguous(w, dtype)
    if g.panel is not None:
        _check_contiguous(g.panel.packed, dtype)
    if g.bias is not None:
        _check_vector(g.bias, size[0], dtype)
