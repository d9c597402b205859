"""The native small-batch GEMV (`kernels/gemv.cpp`) against F.linear on the same weights.

float32 must agree to float32 rounding (only the order of each dot product's sum differs);
bfloat16 to one rounding of the output (both accumulate in float32 and round once).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from inferd.models import kernels
from inferd.models.kernels.gemv import Gemv, Int8Weight

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gemv(native_kernels: kernels.NativeKernels) -> Gemv:
    return native_kernels.gemv


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(1024, 512), (1027, 500), (5, 17), (3, 1408)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(
    gemv: Gemv, dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    # Odd n (a last partial block of 4 output rows), odd k (a masked tail) and 9-16 rows (two
    # groups of rows over each block) included.
    x = _rand(rows, k, dtype=dtype, seed=1)
    w = _rand(n, k, dtype=dtype, seed=2)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    got = gemv(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one bfloat16 rounding of the float32 result: half an ulp, 2^-9 relative
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_reads_strided_rows(gemv: Gemv) -> None:
    # Rows of a wider buffer (a slice of a padded activation) are read in place.
    buf = _rand(4, 80, dtype=torch.float32, seed=4)
    x = buf[1:3, :64]
    w = _rand(33, 64, dtype=torch.float32, seed=5)
    torch.testing.assert_close(gemv(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_take(gemv: Gemv) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(gemv.max_rows + 1, 16), w, None)
    with pytest.raises(ValueError, match="rows"):
        w8 = Int8Weight.of(w.to(torch.int8), w[:, 0], None)
        gemv.int8(torch.randn(gemv.int8_max_rows + 1, 16), w8)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(0, 16), w, None)
    with pytest.raises(ValueError):
        gemv(torch.randn(1, 16).bfloat16(), w, None)  # dtypes differ
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(1, 16), torch.randn(16, 8).t(), None)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.randn(1, 16), w, torch.randn(9))


def _quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What the int8 GEMV does to x: per row, uint8 over [min(x, 0), max(x, 0)], ties to even."""
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    scale = (hi - lo) / 255
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 255)
    q = (torch.round(x * (1 / scale)[:, None]) + zero[:, None]).clamp(0, 255)
    return q, scale, zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(1024, 512), (1027, 500), (5, 17), (3, 1408)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_is_its_integer_dot_product(
    gemv: Gemv, dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    from inferd.models.linear import quantize_int8

    x = _rand(rows, k, dtype=dtype, seed=6)
    w = _rand(n, k, dtype=torch.float32, seed=7)
    b = _rand(n, dtype=torch.float32, seed=8) if bias else None
    qw, sw = quantize_int8(w)
    got = gemv.int8(x, Int8Weight.of(qw, sw, b))
    assert got.shape == (rows, n) and got.dtype == dtype
    # The same integers in float64: the products and sums are exact, so only the final scaling
    # (float32) and the output rounding differ.
    qx, sx, zx = _quantize_rows(x.float())
    dot = (qx.double() - zx.double()[:, None]) @ qw.double().T
    want = sx.double()[:, None] * sw.double()[None, :] * dot
    if b is not None:
        want = want + b.double()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-2)
    torch.testing.assert_close(got.double(), want, **tol)  # type: ignore[arg-type]
    # And the layer it stands for, to 8-bit precision: a few percent of the output's range.
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 0.05


def test_int8_all_zero_rows_give_the_bias(gemv: Gemv) -> None:
    from inferd.models.linear import quantize_int8

    qw, sw = quantize_int8(_rand(9, 70, dtype=torch.float32, seed=9))
    b = _rand(9, dtype=torch.float32, seed=10)
    got = gemv.int8(torch.zeros(2, 70), Int8Weight.of(qw, sw, b))
    torch.testing.assert_close(got, b.expand(2, 9))
