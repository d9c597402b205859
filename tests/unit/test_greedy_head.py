"""The greedy screen (`kernels/greedy.py`; `inferd_greedy_screen`, `inferd_greedy_head` in
`kernels/greedy.cpp`): its tokens must be the full path's (the panel GEMM over the whole lm_head,
then the native argmax) bit for bit, ties to the first column included, or it must decline."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from inferd.models import kernels
from inferd.models.kernels.gemv import PANEL_COLUMNS, PanelWeight
from inferd.models.kernels.greedy import MIN_COLUMNS, GreedyHead, ScreenWeight

pytestmark = pytest.mark.unit


@pytest.fixture
def native_kernels(native_kernels: kernels.NativeKernels, panel_path: str) -> kernels.NativeKernels:
    """The session's kernels (tests/conftest.py), each test that uses them on both paths where
    the CPU has AMX (panel_path); the pure-Python ones (the screen's layout) run everywhere."""
    return native_kernels


DTYPES = [torch.float32, torch.bfloat16]
ANY_ROWS = {torch.float32: 128, torch.bfloat16: 128}


def _runs(native: kernels.NativeKernels, dtype: torch.dtype) -> None:
    if native.gemv.panel_rows[dtype] == 0:
        pytest.skip("no AVX512_BF16 on this CPU: no bfloat16 panel GEMM")


def _rand(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _head(
    native: kernels.NativeKernels, w: Tensor, plain: bool = False
) -> tuple[GreedyHead, PanelWeight]:
    _runs(native, w.dtype)
    pw = PanelWeight.of(w, None)
    assert pw is not None
    head = GreedyHead.of(
        native.screen,
        native.gemv.panel_rows,
        pw,
        w if plain else None,
        min_columns=0,
        max_rows=ANY_ROWS,
    )
    assert head is not None
    return head, pw


def _full(native: kernels.NativeKernels, x: Tensor, pw: PanelWeight) -> Tensor:
    return native.ops.argmax(native.gemv.panel(x, pw))


def _same(native: kernels.NativeKernels, head: GreedyHead, pw: PanelWeight, x: Tensor) -> Tensor:
    """The screen's tokens for x, which it must give, and which must be the full path's."""
    got = head(x)
    assert got is not None
    assert torch.equal(got, _full(native, x, pw))
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(5000, 256), (1000, 64), (130, 36), (64, 4), (8200, 512)])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 13, 24, 40])
def test_tokens_are_the_full_lm_heads(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype, n: int, k: int, rows: int
) -> None:
    # n off the 64-column panel, k a multiple of 4 but not of 16 or 64, rows in uneven tiles;
    # weights at a trained lm_head's scale, hidden rows of unit RMS.
    head, pw = _head(native_kernels, _rand(n, k, seed=n + k, scale=0.05).to(dtype))
    declined = 0
    for seed in range(8):
        x = _rand(rows, k, seed=seed).to(dtype)
        got = head(x)
        if got is None:  # more candidates than a screen keeps (small n, many rows)
            declined += 1
            continue
        assert torch.equal(got, _full(native_kernels, x, pw)), seed
    # Few rows always fit the screen's candidate budget (a quarter of the columns, 64 at least).
    assert declined == 0 or rows > 7


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_sums_carry_across_blocks(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype
) -> None:
    # 2,304 inputs are 576 steps of 4: a panel takes two 512-step blocks, so the int32 sums are
    # stored and reloaded (as float bit patterns) between them.
    head, pw = _head(native_kernels, _rand(20000, 2304, seed=31, scale=0.03).to(dtype))
    for seed, rows in ((1, 1), (2, 3), (3, 3)):
        _same(native_kernels, head, pw, _rand(rows, 2304, seed=seed).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_column(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype
) -> None:
    # Equal columns give equal logits: the first of them wins.
    w = _rand(3000, 128, seed=1, scale=0.05)
    w[2999] = w[1500] = w[7]
    w[2000] = w[40]
    head, pw = _head(native_kernels, w.to(dtype))
    x = torch.stack([w[7], w[40], -w[7]]).to(dtype) * 40  # rows that pick the duplicated columns
    got = _same(native_kernels, head, pw, x)
    assert got[0].item() == 7 and got[1].item() == 40


def test_bfloat16_rounding_ties_keep_the_first_column(
    native_kernels: kernels.NativeKernels,
) -> None:
    # Exactly quantizable values (x integers over [-128, 127], columns integers times 2^-10), so
    # the screen's bounds are tight: column 20's float32 logit is above column 10's by 0.1, far
    # more than the bounds, but both round to the same bfloat16 logit (its step there is 2), so
    # the full path's argmax is 10. Only the bound's allowance for that rounding keeps 10.
    k, c = 64, 2.0**-10
    g = torch.Generator().manual_seed(21)
    x = torch.randint(-128, 128, (k,), generator=g).float()
    x[0], x[1], x[2], x[3] = 127, -128, 1, 100
    q = torch.randint(-40, 41, (200, k), generator=g).float()
    q[:, 5] = 127  # every column's scale is c
    q[10] = torch.where(x >= 0, 127.0, -127.0)
    q[10, 3] = 0
    q[20] = q[10]
    q[20, 3] = 1
    w = (q * c).to(torch.bfloat16)
    head, pw = _head(native_kernels, w)
    xb = x[None].to(torch.bfloat16)
    logits = native_kernels.gemv.panel(xb, pw)
    assert logits[0, 10] == logits[0, 20] == logits[0].max()
    assert _same(native_kernels, head, pw, xb).tolist() == [10]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["large", "tiny", "one-hot", "outliers", "negative"])
