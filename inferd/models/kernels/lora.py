"""The LoRA adapters' term of a linear layer over a step's rows in one native call
(`inferd_lora_sgmv`, kernels/lora.cpp): every adapter's segment of rows, both threads.

    kernel(x, y, step, table)   # y[rows of segment s] += (x[rows] At_p) Bt_p, p its slot

`SgmvStep` is built once per engine step (which rows each segment has, and its slot) and shared
by every layer; `SgmvTable` once per layer, updated when a slot gets another adapter (pointers
to the adapter's own factors: no copy).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from inferd.models.kernels.fused import DTYPE_CODES


@dataclass
class SgmvStep:
    """The step's segments: `seg_slot` [S] int32, `seg_off` [S + 1] int64 into `rows` [R] int64
    (flat-batch row indices), and a float32 scratch of [R, ld_v] for x At."""

    seg_slot: np.ndarray
    seg_off: np.ndarray
    rows: np.ndarray
    scratch: Tensor


@dataclass
class SgmvTable:
    """One layer's slots: each slot's At [in, w] and Bt [w, out] (model dtype, contiguous), its
    rank rows' column spans [w, 2] int32 and its width w (0: no factors for this layer)."""

    num_slots: int
    at: np.ndarray = field(init=False)
    bt: np.ndarray = field(init=False)
    spans: np.ndarray = field(init=False)
    width: np.ndarray = field(init=False)
    # The tensors the pointers point into, kept alive here.
    _held: list[tuple[Tensor, Tensor, Tensor] | None] = field(init=False)

    def __post_init__(self) -> None:
        self.at = np.zeros(self.num_slots, dtype=np.uint64)
        self.bt = np.zeros(self.num_slots, dtype=np.uint64)
        self.spans = np.zeros(self.num_slots, dtype=np.uint64)
        self.width = np.zeros(self.num_slots, dtype=np.int32)
        self._held = [None] * self.num_slots

    def set(self, slot: int, factors: tuple[Tensor, Tensor, Tensor] | None) -> None:
        """(At, Bt, spans) for `slot`, or None: the slot's adapter has none here."""
        self._held[slot] = factors
        if factors is None:
            self.width[slot] = 0
            return
        at, bt, spans = factors
        assert at.is_contiguous() and bt.is_contiguous() and spans.dtype == torch.int32
        self.at[slot], self.bt[slot] = at.data_ptr(), bt.data_ptr()
        self.spans[slot] = spans.data_ptr()
        self.width[slot] = at.shape[1]


class SgmvKernel:
    """Bound to a loaded kernel library (kernels.load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        fn = lib.inferd_lora_sgmv
        fn.argtypes = [ptr, i64, ptr, i64, i32, i64, i64, i64, ptr, ptr, ptr]
        fn.argtypes += [ptr, ptr, ptr, ptr, ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def takes(x: Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPE_CODES

    def __call__(self, x: Tensor, y: Tensor, step: SgmvStep, table: SgmvTable) -> None:
        # x: [T', in], y: [T', out], rows contiguous (stride(1) == 1), the same dtype
        assert x.stride(1) == 1 and y.stride(1) == 1 and x.dtype == y.dtype
        rc = self._fn(
            x.data_ptr(),
            x.stride(0),
            y.data_ptr(),
            y.stride(0),
            DTYPE_CODES[x.dtype],
            x.shape[1],
            y.shape[1],
            len(step.seg_slot),
            step.seg_slot.ctypes.data,
            step.seg_off.ctypes.data,
            step.rows.ctypes.data,
            table.at.ctypes.data,
            table.bt.ctypes.data,
            table.spans.ctypes.data,
            table.width.ctypes.data,
            step.scratch.data_ptr(),
            step.scratch.shape[1],
        )
        if rc != 0:
            raise RuntimeError(f"LoRA kernel rejected its arguments (rc={rc})")
