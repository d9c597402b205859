"""The MoE layers of `decode.py`'s one-call decode step (decode_step.cpp's `Moe`): each layer's
router runs in torch, called back from the native step (`MoELayers.callback`), so the experts
chosen are the layer-by-layer path's and transformers' (models/moe.py: the router is kept out of
the native kernels, whose sums could flip a near tie); the experts then run in
moe_experts.cpp's one call, as on that path. The callback writes the step's `experts` and
`weights` buffers; what it raises is kept and raised again once the native step returns."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from inferd.models.kernels.fused import MOE_KERNEL_CODES, MoEPanels

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class MoEStruct(ctypes.Structure):
    _fields_ = [
        ("w13", ctypes.POINTER(_ptr)),
        ("w2", ctypes.POINTER(_ptr)),
        ("experts", _i64),
        ("top_k", _i64),
        ("inter", _i64),
        ("counts", _ptr),
        ("kernel", _i64),
        ("max_rows", _i64),
    ]


# decode_step.cpp's Model::route: (layer, rows) -> 0, or nonzero where the router failed.
ROUTE = ctypes.CFUNCTYPE(ctypes.c_int, _i64, _i64)


# An MoE block's router (models/moe.py's `route`): x [T, hidden] -> (routing weights [T, k] in
# x's dtype, experts [T, k] int64).
Router = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class MoEWeights:
    """An MoE layer's MLP as the decode step runs it, as models/moe.py's fused path does: `route`
    (torch's ops, called back from the native step), then every expert's copies in one call of
    moe_experts.cpp (`panels.max_rows`: the most rows an expert takes, the step's most at
    least)."""

    route: Router
    panels: MoEPanels
    top_k: int
    inter: int


class MoELayers:
    """A plan's MoE layers: their structures, the step's buffers for them, and the router
    callback the native step calls (decode_step.cpp's Model::route)."""

    def __init__(
        self, layers: Sequence[MoEWeights | None], rows: int, dtype: torch.dtype, hidden: int
    ) -> None:
        """`layers`: each layer's MoE block (None: a dense MLP); `rows`: the step's most."""
        moes = {i: m for i, m in enumerate(layers) if m is not None}
        self._routers = {i: m.route for i, m in moes.items()}
        experts = next(iter(moes.values())).panels.experts if moes else 0
        k = max((m.top_k for m in moes.values()), default=0)
        inter = max((m.inter for m in moes.values()), default=0)
        self.rows = torch.zeros(experts, dtype=torch.int64)  # added to by every step
        self._experts = torch.zeros(rows, k, dtype=torch.int64)
        self._weights = torch.zeros(rows, k, dtype=dtype)
        self._scratch = torch.empty(rows * k * (2 * hidden + 3 * inter), dtype=dtype)
        self._counts = torch.zeros(experts, dtype=torch.int64)
        self._structs = {
            i: MoEStruct(
                _addresses(m.panels.gate_up),
                _addresses(m.panels.down),
                experts,
                m.top_k,
                m.inter,
                self.rows.data_ptr(),
                MOE_KERNEL_CODES[m.panels.kernel],
                m.panels.max_rows,
            )
            for i, m in moes.items()
        }
        self.x: Tensor | None = None  # the step's x scratch, the router's input
        self._failure: BaseException | None = None
        self.callback = ROUTE(self._route)

    def struct(self, layer: int) -> Any:
        """A pointer to layer `layer`'s _Moe, or None for a dense layer."""
        moe = self._structs.get(layer)
        return None if moe is None else ctypes.pointer(moe)

    def buffers(self) -> dict[str, int]:
        return {
            "experts": self._experts.data_ptr(),
            "weights": self._weights.data_ptr(),
            "moe_scratch": self._scratch.data_ptr(),
            "counts": self._counts.data_ptr(),
        }

    def _route(self, layer: int, rows: int) -> int:
        """MoE layer `layer`'s router on x's first `rows` rows -> the step's experts and weights
        (0), or 1 with the exception kept for `raise_failure`."""
        try:
            assert self.x is not None
            weights, experts = self._routers[layer](self.x[:rows])
            self._weights[:rows].copy_(weights)
            self._experts[:rows].copy_(experts)
        except BaseException as e:  # raised again once the native step returns
            self._failure = e
            return 1
        return 0

    def raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def take_rows(self) -> list[int]:
        rows = self.rows.tolist()
        self.rows.zero_()
        return rows


def _addresses(ptrs: list[int]) -> Any:
    return (ctypes.c_void_p * len(ptrs))(*ptrs)


def check_moe(moe: MoEWeights) -> None:
    p, e = moe.panels, moe.panels.experts
    if len(p.down) != len(p.gate_up) or not 0 < moe.top_k <= e or moe.inter <= 0:
        raise ValueError(f"MoE of {e} experts, top {moe.top_k}, intermediate {moe.inter}")