def test_extreme_rows(native_kernels: kernels.NativeKernels, dtype: torch.dtype, kind: str) -> None:
    head, pw = _head(native_kernels, _rand(3000, 128, seed=6, scale=0.05).to(dtype))
    x = {
        "large": _rand(5, 128, seed=7, scale=1e4),
        "tiny": _rand(5, 128, seed=7, scale=1e-20),
        "one-hot": torch.eye(5, 128) * 3,
        "outliers": _rand(6, 128, seed=8) * (_rand(6, 128, seed=9) > 1.6) * 100,
        "negative": -_rand(5, 128, seed=7).abs(),
    }[kind].to(dtype)
    _same(native_kernels, head, pw, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_declines_rows_it_cannot_bound(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype
) -> None:
    head, _ = _head(native_kernels, _rand(1000, 64, seed=1, scale=0.05).to(dtype))
    ok = _rand(2, 64, seed=2)
    for bad in (float("nan"), float("inf")):
        x = ok.clone()
        x[1, 3] = bad
        assert head(x.to(dtype)) is None
    # An all-zero row ties every column: more candidates than a screen keeps.
    assert head(torch.zeros(1, 64, dtype=dtype)) is None
    assert head(_rand(129, 64, seed=3).to(dtype)) is None  # more rows than it takes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(3000, 256), (1000, 36)])
def test_reads_candidates_from_the_plain_weight_the_same(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype, n: int, k: int
) -> None:
    # The candidates' weights are packed from the row-major weight (16 x 16 word transposes; k =
    # 36 leaves a partial block of words) or from the panel copy: the same tokens either way.
    w = _rand(n, k, seed=11, scale=0.05).to(dtype)
    from_panels, pw = _head(native_kernels, w)
    from_plain, _ = _head(native_kernels, w, plain=True)
    x = _rand(20, k, seed=12).to(dtype)
    cols = from_panels.candidates(x)
    assert cols is not None and 0 < len(cols) < n
    assert torch.equal(from_plain(x), from_panels(x))  # type: ignore[arg-type]
    assert torch.equal(from_plain(x), _full(native_kernels, x, pw))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plain", [False, True])
def test_many_candidates_run_in_chunks(
    native_kernels: kernels.NativeKernels, dtype: torch.dtype, plain: bool
) -> None:
    # Columns close together (a shared direction plus a little noise) leave more candidates than
    # the native head packs at once (2,048): later chunks must keep the earlier chunks' winners
    # on ties and take a strictly larger logit.
    g = torch.Generator().manual_seed(16)
    w = torch.randn(1, 64, generator=g) * 0.05 + torch.randn(40000, 64, generator=g) * 0.006
    w = w.to(dtype)
    w[5] *= 3
    w[39000] = w[5]  # the same logit in the first chunk and the last
    head, pw = _head(native_kernels, w, plain)
    x = _rand(16, 64, seed=17).to(dtype)
    cols = head.candidates(x)
    assert cols is not None and len(cols) > 2048
    _same(native_kernels, head, pw, x)
    x[3] = w[5] * 4  # row 3's largest logit is column 5's, and column 39000's
    cols = head.candidates(x)
    assert cols is not None and len(cols) > 2048 and {5, 39000} <= set(cols.tolist())
    got = _same(native_kernels, head, pw, x)
    assert got[3] == 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_screen_weight_layout_and_bounds(dtype: torch.dtype) -> None:
    # q in VNNI panels [n_pad / 64][k / 4][64][4]; the norms at or above the exact ones.
    w = _rand(100, 12, seed=13, scale=0.05).to(dtype)
    pw = PanelWeight.of(w, None)
    assert pw is not None
    s = ScreenWeight.of(pw)
    assert s is not None
    n_pad = 2 * PANEL_COLUMNS
    assert s.q.shape == (2, 3, PANEL_COLUMNS, 4) and s.q.dtype == torch.int8
    q = s.q.transpose(1, 2).reshape(n_pad, 12)
    exact = w.double()
    approx = s.scale[:100, None].double() * q[:100].double()
    # q rounds W / s to nearest (in float32: a value at a half step may go either way)
    assert ((exact - approx).abs() <= s.scale[:100, None].double() * 0.5001).all()
    assert (s.norm_w[:100].double() >= exact.norm(dim=1)).all()
    assert (s.norm_d[:100].double() >= (exact - approx).norm(dim=1)).all()
    assert torch.equal(s.col_sum, q.sum(1, dtype=torch.int32))
    assert not q[100:].any() and not s.scale[100:].any()


def test_builds_only_where_it_runs(native_kernels: kernels.NativeKernels) -> None:
    n = native_kernels
    w = _rand(MIN_COLUMNS, 64, seed=14, scale=0.05)
    pw = PanelWeight.of(w, None)
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, pw) is not None
    small = PanelWeight.of(w[: MIN_COLUMNS - 1], None)
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, small) is None  # the whole lm_head is cheaper
    biased = PanelWeight.of(w, torch.zeros(MIN_COLUMNS))
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, biased) is None
    odd = PanelWeight.of(_rand(MIN_COLUMNS, 66, seed=15), None)
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, odd) is None  # inputs not a multiple of 4
    inf = w.clone()
    inf[5, 5] = float("inf")
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, PanelWeight.of(inf, None)) is None
    assert GreedyHead.of(n.screen, n.gemv.panel_rows, None) is None
