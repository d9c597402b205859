"""The native fused elementwise kernels against the eager PyTorch ops they replace.

float32 must agree to float32 rounding (the kernels change only the order of a row's sum);
bfloat16 to one bfloat16 rounding step (they round once where eager rounds after every op).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from inferd.models import kernels, kv_int8
from inferd.models.kernels.fused import FusedOps
from inferd.models.rope import apply_rotary

pytestmark = pytest.mark.unit

# (rtol, atol) per dtype: float32 differs only by summation order; bfloat16 by a rounding step
# (2^-8 relative) of the values and of the intermediate the eager path rounded.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops(native_kernels: kernels.NativeKernels) -> FusedOps:
    return native_kernels.ops


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _eager_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    # The model's RMSNorm: float32 in one op; bfloat16 normalised in float32, scaled after the cast.
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _close(got: Tensor, want: Tensor) -> None:
    rtol, atol = TOL[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 512), (7, 896), (33, 100), (300, 64)])
def test_rms_norm(ops: FusedOps, dtype: torch.dtype, rows: int, dim: int) -> None:
    x, w = _rand(rows, dim, dtype=dtype), _rand(dim, dtype=dtype, seed=1)
    _close(ops.rms_norm(x, w, 1e-6), _eager_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual(ops: FusedOps, dtype: torch.dtype) -> None:
    x, res = _rand(9, 512, dtype=dtype), _rand(9, 512, dtype=dtype, seed=2)
    w = _rand(512, dtype=dtype, seed=1)
    want_res = x + res
    out = ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, want_res), "residual <- x + residual, rounded as eager rounds"
    _close(out, _eager_norm(want_res, w, 1e-5))


def test_rms_norm_reads_row_strided_views_and_pads_rows(ops: FusedOps) -> None:
    base = _rand(5, 1024, dtype=torch.float32)
    x = base[:, :512]  # stride 1024: a column slice, as of a fused projection's output
    w = _rand(512, dtype=torch.float32, seed=1)
    out = ops.rms_norm(x, w, 1e-6, out_rows=8)
    assert out.shape == (8, 512)
    _close(out[:5], _eager_norm(x.contiguous(), w, 1e-6))
    assert not out[5:].any(), "padded rows are zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1408), (17, 4864), (64, 40)])
def test_silu_mul(ops: FusedOps, dtype: torch.dtype, rows: int, inter: int) -> None:
    gate_up = _rand(rows, 2 * inter, dtype=dtype) * 4  # reach SiLU's tails too
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up)
    padded = ops.silu_mul(gate_up, out_rows=rows + 3)
    assert padded.shape == (rows + 3, inter) and not padded[rows:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 151936), (3, 1000), (24, 8192), (5, 17), (0, 64)])
def test_argmax_matches_torch(ops: FusedOps, dtype: torch.dtype, rows: int, vocab: int) -> None:
    x = _rand(rows, vocab, dtype=dtype)
    assert ops.argmax(x).tolist() == x.float().argmax(-1).tolist()


def test_argmax_ties_nan_infinities_and_strided_rows(ops: FusedOps) -> None:
    # bfloat16 rounding makes ties common: the first index wins, as in torch.argmax, also when
    # the tie is across the parts a single row is cut into for the threads.
    x = torch.zeros(6, 1000, dtype=torch.bfloat16)
    x[0, 3] = x[0, 700] = 2.0
    x[1, 999] = 1.0
    x[2] = float("-inf")
    x[3, 10], x[3, 600] = float("inf"), float("nan")
    x[4] = -5.0
    x[4, 500] = x[4, 501] = -1.0  # all negative: a tie past the middle
    x[5, 16] = x[5, 15] = 3.0
    want = x.float().argmax(-1).tolist()
    assert want == [3, 999, 0, 600, 500, 15]
    assert ops.argmax(x).tolist() == want
    assert ops.argmax(x[:1]).tolist() == [3]  # one row: cut in two parts for the two threads
    wide = _rand(4, 2000, dtype=torch.float32)
    view = wide[:, :1500]  # rows 2000 apart
    assert ops.argmax(view).tolist() == view.argmax(-1).tolist()


def _rope_tables(positions: int, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,qk_norm", [(8, 4, 64, False), (14, 2, 64, False), (4, 2, 16, True)]
)
def test_rope_qkv_writes_rotated_q_and_the_kv_cache(
    ops: FusedOps,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    qk_norm: bool,
) -> None:
    t, num_slots = 37, 64
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    positions = torch.randint(0, 100, (t,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(4))[:t]
    cos, sin = _rope_tables(128, d, dtype)
    qn = _rand(d, dtype=dtype, seed=5) if qk_norm else None
    kn = _rand(d, dtype=dtype, seed=6) if qk_norm else None
    # Two blocks' worth of leading dims, as the runner's [2, NB, bs, Hkv, D] pool has.
    cache = torch.zeros(2, num_slots // 16, 16, hkv, d, dtype=kv_dtype)

    q = ops.rope_qkv(qkv, hq, hkv, positions, cos, sin, cache, slots, qn, kn, 1e-6)

    wq, wk, wv = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
    wq, wk, wv = wq.reshape(t, hq, d), wk.reshape(t, hkv, d), wv.reshape(t, hkv, d)
    if qn is not None and kn is not None:
        wq, wk = _eager_norm(wq, qn, 1e-6), _eager_norm(wk, kn, 1e-6)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    _close(q, apply_rotary(wq, c, s))
    flat = cache.view(2, num_slots, hkv, d)
    _close(flat[0, slots].to(dtype), apply_rotary(wk, c, s).to(kv_dtype).to(dtype))
    _close(flat[1, slots], wv.to(kv_dtype))
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any(), "only the given slots are written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_rounds_a_float8_cache_as_torch_does(ops: FusedOps, dtype: torch.dtype) -> None:
    # --kv-cache-dtype fp8: V is stored as float8_e5m2 bit for bit as torch's .to() rounds
    # (nearest even, ties, subnormals, the largest finite value, overflow to inf, NaN), and K,
    # rotated in float32 first, within one float8 step of the eager path.
    t, hq, hkv, d = 6, 2, 2, 32
    special = [0.0, -0.0, 1.125, 1.375, -2.5, 3e-5, 1e-7, 6e-5, 57344.0, 60000.0, 7e4, 1e9]
    special += [float("nan"), float("inf"), -float("inf"), 0.1]
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    v = qkv[:, (hq + hkv) * d :]
    v[0, : len(special)] = torch.tensor(special).to(dtype)
    positions, slots = torch.arange(t), torch.arange(t) * 3
    cos, sin = _rope_tables(32, d, dtype)
    cache = torch.zeros(2, 2, 16, hkv, d, dtype=torch.float8_e5m2)
    ops.rope_qkv(qkv, hq, hkv, positions, cos, sin, cache, slots, None, None, 1e-6)
    flat = cache.view(2, 32, hkv, d)
    want_v = v.reshape(t, hkv, d).to(torch.float8_e5m2)
    assert torch.equal(flat[1, slots].view(torch.uint8), want_v.view(torch.uint8))
    wk = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_k = apply_rotary(wk, c, s).float()
    torch.testing.assert_close(flat[0, slots].float(), want_k, rtol=0.25, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_quantizes_an_int8_cache_as_the_pytorch_path_does(
    ops: FusedOps, dtype: torch.dtype
) -> None:
    # --kv-cache-dtype int8: each head's V row is kv_int8.quantize's bytes exactly (scale last),
    # an all-zero row included; K, rotated in float32 and rounded to the model dtype, is within
    # one quantization step of quantizing the eager rotation.
    t, hq, hkv, d = 5, 2, 3, 32
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    qkv[1, (hq + hkv) * d : (hq + hkv + 1) * d] = 0
    positions, slots = torch.arange(t), torch.arange(t) * 5
    cos, sin = _rope_tables(32, d, dtype)
    cache = torch.zeros(2, 2, 16, hkv, d + 4, dtype=torch.int8)
    ops.rope_qkv(qkv, hq, hkv, positions, cos, sin, cache, slots, None, None, 1e-6)
    flat = cache.view(2, 32, hkv, d + 4)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
    assert torch.equal(flat[1, slots], kv_int8.quantize(v))
    wk = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_k = apply_rotary(wk.float(), c.float(), s.float())
    got_k = kv_int8.dequantize(flat[0, slots], torch.float32)
    step = want_k.abs().amax(-1, keepdim=True) / 127
    assert ((got_k - want_k).abs() <= step * 0.5 + 2e-2 * want_k.abs()).all()
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any(), "only the given slots are written"


def test_rope_qkv_refuses_out_of_range_positions_and_slots(ops: FusedOps) -> None:
    qkv = _rand(2, 4 * 16, dtype=torch.float32)
    cos, sin = _rope_tables(8, 16, torch.float32)
    cache = torch.zeros(2, 1, 4, 1, 16)
    ok = torch.tensor([0, 1])
    with pytest.raises(IndexError):
        ops.rope_qkv(qkv, 2, 1, torch.tensor([0, 8]), cos, sin, cache, ok)
    with pytest.raises(IndexError):
        ops.rope_qkv(qkv, 2, 1, ok, cos, sin, cache, torch.tensor([0, 4]))
