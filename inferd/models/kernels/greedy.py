"""Exact greedy tokens without multiplying the whole lm_head: an int8 screen with error bounds
(`inferd_greedy_screen` in kernels/greedy.cpp), then the exact logits of the few columns that
can still be a row's largest.

    head = GreedyHead.of(native.screen, native.gemv.panel_rows, lm_head.panel_copy(),
                         lm_head.plain_weight())      # None where it does not run
    tokens = head(x)     # x: [rows, hidden], the lm_head's input rows -> [rows] int64, or None:
                         # run the lm_head and the argmax as usual

"The full path" below is what a plain greedy batch runs without it: the panel GEMM over the whole
lm_head (logits in the model dtype), then FusedOps.argmax.

Why: a greedy step needs only the argmax of each row's logits, and the lm_head is the largest
weight of a small model (the Qwen2-0.5B shape: 136 M of its 494 M parameters, 28 % of a decode
token's multiply-adds). VNNI's u8 x s8 dot product does twice the multiply-adds of an AVX512_BF16
one per instruction, four times a float32 FMA's, at the same rate (AMD Zen 4: one 512-bit
instruction a cycle each), and reads one byte a weight; so the screen gains against a float32 and
a bfloat16 lm_head at every row count.

The bound. Each row of x is quantized to uint8 from its own range, x = sx (u - z) + e, and each
column of the lm_head to int8 symmetrically, W_v = s_v q_v + d_v. The screen's
A_v = sx s_v (u . q_v - z sum(q_v)) is integer arithmetic, exact, and (Cauchy-Schwarz, 2-norms)

    |x . W_v - A_v| <= |x| |d_v| + |e| |W_v| + |e| |d_v|

|W_v| and |d_v| are computed once here (float64, rounded up), |x| and |e| per row by the kernel
(e value by value, exactly, in double). The logit the full path computes differs from x . W_v by
its float32 sums' rounding, at most 2 k 2^-24 |x| |W_v|; the kernel adds that, then 2^-10 of the
whole, 2^-16 of |A_v| and 1e-30 for its own float32 arithmetic. So each exact logit lies in
[lo_v, hi_v] = A_v -/+ eps_v, and m = max_v lo_v is at most the largest. A winner (a column whose
logit, as the full path rounds it, equals the largest) has a logit of at least m less that
rounding: bfloat16 logits keep 8 significant bits, so m - 2^-6 |m| - 1e-30 (float32 logits are not
rounded: 2^-20, for ties). Every column whose hi_v reaches that is a candidate; any other column's
logit is strictly below every winner's.

The candidates of all rows (ascending) are then multiplied exactly by the lm_head's own kernel,
the panel GEMM, on the same values (their weights packed into panels again, in the same native
call, from the row-major weight where one is kept, else from the panel copy; a column's sum runs
the same instructions in the same order in any panel), so their logits are bit for bit the full
path's. The argmax over them (the first on ties, as FusedOps.argmax and torch) is the full path's:
a column that is only another row's candidate is below this row's winners.

None (the caller runs the lm_head): a row with a value that is not finite, more than
`max_candidates` candidates (a quarter of the columns; an all-zero row ties every column), more
rows than the panel GEMM takes (128: larger batches run oneDNN, whose sums are ordered
otherwise). The lm_head must have a panel copy and no bias.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from inferd.models.kernels.fused import DTYPE_CODES
from inferd.models.kernels.gemv import PANEL_COLUMNS, PanelWeight

# Columns of the exact weight unpacked from the panel copy at a time while building (float64).
_BUILD_CHUNK = 4096
# Smaller lm_heads run whole: a call's fixed costs take about what the screen saves (bfloat16
# lm_heads of 1,024 columns measured 0.86-1.09x; 4,096 columns 1.3-1.9x in both dtypes).
MIN_COLUMNS = 4096


@dataclass(frozen=True)
class ScreenWeight:
    """The lm_head quantized for the screen: int8 in panels of 64 columns,
    [n_pad / 64][k / 4][64][4] (VPDPBUSD's four inputs a lane), and per column (n_pad each) the
    scale, the sum of the integers, |W_v| and |d_v| (float32, rounded up)."""

    q: Tensor
    scale: Tensor
    col_sum: Tensor
    norm_w: Tensor
    norm_d: Tensor

    @classmethod
    def of(cls, panel: PanelWeight) -> ScreenWeight | None:
        """None when a weight is not finite (no bound holds then)."""
        num_panels, k = panel.packed.shape[0], panel.in_features
        n_pad = num_panels * PANEL_COLUMNS
        q = torch.empty(n_pad, k, dtype=torch.int8)
        scale, norm_w, norm_d = (torch.empty(n_pad, dtype=torch.float32) for _ in range(3))
        per = _BUILD_CHUNK // PANEL_COLUMNS
        # float32 throughout (the weights are float32 or bfloat16, exact in it): the rounding of
        # the norms' float32 sums (< k 2^-24 relative) and of d = W - s q (< 2^-21 |W| a value:
        # |s q| < 3 |W| where q != 0) are added to the norms, so they stay upper bounds.
        sums = 1.0 + k * 2.0**-23
        for p0 in range(0, num_panels, per):
            w = panel.unpack(p0, min(num_panels, p0 + per)).float()
            amax = w.abs().amax(dim=1)
            if not bool(torch.isfinite(amax).all()):
                return None
            s = amax / 127  # the scale the kernel multiplies by
            inv = torch.where(s > 0, 1.0 / s, 0.0)
            qi = (w * inv[:, None]).round_().clamp_(-127, 127)
            nw = torch.linalg.vector_norm(w, dim=1)
            d = torch.addcmul(w, s[:, None], qi, value=-1.0)
            nd = torch.linalg.vector_norm(d, dim=1) * sums + nw * 2.0**-20
            rows = slice(p0 * PANEL_COLUMNS, (p0 + per) * PANEL_COLUMNS)
            q[rows], scale[rows] = qi.to(torch.int8), s
            norm_w[rows], norm_d[rows] = _round_up(nw.double() * sums), _round_up(nd.double())
        col_sum = q.sum(dim=1, dtype=torch.int32)
        vnni = q.view(n_pad // PANEL_COLUMNS, PANEL_COLUMNS, k // 4, 4).transpose(1, 2)
        return cls(vnni.contiguous(), scale, col_sum, norm_w, norm_d)


def _round_up(v: Tensor) -> Tensor:
    """float64 -> the least float32 not below it."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.full_like(f, torch.inf)), f)


class GreedyScreen:
    """`inferd_greedy_screen`, bound to a loaded kernel library (kernels.load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        # Both entry points start with x and the screen's weight (_screen_args).
        screen: list[type[ctypes.c_int32 | ctypes.c_int64 | ctypes.c_void_p]]
        screen = [ptr, i64, i64, i32, ptr, i64, i64, ptr, ptr, ptr, ptr]
        self._fn = lib.inferd_greedy_screen
        self._fn.argtypes = [*screen, i32, ptr, i64]
        self._fn.restype = ctypes.c_int64
        self._head = lib.inferd_greedy_head
        self._head.argtypes = [*screen, ptr, ptr, ptr, i64, ptr]
        self._head.restype = ctypes.c_int64

    def __call__(self, x: Tensor, w: ScreenWeight, out_features: int, cand: Tensor) -> int:
        """Writes the candidate columns of x's rows (unit stride along k) to `cand` (int32);
        returns how many, or < 0 (-2: a value of x not finite, -3: more than cand holds, -4: no
        memory for its scratch)."""
        bf16 = int(x.dtype == torch.bfloat16)
        rc = self._fn(*_screen_args(x, w, out_features), bf16, cand.data_ptr(), cand.numel())
        return _checked(int(rc), x)

    def tokens(
        self, x: Tensor, w: ScreenWeight, panel: PanelWeight, plain: Tensor | None, cand: Tensor
    ) -> Tensor | None:
        """x's greedy tokens (int64, [rows]) from the screen, then the candidates' exact logits
        (their weights packed from `plain`, the row-major lm_head, or else from `panel`) and their
        argmax, in one native call; None where the screen declines (the caller runs the whole
        lm_head). The candidates are left in `cand` (int32)."""
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self._head(
            *_screen_args(x, w, panel.out_features),
            None if plain is None else plain.data_ptr(),
            panel.packed.data_ptr(),
            cand.data_ptr(),
            cand.numel(),
            tokens.data_ptr(),
        )
        return tokens if _checked(int(rc), x) > 0 else None


def _screen_args(x: Tensor, w: ScreenWeight, out_features: int) -> tuple[int, ...]:
    """The arguments both native entry points open with: x, its shape and dtype, the int8
    lm_head and its per-column scale, sum and norms."""
    return (
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        DTYPE_CODES[x.dtype],
        w.q.data_ptr(),
        out_features,
        x.shape[1],
        w.scale.data_ptr(),
        w.col_sum.data_ptr(),
        w.norm_w.data_ptr(),
        w.norm_d.data_ptr(),
    )


def _checked(rc: int, x: Tensor) -> int:
    """rc, unless it is -1 (arguments the kernel refuses: a caller's bug, not a decline)."""
    if rc == -1:
        raise ValueError(f"greedy screen rejected x {tuple(x.shape)} {x.dtype}")
    return rc


class GreedyHead:
    """See the module docstring. Built once at load; called on each plain greedy batch."""

    def __init__(
        self,
        screen: GreedyScreen,
        panel: PanelWeight,
        weight: ScreenWeight,
        plain: Tensor | None,
        max_rows: int,
    ) -> None:
        self._screen = screen
        self.panel = panel
        self._plain = plain
        self.weight = weight
        self.max_rows = max_rows
        # Past this many candidates the screen's own cost plus theirs nears the whole lm_head's
        # (llama-32m's 8,192 columns at 128 rows: 15 % of the columns, still 1.3x in bfloat16).
        self.max_candidates = max(PANEL_COLUMNS, panel.out_features // 4)
        self._cand = torch.empty(self.max_candidates, dtype=torch.int32)

    @classmethod
    def of(
        cls,
        screen: GreedyScreen,
        panel_rows: dict[torch.dtype, int],
        panel: PanelWeight | None,
        plain: Tensor | None = None,
        min_columns: int = MIN_COLUMNS,
        max_rows: dict[torch.dtype, int] | None = None,
    ) -> GreedyHead | None:
        """None unless the lm_head runs the panel GEMM (`panel`, its copy) on a float32 or
        bfloat16 weight of at least `min_columns` outputs without bias, with a multiple of 4
        inputs, all finite; batches of as many rows as the panel GEMM takes (fewer with
        `max_rows[dtype]`): the screen gains at every row count it takes (bench/greedy_head.py on
        the Qwen2-0.5B shape: float32 3.2-3.7x the whole lm_head at 1-48 rows, bfloat16 1.3-1.5x
        at 12-96; docs/benchmarks.md). `plain`: the row-major
        weight, if kept (tied embeddings): the candidates' rows are read from it (from the
        panels, one cache line a value, otherwise). `panel_rows`: Gemv.panel_rows."""
        if panel is None or panel.bias is not None or panel.in_features % 4:
            return None
        dtype = panel.packed.dtype
        rows = panel_rows.get(dtype, 0)
        if max_rows is not None:
            rows = min(rows, max_rows.get(dtype, 0))
        if rows < 1 or panel.out_features < min_columns:
            return None
        weight = ScreenWeight.of(panel)
        if weight is None:
            return None
        if plain is not None and (
            plain.dtype != dtype
            or plain.shape != (panel.out_features, panel.in_features)
            or not plain.is_contiguous()
        ):
            plain = None
        return cls(screen, panel, weight, plain, rows)

    def candidates(self, x: Tensor) -> Tensor | None:
        """The columns (int64, ascending) whose exact logit can be a row's largest, or None."""
        if not self._takes(x):
            return None
        count = self._screen(x, self.weight, self.panel.out_features, self._cand)
        return None if count < 0 else self._cand[:count].long()

    def __call__(self, x: Tensor) -> Tensor | None:
        if not self._takes(x):
            return None
        return self._screen.tokens(x, self.weight, self.panel, self._plain, self._cand)

    def _takes(self, x: Tensor) -> bool:
        rows, k = x.shape
        if not 0 < rows <= self.max_rows or x.dtype != self.panel.packed.dtype:
            return False
        if k != self.panel.in_features or x.stride(1) != 1:
            raise ValueError(f"greedy head: x {tuple(x.shape)} for {self.panel.in_features} inputs")
        return True
