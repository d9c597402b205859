"""`decode_step.cpp`: a step through every decoder layer in one native call, for a batch in
which every row samples: decode rows (one per sequence) and a verify step's rows (a sequence's
last known token and its drafts, causal among themselves). Each linear layer runs the kernel its
dispatch plan gives the step (models/linear.py, "The one-call decode step"): the panel GEMM, up
to 128 rows (float32, and bfloat16 on AVX512_BF16), or the int8 GEMV, up to 8.

`DecodeLayers.plan(...)` takes a model's weights once (each linear layer's kernel copy, norms,
KV caches, RoPE tables), checks their shapes and builds the C structures that point at them; the
returned `DecodePlan` is then called once per step with the step's embeddings and batch
metadata. Its output is bit-for-bit the Python fused path's (same kernels, same order); what it
saves is the Python around ~12 kernel calls per layer, which cost a verify step of 5 llama-32m
rows 1.7x its time (bench/NOTES.md). The plan holds references to every tensor it points at, so
they stay alive as long as it does."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from inferd.models.kernels.decode_moe import ROUTE, MoELayers, MoEStruct, MoEWeights, check_moe
from inferd.models.kernels.fused import DTYPE_CODES, KV_DTYPE_CODES, check_rc
from inferd.models.kernels.gemv import Int8Weight, PanelWeight
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
        ("kernel", _i64),
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
        ("moe", ctypes.POINTER(MoEStruct)),
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
        ("route", ROUTE),
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
        ("num_seqs", _i64),
        ("experts", _ptr),
        ("weights", _ptr),
        ("moe_scratch", _ptr),
        ("counts", _ptr),
    ]


# The kernels a decode step runs a linear layer on (decode_step.cpp's Lin::kernel).
STEP_KERNELS: dict[str, int] = {"panel": 0, "gemv_int8": 1}


@dataclass(frozen=True)
class GemvWeight:
    """One linear layer as the decode step runs it, as its dispatch plan says (models/linear.py,
    `Linear.gemv_weight`): `kernel` on its copy of the weight, for steps of up to `max_rows` rows.
    "panel": the panel GEMM on a `PanelWeight` (float32, bfloat16; its bias inside);
    "gemv_int8": the int8 GEMV on an `Int8Weight` (its float32 bias inside)."""

    kernel: Literal["panel", "gemv_int8"]
    weight: PanelWeight | Int8Weight
    max_rows: int

    def __post_init__(self) -> None:
        want = PanelWeight if self.kernel == "panel" else Int8Weight
        if not isinstance(self.weight, want):
            raise ValueError(f"the {self.kernel} kernel reads a {want.__name__}")

    @property
    def shape(self) -> tuple[int, int]:
        w = self.weight
        if isinstance(w, Int8Weight):
            return int(w.q.shape[0]), int(w.q.shape[1])
        return w.out_features, w.in_features


@dataclass(frozen=True)
class LayerWeights:
    in_norm: Tensor  # [hidden]
    post_norm: Tensor  # [hidden]
    q_norm: Tensor | None  # [head_dim] (Qwen3) or None
    k_norm: Tensor | None
    kv_cache: Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 if int8)]
    qkv: GemvWeight
    o: GemvWeight
    gate_up: GemvWeight | None  # the dense MLP's (None: `moe`)
    down: GemvWeight | None
    window: int = 0  # sliding window of the layer's attention (0: none)
    moe: MoEWeights | None = None  # the MoE block in place of the dense MLP


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

    def plan(
        self,
        layers: Sequence[LayerWeights],
        final_norm: Tensor,
        cos: Tensor,
        sin: Tensor,
        shape: DecodeShape,
    ) -> DecodePlan:
        """The step takes as many rows as every linear layer's kernel does (`max_rows`)."""
        lins = [w for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down) if w is not None]
        most = [w.max_rows for w in lins] + [lw.moe.panels.max_rows for lw in layers if lw.moe]
        rows = min(most) if most else 1
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
        moe = MoELayers([lw.moe for lw in layers], max_rows, dtype, hidden)
        self._moe = moe
        self._layers = (_Layer * len(layers))(
            *(_layer(lw, moe.struct(i)) for i, lw in enumerate(layers))
        )
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
            route=moe.callback,
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
        self._step = _Step(**{k: t.data_ptr() for k, t in self._scratch.items()}, **moe.buffers())
        moe.x = self._scratch["x"]
        self.dtype = dtype
        self.hidden = hidden
        self.max_rows = rows
        # Sequences of several query rows (a verify step's last token and drafts) run here too;
        # False: only steps of one row per sequence (bench/spec.py measures the two).
        self.multi_row = True

    def takes(self, rows: int, batch: PagedBatch) -> bool:
        """Whether a step of `rows` query rows over `batch` fits this plan (the caller checks
        that every row samples: the step computes every row through every layer)."""
        return rows <= self.max_rows and (self.multi_row or batch.num_seqs == rows)

    def __call__(
        self, embed: Tensor, positions: Tensor, slots: Tensor, batch: PagedBatch
    ) -> Tensor:
        """embed [T, hidden] (T <= max_rows rows: `batch`'s sequences' query rows, in its
        order, each sequence's rows causal among themselves) -> the final norm's output
        [T, hidden] for every row; writes this step's K/V."""
        rows, seqs = embed.shape[0], batch.num_seqs
        if not 1 <= seqs <= rows <= self.max_rows:
            raise ValueError(f"decode step of {rows} rows over {seqs} sequences")
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
        s.num_seqs = seqs
        rc = self._fn(ctypes.byref(self._model), ctypes.byref(s))
        self._moe.raise_failure()
        check_rc(rc, "decode step")
        return out

    def take_expert_rows(self) -> list[int]:
        """Rows routed to each expert by this plan's steps since the last call, summed over its
        MoE layers (empty without them)."""
        return self._moe.take_rows()


