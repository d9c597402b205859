"""The native LoRA kernel (`kernels/lora.cpp`) against the PyTorch path of lora/layer.py, on the
same packed factors and segments.

float32 agrees to float32 rounding (only the order of the sums differs); bfloat16 to one or two
roundings of the output (both round x At to bfloat16, then y once). Shapes cover partial column
blocks (37, 100 columns), ranks under one vector (4), shards whose columns start mid-block, rows
in blocks of 1-4, an adapter whose rows come in two runs, and a slot with no factors here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from inferd.lora.adapter import LinearFactors
from inferd.lora.layer import LoRABatch, LoRALayer, Rows
from inferd.models import kernels
from inferd.models.kernels.lora import SgmvStep

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
# (in, out, the shards' column spans)
SHAPES = [
    (64, 128, [(0, 64), (64, 96), (96, 128)]),
    (512, 2816, [(0, 1408), (1408, 2816)]),
    (100, 37, [(0, 37)]),
    (48, 200, [(0, 70), (70, 200)]),
]
# slot -> its runs of rows [lo, hi) in a 23-row batch; slot 3 has no factors for the layer
SEGMENTS = {0: [(0, 5), (12, 15)], 1: [(5, 6)], 2: [(15, 23)], 3: [(6, 12)]}
RANKS = [4, 8, 16]


def _factors(
    n_in: int, shards: list[tuple[int, int]], rank: int, dtype: torch.dtype, gen: torch.Generator
) -> LinearFactors:
    out = shards[-1][1]
    w = rank * len(shards)
    bt = torch.zeros(w, out)
    spans = torch.zeros(w, 2, dtype=torch.int32)
    for i, (lo, hi) in enumerate(shards):
        bt[i * rank : (i + 1) * rank, lo:hi] = torch.randn(rank, hi - lo, generator=gen)
        spans[i * rank : (i + 1) * rank] = torch.tensor([lo, hi], dtype=torch.int32)
    at = torch.randn(n_in, w, generator=gen).to(dtype).contiguous()
    return LinearFactors(at, bt.to(dtype), spans)


def _rows(spans: list[tuple[int, int]]) -> Rows:
    return slice(*spans[0]) if len(spans) == 1 else torch.cat([torch.arange(*s) for s in spans])


def _native_step(max_width: int) -> SgmvStep:
    index = [np.concatenate([np.arange(*s) for s in spans]) for spans in SEGMENTS.values()]
    return SgmvStep(
        seg_slot=np.array(list(SEGMENTS), dtype=np.int32),
        seg_off=np.cumsum([0, *(len(i) for i in index)]).astype(np.int64),
        rows=np.concatenate(index).astype(np.int64),
        scratch=torch.empty(23, max_width),
    )


def _apply(layer_batch: tuple[LoRALayer, LoRABatch], x: Tensor, y: Tensor) -> Tensor:
    layer, _ = layer_batch
    out = y.clone()
    layer.add_to(x, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_in", "n_out", "shards"), SHAPES)
def test_matches_the_pytorch_path(
    native_kernels: kernels.NativeKernels,
    dtype: torch.dtype,
    n_in: int,
    n_out: int,
    shards: list[tuple[int, int]],
) -> None:
    gen = torch.Generator().manual_seed(n_in * n_out)
    layers = []
    for kernel in (None, native_kernels.sgmv):
        batch = LoRABatch(segments=[(s, _rows(spans)) for s, spans in SEGMENTS.items()])
        layer = LoRALayer(batch, len(SEGMENTS), CPU, kernel)
        layers.append((layer, batch))
    for slot, rank in enumerate(RANKS):
        factors = _factors(n_in, shards, rank, dtype, gen)
        for layer, _ in layers:
            layer.load(slot, factors)
    # The native layer's batch has every segment on the kernel, none on the PyTorch path.
    layers[1][1].segments = []
    layers[1][1].native = _native_step(max(RANKS) * len(shards))
    x = torch.randn(23, n_in, generator=gen).to(dtype)
    y = torch.randn(23, n_out, generator=gen).to(dtype)
    ref, got = _apply(layers[0], x, y), _apply(layers[1], x, y)
    # Rows of slot 3 (no factors) are untouched by both.
    assert torch.equal(got[6:12], y[6:12]) and torch.equal(ref[6:12], y[6:12])
    assert not torch.equal(got, y)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)
    else:
        # Two bfloat16 roundings apart at most (x At rounded, then y).
        scale = ref.float().abs().clamp_min(1.0)
        assert ((got.float() - ref.float()).abs() / scale).max() <= 2**-6
