"""`gemv.cpp`'s few-row int8 linear layer and `panel_gemm.cpp`'s panel GEMM as tensor-in,
tensor-out calls.

`Gemv.int8(x, w8)` computes `x @ W.T + bias` for 1-8 rows of `x` (`int8_max_rows`) over an int8
weight (`Int8Weight`), quantizing the rows of x as the batched int8 GEMM does, at the rate the
weight streams from memory (gemv.cpp has the design and its measurements).
`Gemv.panel(x, pw)` multiplies float32 or bfloat16 batches of up to `panel_rows[dtype]` (128) rows
by a weight packed in panels (`PanelWeight`, `panel_gemm.cpp`; bfloat16 where the CPU has
AVX512_BF16); it beats oneDNN at every row count it takes, and the linear layers' plan
(models/linear.py) sends it larger batches too, 128 rows a call into one output (`out`). Inputs
are checked here; the C side trusts them.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from inferd.models.kernels.fused import DTYPE_CODES, check_rc


@dataclass(frozen=True)
class Int8Weight:
    """A weight quantized per output row, row-major, as the int8 GEMV reads it."""

    q: Tensor  # [out, in] int8, contiguous
    scale: Tensor  # [out] float32: W ~ q * scale[:, None]
    row_sum: Tensor  # [out] int32: q.sum(1), for the activations' zero point
    bias: Tensor | None  # [out] float32

    @classmethod
    def of(cls, q: Tensor, scale: Tensor, bias: Tensor | None) -> Int8Weight:
        return cls(
            q.contiguous(),
            scale.float().contiguous(),
            q.sum(1, dtype=torch.int32),
            None if bias is None else bias.float().contiguous(),
        )


# Output columns per panel of a PanelWeight (panel.h's kPanel).
PANEL_COLUMNS = 64


@dataclass(frozen=True)
class PanelWeight:
    """A weight [out, in] packed for panel_gemm.cpp in panels of 64 output columns, panel p
    holding columns [64p, 64p + 64) (zeros past `out`): bfloat16 [ceil(out / 64), in / 2, 64, 2],
    the weights of input values 2i and 2i + 1 side by side; float32 [ceil(out / 64), in, 64]."""

    packed: Tensor
    out_features: int
    in_features: int
    bias: Tensor | None  # [out], the weight's dtype

    @staticmethod
    def padded_out(weight_shape: tuple[int, int], dtype: torch.dtype) -> int:
        """Output columns the packed copy of such a weight holds (whole panels); 0 when the
        kernel cannot take it (not float32 or bfloat16, or bfloat16 with an odd number of
        inputs)."""
        n, k = weight_shape
        if dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and k % 2):
            return 0
        return -(-n // PANEL_COLUMNS) * PANEL_COLUMNS

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None) -> PanelWeight | None:
        """None when the kernel cannot take it (`padded_out` says)."""
        n, k = weight.shape
        n_pad = cls.padded_out((n, k), weight.dtype)
        if n_pad == 0:
            return None
        w = weight if n_pad == n else torch.nn.functional.pad(weight, (0, 0, 0, n_pad - n))
        pair = 2 if weight.dtype == torch.bfloat16 else 1
        packed = w.view(n_pad // PANEL_COLUMNS, PANEL_COLUMNS, k // pair, pair).transpose(1, 2)
        if pair == 1:
            packed = packed.squeeze(-1)
        b = None if bias is None else bias.to(weight.dtype).contiguous()
        return cls(packed.contiguous(), n, k, b)

    def rows(self, ids: Tensor) -> Tensor:
        """Weight rows `ids` (any shape) -> [*ids.shape, in]: an embedding lookup on the panel
        copy, for embeddings tied to the weight (models/linear.py frees the plain copy then)."""
        flat = ids.reshape(-1)
        p, c = flat // PANEL_COLUMNS, flat % PANEL_COLUMNS
        # [T, in] float32 from [P, in, 64]; [T, in / 2, 2] bfloat16 from [P, in / 2, 64, 2].
        picked = self.packed[p, :, c] if self.packed.dim() == 3 else self.packed[p, :, c, :]
        return picked.reshape(*ids.shape, self.in_features)

    def unpack(self, p0: int, p1: int) -> Tensor:
        """The weight rows [(p1 - p0) * 64, in] of panels [p0, p1) (zeros past `out_features`)."""
        panels = self.packed[p0:p1]
        return panels.transpose(1, 2).reshape((p1 - p0) * PANEL_COLUMNS, self.in_features)


def panel_rows(lib: ctypes.CDLL) -> dict[torch.dtype, int]:
    """The most rows panel_gemm.cpp takes in each dtype it has (0: none on this CPU)."""
    return {
        dtype: int(lib.inferd_gemm_panel_rows(DTYPE_CODES[dtype]))
        for dtype in (torch.float32, torch.bfloat16)
    }


class Gemv:
    """Bound to a loaded kernel library (kernels.load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        self._fn8 = lib.inferd_gemv_int8
        self._fn8.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i32]
        self._fn8.restype = ctypes.c_int
        # The most rows one int8 call takes; linear layers send larger batches to their GEMM.
        self.int8_max_rows = int(lib.inferd_gemv_int8_max_rows())
        self._panel = lib.inferd_gemm_panel
        self._panel.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i32]
        self._panel.restype = ctypes.c_int
        # The most rows Gemv.panel takes in each dtype (bfloat16 0: the CPU has no AVX512_BF16).
        self.panel_rows = panel_rows(lib)
        self._amx = lib.inferd_panel_amx
        self._amx.argtypes = [i32]
        self._amx.restype = ctypes.c_int

    def amx(self, on: bool | None = None) -> bool:
        """Whether the panel GEMM and the greedy screen run on AMX tiles (x86/amx_panel.h:
        bfloat16 and int8, where the CPU has them and the kernel got them); `on` switches that
        for the whole library (benchmarks and tests compare both paths in one process)."""
        return bool(self._amx(-1 if on is None else int(on)))

    @contextlib.contextmanager
    def amx_set(self, on: bool) -> Iterator[bool]:
        """The block runs with the tiles on or off (`amx(on)`), then they are as they were;
        yields whether they are on (False where the CPU has none, whatever was asked)."""
        had = self.amx()
        try:
            yield self.amx(on)
        finally:
            self.amx(had)

    def int8(self, x: Tensor, w: Int8Weight) -> Tensor:
        """[rows, in] (model dtype, rows <= int8_max_rows) -> [rows, out] in x's dtype."""
        rows, k = self._rows(x, self.int8_max_rows)
        n = w.q.shape[0]
        if w.q.shape[1] != k or x.dtype not in DTYPE_CODES or x.stride(1) != 1:
            raise ValueError(f"gemv int8: x {tuple(x.shape)} {x.dtype}, weight {tuple(w.q.shape)}")
        y = torch.empty(rows, n, dtype=x.dtype)
        rc = self._fn8(
            x.data_ptr(),
            rows,
            x.stride(0),
            w.q.data_ptr(),
            n,
            k,
            w.scale.data_ptr(),
            w.row_sum.data_ptr(),
            None if w.bias is None else w.bias.data_ptr(),
            y.data_ptr(),
            n,
            DTYPE_CODES[x.dtype],
        )
        check_rc(rc, "gemv int8")
        return y

    def panel(self, x: Tensor, w: PanelWeight, out: Tensor | None = None) -> Tensor:
        """[rows, in] in the weight's dtype (rows <= panel_rows[dtype], unit stride along in)
        -> [rows, out], written into `out` (rows of unit stride) when given."""
        dtype = w.packed.dtype
        rows, k = self._rows(x, self.panel_rows[dtype])
        if k != w.in_features or x.dtype != dtype or x.stride(1) != 1:
            raise ValueError(
                f"gemm panel: x {tuple(x.shape)} {x.dtype}, weight in {w.in_features} {dtype}"
            )
        n = w.out_features
        y = torch.empty(rows, n, dtype=dtype) if out is None else out
        if y.shape != (rows, n) or y.dtype != dtype or y.stride(1) != 1:
            raise ValueError(f"gemm panel: out {tuple(y.shape)} {y.dtype} for {rows}x{n}")
        rc = self._panel(
            x.data_ptr(),
            rows,
            x.stride(0),
            w.packed.data_ptr(),
            n,
            k,
            None if w.bias is None else w.bias.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            DTYPE_CODES[dtype],
        )
        check_rc(rc, "gemm panel")
        return y

    def _rows(self, x: Tensor, most: int) -> tuple[int, int]:
        """x's (rows, in), refusing a row count the kernel does not take."""
        rows, k = x.shape
        if not 1 <= rows <= most:
            raise ValueError(f"gemv takes 1-{most} rows, got {rows}")
        return rows, k
