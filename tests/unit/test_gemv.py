"""The native int8 small-batch GEMV (`kernels/gemv.cpp`) against its integer dot products in
float64 and F.linear on the float weights.

Against the integers, float32 must agree to float32 rounding (only the final scaling differs),
bfloat16 to one rounding of the output; against F.linear, to 8-bit precision.
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


def test_refuses_what_it_cannot_take(gemv: Gemv) -> None:
    w = torch.randn(8, 16)
    w8 = Int8Weight.of(w.to(torch.int8), w[:, 0], None)
    with pytest.raises(ValueError, match="rows"):
        gemv.int8(torch.randn(gemv.int8_max_rows + 1, 16), w8)
    with pytest.raises(ValueError, match="rows"):
        gemv.int8(torch.randn(0, 16), w8)
    with pytest.raises(ValueError):
        gemv.int8(torch.randn(1, 17), w8)  # inputs differ


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


def test_int8_reads_strided_rows(gemv: Gemv) -> None:
    # Rows of a wider buffer (a slice of a padded activation) are read in place.
    from inferd.models.linear import quantize_int8

    buf = _rand(4, 80, dtype=torch.float32, seed=11)
    x = buf[1:3, :64]
    w8 = Int8Weight.of(*quantize_int8(_rand(33, 64, dtype=torch.float32, seed=12)), None)
    assert torch.equal(gemv.int8(x, w8), gemv.int8(x.contiguous(), w8))
