"""The panel GEMM (`kernels/panel_gemm.cpp`) against F.linear on the same weights.

Both accumulate in float32 (bfloat16: rounding once to bfloat16 at the end), so they agree to a
float32 sum's rounding, or one bfloat16 rounding of the output (the order of the sums differs).
The packing (`PanelWeight.of`) is checked against its layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from inferd.models import kernels
from inferd.models.kernels.gemv import PANEL_COLUMNS, Gemv, PanelWeight

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gemv(native_kernels: kernels.NativeKernels, panel_path: str) -> Gemv:
    """Every test of the kernel runs on both paths where the CPU has AMX (tests/conftest.py's
    panel_path); the pure-Python ones (the packing) run everywhere, kernel or not."""
    return native_kernels.gemv


def _runs(gemv: Gemv, dtype: torch.dtype) -> None:
    if gemv.panel_rows[dtype] == 0:
        pytest.skip("no AVX512_BF16 on this CPU: no bfloat16 panel GEMM")


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _check(got: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> None:
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == want.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        # float32 sums of up to 1408 products of unit normals, in another order.
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)
    else:
        # One bfloat16 rounding of the float32 sum: half an ulp, 2^-9 relative.
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 17, 24, 31, 32, 48, 63, 64, 65, 100, 128])
@pytest.mark.parametrize(("n", "k"), [(1024, 512), (1000, 500), (16, 2), (70, 1408), (3, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(
    gemv: Gemv, dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    # n off the 64-column panel (a masked last panel, even under 16 columns), k past and off the
    # 512-step block (bfloat16 1408: a block and a short one; float32 steps are single inputs),
    # and row counts that split into uneven tiles of up to 6 rows.
    _runs(gemv, dtype)
    x = _rand(rows, k, seed=1, dtype=dtype)
    w = _rand(n, k, seed=2, dtype=dtype)
    b = _rand(n, seed=3, dtype=dtype) if bias else None
    _check(gemv.panel(x, PanelWeight.of(w, b)), x, w, b)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_strided_rows(gemv: Gemv, dtype: torch.dtype) -> None:
    # The linear layers pass views whose rows are further apart than `in` (q/k/v slices).
    _runs(gemv, dtype)
    big = _rand(40, 1536, seed=4, dtype=dtype)
    x = big[:, 512:1024]
    w = _rand(96, 512, seed=5, dtype=dtype)
    _check(gemv.panel(x, PanelWeight.of(w, None)), x, w, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_independent(gemv: Gemv, dtype: torch.dtype) -> None:
    # A row's result does not depend on which other rows share the call (tiles change with the
    # row count): bit-for-bit, as each row's sums run in the same order.
    _runs(gemv, dtype)
    x = _rand(128, 1408, seed=6, dtype=dtype)
    pw = PanelWeight.of(_rand(200, 1408, seed=7, dtype=dtype), None)
    assert pw is not None
    full = gemv.panel(x, pw)
    for rows in (1, 17, 33, 100):
        assert torch.equal(gemv.panel(x[:rows], pw), full[:rows])


def test_packing_layout() -> None:
    w = torch.arange(70 * 6, dtype=torch.float32).reshape(70, 6)
    pw = PanelWeight.of(w.to(torch.bfloat16), None)
    assert pw is not None and pw.packed.shape == (2, 3, PANEL_COLUMNS, 2)
    # Panel p, input pair i, column c: W[64p + c, 2i : 2i + 2]; zeros past the 70 columns.
    assert torch.equal(pw.packed[1, 2, 5], w[69, 4:6].to(torch.bfloat16))
    assert torch.equal(pw.packed[0, 0, 3], w[3, 0:2].to(torch.bfloat16))
    assert not pw.packed[1, :, 6:].any()
    # float32: panel p, input i, column c: W[64p + c, i].
    pw = PanelWeight.of(w, None)
    assert pw is not None and pw.packed.shape == (2, 6, PANEL_COLUMNS)
    assert pw.packed[1, 5, 5] == w[69, 5] and pw.packed[0, 1, 3] == w[3, 1]
    assert not pw.packed[1, :, 6:].any()


def test_refuses_what_it_cannot_take(gemv: Gemv) -> None:
    assert PanelWeight.of(_rand(8, 7, seed=8), None) is None  # bfloat16, odd k: no whole pairs
    assert PanelWeight.of(torch.randn(8, 8).half(), None) is None  # float16
    pw = PanelWeight.of(torch.randn(8, 8), None)
    assert pw is not None
    with pytest.raises(ValueError, match="1-128 rows"):
        gemv.panel(torch.randn(129, 8), pw)
    with pytest.raises(ValueError, match="gemm panel"):
        gemv.panel(torch.randn(4, 10), pw)
    with pytest.raises(ValueError, match="gemm panel"):
        gemv.panel(_rand(4, 8, seed=11), pw)  # bfloat16 rows, a float32 weight