def _layer(lw: LayerWeights, moe: Any) -> _Layer:
    return _Layer(
        in_norm=lw.in_norm.data_ptr(),
        post_norm=lw.post_norm.data_ptr(),
        q_norm=None if lw.q_norm is None else lw.q_norm.data_ptr(),
        k_norm=None if lw.k_norm is None else lw.k_norm.data_ptr(),
        kv_cache=lw.kv_cache.data_ptr(),
        qkv=_lin(lw.qkv),
        o=_lin(lw.o),
        gate_up=_Lin() if lw.gate_up is None else _lin(lw.gate_up),
        down=_Lin() if lw.down is None else _lin(lw.down),
        window=lw.window,
        moe=moe,
    )


def _lin(g: GemvWeight) -> _Lin:
    n, k = g.shape
    kernel = STEP_KERNELS[g.kernel]
    w = g.weight
    if isinstance(w, Int8Weight):
        bias = None if w.bias is None else w.bias.data_ptr()
        return _Lin(w.q.data_ptr(), bias, w.scale.data_ptr(), w.row_sum.data_ptr(), n, k, kernel)
    bias = None if w.bias is None else w.bias.data_ptr()
    return _Lin(None, bias, None, None, n, k, kernel, w.packed.data_ptr())


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
    # The dense MLPs' intermediate size (0: every layer's MLP is an MoE block).
    inter = next((lw.down.shape[1] for lw in layers if lw.down is not None), 0)
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
    experts = {lw.moe.panels.experts for lw in layers if lw.moe is not None}
    if len(experts) > 1:
        raise ValueError(f"MoE layers of {sorted(experts)} experts")
    for lw in layers:
        _check_layer(lw, kv, hidden, d, dtype)
        _check_linears(lw, expect, dtype)
    return hidden, inter


def _check_linears(
    lw: LayerWeights, expect: dict[str, tuple[int, int]], dtype: torch.dtype
) -> None:
    """The layer's linear layers' shapes (an MoE layer's experts: their count and sizes)."""
    mlp = ("gate_up", "down")
    for name, size in expect.items():
        g = getattr(lw, name)
        if g is None and not (lw.moe is not None and name in mlp):
            raise ValueError(f"{name}: no weight")
        if g is not None:
            _check_linear(g, size, dtype, name)
    if lw.moe is not None:
        check_moe(lw.moe)


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
    _check_contiguous(w.packed, dtype)
    if w.bias is not None:
        _check_vector(w.bias, size[0], dtype)
