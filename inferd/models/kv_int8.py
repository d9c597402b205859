"""The int8 KV cache (`--kv-cache-dtype int8`): each head's K or V row is quantized on its own.

A row of `head_dim` values is stored as `head_dim` int8 values followed by the row's float32
scale (its 4 bytes), so the pool is [2, blocks, block_size, Hkv, head_dim + 4] int8 and a row
carries everything needed to read it back. Symmetric, round half to even, no zero point:

    scale = max|x| / 127        q = clamp(round(x / scale), -127, 127)        x' = q * scale

(an all-zero row stores scale 0 and zeros). One scale per head row costs 4 bytes per 64-128
values (llama.cpp's q8_0 cache: 2 bytes per 32). The
native kernels (kernels/simd.h: `quantize_row`, `kv_row_bytes`) compute the same bytes and the
same float32 values as these PyTorch functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The KV pool's last dimension for a cache of `kv_dtype`."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize(x: Tensor) -> Tensor:
    """[..., D] floats (any float dtype) -> [..., D + 4] int8 rows, the scale last."""
    xf = x.float()
    scale = torch.div(xf.abs().amax(-1, keepdim=True), 127.0)
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., D + 4] int8 rows -> [..., D] values in `dtype` (computed in float32)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)
