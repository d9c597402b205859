"""Linear kernels (inferd/models/linear.py) against F.linear on the same dense weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from inferd.errors import ModelLoadError
from inferd.models import kernels
from inferd.models.kernels.gemv import Gemv, Int8Weight, PanelWeight
from inferd.models.layers import Embedding
from inferd.models.linear import (
    ANY_ROWS,
    BF16_ROW_BUCKETS,
    GEMV_MAX_ROWS,
    ROW_BUCKETS,
    Linear,
    NativeLinear,
    Route,
    has_int8_gemm,
    native_linear,
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
    # Row counts off the buckets are padded (up to 128 to row_buckets(dtype), above to multiples of
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


@pytest.mark.parametrize("buckets", [ROW_BUCKETS, BF16_ROW_BUCKETS])
def test_row_buckets_are_increasing_up_to_128(buckets: tuple[int, ...]) -> None:
    assert list(buckets) == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == 128


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


def test_bfloat16_weights_pad_to_finer_counts_below_64() -> None:
    bf16 = torch.bfloat16
    assert [padded_rows("onednn", r, bf16) for r in (3, 9, 17, 21, 33, 57, 100, 129)] == [
        4,
        12,
        20,
        24,
        40,
        64,
        112,
        256,
    ]
    assert padded_rows("onednn", 17, torch.float32) == 24
    shapes = {padded_rows("onednn", r, bf16) for r in range(1, 2049)}
    assert len(shapes) == len(BF16_ROW_BUCKETS) + 2048 // 128 - 1


@onednn
@pytest.mark.parametrize("rows", [3, 17, 21, 57])
def test_onednn_bfloat16_pads_off_bucket_rows_and_returns_them(rows: int) -> None:
    m = _linear(False, torch.bfloat16)
    weight = m.weight.detach().float()
    prepare_linears(m, "onednn")
    x = torch.randn(rows, 96).bfloat16()
    with torch.inference_mode():
        got = m(x)
        padded = m(F.pad(x, (0, 0, 0, padded_rows("onednn", rows, torch.bfloat16) - rows)))
    assert got.shape == (rows, 64)
    assert torch.equal(got, padded[:rows])
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight), atol=0.3, rtol=0.02)


@pytest.fixture(scope="module")
def gemv(native_kernels: kernels.NativeKernels) -> Gemv:
    return native_kernels.gemv


class _Counting(Gemv):
    """The real kernel, counting its calls."""

    def __init__(self, inner: Gemv) -> None:
        self.__dict__.update(inner.__dict__)
        self.int8_calls = 0
        self.panel_calls = 0

    def int8(self, x: Tensor, w: Int8Weight) -> Tensor:
        self.int8_calls += 1
        return super().int8(x, w)

    def panel(self, x: Tensor, w: PanelWeight, out: Tensor | None = None) -> Tensor:
        self.panel_calls += 1
        return super().panel(x, w, out)


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_run_the_panel_gemm_where_it_runs(gemv: Gemv, dtype: torch.dtype) -> None:
    m = _linear(True, dtype)
    weight, bias = m.weight.detach().clone(), m.bias.detach().clone()  # type: ignore[union-attr]
    counting = _Counting(gemv)
    prepare_linears(m, "onednn", counting)
    # The dense weight is kept for oneDNN where no panel GEMM runs in `dtype`, else freed.
    assert m.kind == "onednn"
    assert torch.equal(m.weight, weight) or (gemv.panel_rows[dtype] and m.weight.numel() == 0)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.3, 0.02)
    most = gemv.panel_rows[dtype]
    with torch.inference_mode():
        for rows in range(0, most + 3):
            x = torch.randn(rows, 96).to(dtype)
            before = counting.panel_calls
            got = m(x)
            assert counting.panel_calls - before == (1 if 0 < rows <= most else 0), rows
            assert m.padded_rows(rows) == rows if rows <= most else m.padded_rows(rows) >= rows
            want = F.linear(x.float(), weight.float(), bias.float())
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def _panel_layer(
    gemv: Gemv, dtype: torch.dtype, second_layouts: bool
) -> tuple[Linear, Tensor, Tensor, _Counting]:
    """A layer on the panel GEMM (skips where the CPU has none in `dtype`), its float weight and
    bias, and the counting kernel it runs."""
    if gemv.panel_rows[dtype] == 0:
        pytest.skip("no AVX512_BF16 on this CPU: no bfloat16 panel GEMM")
    m = _linear(True, dtype)
    weight, bias = m.weight.detach().float(), m.bias.detach().float()  # type: ignore[union-attr]
    counting = _Counting(gemv)
    prepare_linears(m, "onednn", NativeLinear(counting, second_layouts))
    return m, weight, bias, counting


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batches_of_up_to_128_rows_run_the_panel_gemm(gemv: Gemv, dtype: torch.dtype) -> None:
    m, weight, bias, counting = _panel_layer(gemv, dtype, second_layouts=True)
    most = gemv.panel_rows[dtype]
    assert m.weight.numel() == 0, "the panel copy takes the few rows too: the plain one is freed"
    assert m.gemv_weight() is not None and m.gemv_weight().shape == (64, 96)  # type: ignore[union-attr]
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.3, 0.02)
    with torch.inference_mode():
        for rows in (1, 2, 16, 17, 33, 100, most, most + 1, 200):
            x = torch.randn(rows, 96).to(dtype)
            before = counting.panel_calls + counting.int8_calls
            got = m(x)
            # Every row count it takes (no other native kernel), and nothing past it.
            assert counting.panel_calls - before == int(rows <= most), rows
            assert counting.int8_calls + counting.panel_calls - before == int(rows <= most), rows
            # Rows the panel takes are not padded; past it, oneDNN's row counts again.
            assert (m.padded_rows(rows) == rows) == (rows <= most)
            torch.testing.assert_close(
                got.float(), F.linear(x.float(), weight, bias), atol=atol, rtol=rtol
            )
    # A bare Gemv keeps the second layout (--native-linear on): oneDNN's, past the panel's rows.
    assert m.plan == (Route(most, "panel"), Route(ANY_ROWS, "onednn"))


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_held_once_in_panels_takes_every_row_count(
    gemv: Gemv, dtype: torch.dtype
) -> None:
    m, weight, bias, counting = _panel_layer(gemv, dtype, second_layouts=False)
    most = gemv.panel_rows[dtype]
    assert m.plan == (Route(ANY_ROWS, "panel"),) and "onednn" not in m._run
    assert m.weight.numel() == 0
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.3, 0.02)
    with torch.inference_mode():
        for rows in (0, 1, most, most + 1, 2 * most + 3):
            x = torch.randn(rows, 96).to(dtype)
            before = counting.panel_calls
            got = m(x)
            assert counting.panel_calls - before == -(-rows // most), rows  # 128 rows a call
            assert got.shape == (rows, 64) and m.padded_rows(rows) == rows
            want = F.linear(x.float(), weight, bias)
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embeddings_read_the_lm_heads_panel_copy(gemv: Gemv, dtype: torch.dtype) -> None:
    if not gemv.panel_rows[dtype]:
        pytest.skip("no panel GEMM in this dtype here")
    head = _linear(False, dtype)
    model = torch.nn.Module()
    model.head = head
    model.embed = Embedding(64, 96, dtype)
    model.embed.weight = head.weight  # tied, as an lm_head and its embeddings
    dense = head.weight.detach().clone()
    prepare_linears(model, "onednn", NativeLinear(gemv, second_layouts=False))
    assert head.weight.numel() == 0 and model.embed.weight.numel() == 0, "one copy: the panels"
    ids = torch.tensor([[0, 5, 63], [1, 40, 2]])
    assert torch.equal(model.embed(ids), F.embedding(ids, dense))


@onednn
def test_a_shared_weight_stays_beside_its_panel_copy(gemv: Gemv) -> None:
    if not gemv.panel_rows[torch.float32]:
        pytest.skip("no float32 panel GEMM here")
    head = _linear(False)
    model = torch.nn.Module()
    model.head = head
    model.embed = torch.nn.Embedding(64, 96)
    model.embed.weight = head.weight  # tied, as an lm_head and its embeddings
    prepare_linears(model, "onednn", gemv)
    assert head.panel_copy() is not None and head.weight.shape == (64, 96), "the embedding reads it"


@pytest.mark.skipif(not has_int8_gemm(), reason="no VNNI int8 dot products on this CPU")
def test_int8_few_rows_run_the_gemv_on_an_int8_copy(gemv: Gemv) -> None:
    m = _linear(True)
    weight, bias = m.weight.detach().clone(), m.bias.detach().clone()  # type: ignore[union-attr]
    batched = _linear(True)  # the same seed: the same weights
    counting = _Counting(gemv)
    prepare_linears(m, "int8", counting)
    prepare_linears(batched, "int8")
    assert m.weight.numel() == 0, "the float weight is freed; the GEMV reads int8"
    with torch.inference_mode():
        for rows in range(0, 6):
            x = torch.randn(rows, 96)
            before = counting.int8_calls
            got = m(x)
            assert counting.int8_calls - before == (1 if 0 < rows <= GEMV_MAX_ROWS else 0), rows
            if rows == 0:
                continue
            # Both quantize the weight alike and x from its own range (the GEMV per row,
            # fbgemm over the batch): close to each other and to the float layer.
            ref = F.linear(x, weight, bias)
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.05
            assert ((got - batched(x)).abs().max() / ref.abs().max()).item() < 0.05


def test_the_plan_by_kind(gemv: Gemv) -> None:
    prepare_linears(m := _linear(False), "dense", gemv)
    assert m.plan == (Route(ANY_ROWS, "dense"),), "only the packed kinds take native kernels"
    assert m.gemv_weight() is None and m.weight.shape == (64, 96)
    if has_int8_gemm():
        prepare_linears(m := _linear(False), "int8", NativeLinear(gemv, second_layouts=False))
        assert m.plan == (Route(ANY_ROWS, "int8"),) and m.gemv_weight() is None
        prepare_linears(m := _linear(False), "int8", gemv)
        assert m.plan == (Route(GEMV_MAX_ROWS, "gemv_int8"), Route(ANY_ROWS, "int8"))


def test_native_linear_policy(gemv: Gemv) -> None:
    from inferd.models import linear

    m = torch.nn.ModuleList([_linear(False), _linear(True)])
    weights = 2 * 64 * 96 * 4
    assert linear.weight_bytes(m, "onednn") == weights + 64 * 4  # the bias too
    assert linear.weight_bytes(m, "int8") == 2 * 64 * 96 + 64 * 4  # a byte per linear weight
    assert native_linear("off", "onednn", gemv, m) is None
    assert native_linear("auto", "dense", gemv, m) is None
    assert native_linear("auto", "onednn", None, m) is None  # no native kernels: quietly off
    with pytest.raises(ModelLoadError, match="native"):
        native_linear("on", "onednn", None, m)
    on = native_linear("on", "onednn", gemv, m)
    assert on is not None and on.gemv is gemv and on.second_layouts
    # auto: second layouts only within a quarter of the weights' bytes (oneDNN's copy beside
    # the panels is all of them again), but int8's GEMV copy always (the decode step's).
    auto = native_linear("auto", "onednn", gemv, m)
    assert auto is not None and auto.gemv is gemv
    if gemv.panel_rows[torch.float32]:
        assert not auto.second_layouts
        assert linear.second_layout_bytes(m, "onednn", "dense", auto) == weights
    auto8 = native_linear("auto", "int8", gemv, m)
    assert auto8 is not None and auto8.second_layouts
    assert native_linear("off", "int8", gemv, m) is None


def test_the_old_flag_and_field_name_still_work() -> None:
    import argparse

    from inferd.config import EngineConfig
    from inferd.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--small-batch-gemv", "off"]).native_linear == "off"
    assert p.parse_args(["--native-linear", "on"]).native_linear == "on"
    config = EngineConfig.from_kwargs(small_batch_gemv="off")
    assert config.device.native_linear == "off"
