"""The native kernels built for a CPU class this machine may not be: AVX-512 with VNNI but without
AVX512_BF16 or AMX (Cascade Lake, Ice Lake). The native tier supports it, and what it runs there
(models/linear.py's plan, panel.h's and paged_attention.cpp's tables) is compiled and checked
against PyTorch here.

There, float32 layers run the panel GEMM, bfloat16 ones oneDNN (no panel GEMM in bfloat16), int8
ones the int8 GEMV and fbgemm, and the greedy screen takes float32 lm_heads; the fused ops round
bfloat16 without VCVTNEPS2BF16; attention runs its float32 paths for every dtype (a bfloat16
model's rows widened). Only the files those need are built (gemv.cpp, panel_gemm.cpp, greedy.cpp,
fused_ops.cpp, paged_attention.cpp, and moe_experts.cpp, whose entry FusedOps binds: ~15 s of
CPU, 60-90 s on a shared, loaded 2-core machine), once for the module, into a temporary folder.
Every other source (the one-call decode step) is compiled for the class without code generation,
so a helper left inside a BF16-only block fails here.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from inferd.models import kernels
from inferd.models.kernels import PagedAttentionKernel, PagedBatch
from inferd.models.kernels.fused import FusedOps
from inferd.models.kernels.gemv import Gemv, Int8Weight, PanelWeight
from inferd.models.kernels.greedy import GreedyHead, GreedyScreen
from inferd.models.linear import (
    ANY_ROWS,
    GEMV_MAX_ROWS,
    Linear,
    NativeLinear,
    Route,
    prepare_linears,
    quantize_int8,
)

pytestmark = pytest.mark.unit

# What the class lacks, whatever -march=native found here.
NO_BF16 = ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
SOURCES = (
    "gemv.cpp",
    "panel_gemm.cpp",
    "greedy.cpp",
    "fused_ops.cpp",
    "moe_experts.cpp",
    "paged_attention.cpp",
)


class Library:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.gemv = Gemv(lib)
        self.screen = GreedyScreen(lib)
        self.ops = FusedOps(lib)
        self.attention = PagedAttentionKernel(lib)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Library]:
    cxx = kernels.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    probe = subprocess.run(
        [cxx, *NO_BF16, "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"{cxx} does not take {' '.join(NO_BF16)}")
    out = tmp_path_factory.mktemp("kernels_no_bf16") / "inferd_kernels_no_bf16.so"
    here = Path(kernels.__file__).parent
    try:
        kernels.compile_library(cxx, [here / s for s in SOURCES], out, NO_BF16)
    except kernels.BuildFailed as e:
        if "AVX-512 F/BW/VL/VNNI" in str(e):
            pytest.skip("this machine has no AVX-512 VNNI: the native kernels do not build")
        raise
    yield Library(ctypes.CDLL(str(out)))


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_the_build_has_no_bfloat16_panels_nor_tiles(built: Library) -> None:
    assert built.gemv.panel_rows == {torch.float32: 128, torch.bfloat16: 0}
    assert not built.gemv.amx()
    with pytest.raises(ValueError, match="rows"):
        built.gemv.panel(_rand(1, 64, seed=0, dtype=torch.bfloat16), _panel(64, 64, torch.bfloat16))


def _panel(n: int, k: int, dtype: torch.dtype) -> PanelWeight:
    pw = PanelWeight.of(_rand(n, k, seed=1, dtype=dtype), None)
    assert pw is not None
    return pw


@pytest.mark.parametrize("rows", [1, 7, 33, 128])
@pytest.mark.parametrize(("n", "k"), [(1000, 500), (70, 1408)])
def test_float32_panel_gemm_matches_f_linear(built: Library, rows: int, n: int, k: int) -> None:
    x, w, b = _rand(rows, k, seed=2), _rand(n, k, seed=3), _rand(n, seed=4)
    pw = PanelWeight.of(w, b)
    assert pw is not None
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(built.gemv.panel(x, pw).double(), want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_int8_gemv_matches_f_linear(built: Library, dtype: torch.dtype, rows: int) -> None:
    x, w, b = _rand(rows, 500, seed=5, dtype=dtype), _rand(1027, 500, seed=6), _rand(1027, seed=7)
    got = built.gemv.int8(x, Int8Weight.of(*quantize_int8(w), b))
    assert got.dtype == dtype
    ref = F.linear(x.double(), w.double(), b.double())
    # 8-bit weights and activations: a few percent of the output's range.
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 0.05


def _layer(dtype: torch.dtype) -> tuple[Linear, Tensor, Tensor]:
    m = Linear(96, [("w", 80)], bias=True, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(_rand(80, 96, seed=8))
        assert m.bias is not None
        m.bias.copy_(_rand(80, seed=9))
    return m, m.weight.detach().float().clone(), m.bias.detach().float().clone()


@pytest.mark.parametrize(
    ("dtype", "kind", "plan"),
    [
        (torch.float32, "onednn", (Route(ANY_ROWS, "panel"),)),
        (torch.bfloat16, "onednn", (Route(ANY_ROWS, "onednn"),)),
        (torch.float32, "int8", (Route(GEMV_MAX_ROWS, "gemv_int8"), Route(ANY_ROWS, "int8"))),
    ],
)
def test_the_plan_runs_what_the_class_has(
    built: Library, dtype: torch.dtype, kind: str, plan: tuple[Route, ...]
) -> None:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("PyTorch without oneDNN")
    m, weight, bias = _layer(dtype)
    second = kind == "int8"  # int8 keeps its GEMV copy (linear.native_linear)
    prepare_linears(m, kind, NativeLinear(built.gemv, second_layouts=second))  # type: ignore[arg-type]
    assert m.plan == plan
    rtol, atol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.02, 0.3)}[dtype]
    with torch.inference_mode():
        for rows in (1, 2, 5, 130):
            x = _rand(rows, 96, seed=rows, dtype=dtype)
            got, want = m(x).float(), F.linear(x.float(), weight, bias)
            if kind == "int8":  # 8-bit weights and activations: a few percent of the range
                assert ((got - want).abs().max() / want.abs().max()).item() < 0.05
            else:
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_greedy_screen_takes_float32_lm_heads_only(built: Library) -> None:
    w = _rand(4096, 64, seed=10)
    head = GreedyHead.of(built.screen, built.gemv.panel_rows, PanelWeight.of(w, None))
    assert head is not None
    x = _rand(9, 64, seed=11)
    tokens = head(x)
    assert tokens is not None and tokens.tolist() == F.linear(x, w).argmax(-1).tolist()
    bf16 = PanelWeight.of(w.bfloat16(), None)
    assert GreedyHead.of(built.screen, built.gemv.panel_rows, bf16) is None


@pytest.mark.parametrize("rows", [1, 7])
def test_fused_ops_round_bfloat16_as_torch(built: Library, rows: int) -> None:
    gate_up = _rand(rows, 2 * 344, seed=12, dtype=torch.bfloat16) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.float()) * up.float()
    # One rounding (the kernel rounds SiLU and the product once each; eager after every op).
    torch.testing.assert_close(built.ops.silu_mul(gate_up).float(), want, rtol=2**-7, atol=1e-2)
    x, w = _rand(rows, 512, seed=13, dtype=torch.bfloat16), _rand(512, seed=14).bfloat16()
    xf = x.float()
    norm = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(built.ops.rms_norm(x, w, 1e-6).float(), norm, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(("q_len", "window"), [(1, None), (3, None), (40, None), (40, 17)])
def test_attention_of_a_bfloat16_model_widens_its_rows(
    built: Library, q_len: int, window: int | None
) -> None:
    # A bfloat16 model on a bfloat16 cache: F32Rows for items under 16 rows (decode, a verify
    # step's 3 rows of 4 heads), F32Tiles from 16 (prefill), K/V widened (no VDPBF16PS here).
    hq, hkv, d, bs, ctx = 8, 2, 64, 16, 100
    nb = -(-ctx // bs)
    kv = _rand(2, nb + 2, bs, hkv, d, seed=15, dtype=torch.bfloat16)
    tables = torch.randperm(nb + 2, generator=torch.Generator().manual_seed(16))[:nb]
    batch = PagedBatch(
        tables.to(torch.int32)[None],
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([q_len], dtype=torch.int32),
        torch.tensor([ctx], dtype=torch.int32),
    )
    q = _rand(q_len, hq, d, seed=17, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    built.attention(out, q, kv, batch, d**-0.5, window)
    slots = tables[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
    k, v = (kv[i].flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, 1) for i in (0, 1))
    key = torch.arange(ctx)[None]
    last = (ctx - q_len + torch.arange(q_len))[:, None]  # each query's last visible key
    seen = (key <= last) & ((key > last - window) if window else True)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * d**-0.5
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", weights, v)
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=1e-2)


def test_every_source_compiles_for_the_class() -> None:
    cxx = kernels.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    here = Path(kernels.__file__).parent
    sources = sorted(str(p) for p in here.glob("*.cpp"))
    res = subprocess.run(
        [cxx, *kernels.FLAGS, *NO_BF16, "-fsyntax-only", *sources], capture_output=True, text=True
    )
    if res.returncode != 0 and "AVX-512 F/BW/VL/VNNI" in res.stderr:
        pytest.skip("this machine has no AVX-512 VNNI: the native kernels do not build")
    if res.returncode != 0 and "-mno-" in res.stderr:
        pytest.skip(f"{cxx} does not take {' '.join(NO_BF16)}")
    assert res.returncode == 0, res.stderr[-2000:]
