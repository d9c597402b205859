"""Linear kernels (inferd/models/linear.py) against F.linear on the same dense weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.models.linear import (
    ROW_BUCKETS,
    Linear,
    has_int8_gemm,
    padded_rows,
    prepare_linears,
)

pytestmark = pytest.mark.integration

onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
    reason="PyTorch without oneDNN",
)


def _linear(bias: bool, dtype: torch.dtype = torch.float32) -> Linear:
    torch.manual_seed(0)
    m = Linear(96, [("a", 40), ("b", 24)], bias=bias, dtype=dtype)
    with torch.no_grad():
        m.weight.normal_()
        if m.bias is not None:
            m.bias.normal_()
    return m


@onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 128, 129, 300, 2048, 2049, 4200])
def test_onednn_matches_f_linear_for_any_row_count(rows: int, bias: bool) -> None:
    # Row counts off the buckets are padded (up to 128 to ROW_BUCKETS, above to multiples of
    # 128), and more than one chunk's worth (2048 rows) is split.
    m = _linear(bias)
    weight = m.weight.detach().clone()
    b = None if m.bias is None else m.bias.detach().clone()
    prepare_linears(m, "onednn")
    assert m.kind == "onednn" and m.weight.numel() == 0
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = m(x)
    assert got.shape == (rows, 64)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@onednn
def test_onednn_bfloat16_is_close() -> None:
    m = _linear(True, torch.bfloat16)
    weight, bias = m.weight.detach().float(), m.bias.detach().float()  # type: ignore[union-attr]
    prepare_linears(m, "onednn")
    x = torch.randn(5, 96).bfloat16()
    with torch.inference_mode():
        got = m(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight, bias), atol=0.3, rtol=0.02)


@pytest.mark.skipif(not has_int8_gemm(), reason="no VNNI int8 dot products on this CPU")
def test_int8_is_close_and_keeps_the_dtype() -> None:
    m = _linear(True)
    weight, bias = m.weight.detach().clone(), m.bias.detach().clone()  # type: ignore[union-attr]
    prepare_linears(m, "int8")
    x = torch.randn(7, 96)
    with torch.inference_mode():
        got = m(x)
    ref = F.linear(x, weight, bias)
    assert got.dtype == torch.float32
    # 8-bit weights and activations: error a few percent of the output's range.
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.05
    assert m(torch.zeros(0, 96)).shape == (0, 64)


def test_dense_is_f_linear_and_keeps_the_weight() -> None:
    m = _linear(True)
    prepare_linears(m, "dense")
    x = torch.randn(4, 96)
    assert m.kind == "dense" and m.weight.shape == (64, 96)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_row_buckets_are_increasing() -> None:
    assert list(ROW_BUCKETS) == sorted(set(ROW_BUCKETS)) and ROW_BUCKETS[0] == 1


def test_padded_rows_bound_the_shapes_onednn_meets() -> None:
    # The fused path allocates activations with this many rows; oneDNN then never pads them.
    assert [padded_rows("onednn", r) for r in (1, 3, 100, 128, 129, 300, 2048)] == [
        1,
        4,
        112,
        128,
        256,
        384,
        2048,
    ]
    assert padded_rows("onednn", 2049) == 2049  # more than a chunk: the linear splits it
    assert padded_rows("dense", 3) == padded_rows("int8", 3) == 3
    shapes = {padded_rows("onednn", r) for r in range(1, 2049)}
    assert len(shapes) == len(ROW_BUCKETS) + 2048 // 128 - 1
