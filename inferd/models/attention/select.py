"""Which attention backend runs: chosen once, at load, by the model runner.

Eager steps (every step that is not a replayed CUDA-graph decode):
1. the native CPU kernel (native.py) wherever the engine loaded the native kernels
   (kernels.select: a CPU, `--attention-backend` auto or cpu_kernel, a kernel build that works
   here, a head size and dtypes it takes); windows and sinks included;
2. else CUDA varlen (varlen.py): on a GPU whose PyTorch runs the varlen call for the model's
   heads and dtype (one tiny call at load), for a model with no sliding-window layer and no sinks
   (the call has neither); half precision gathers whole blocks, float32 key by key;
3. else PyTorch SDPA (sdpa.py): decode length groups and per-chunk spans; windows and sinks
   included.

CUDA-graph decode steps (executor/cuda_graphs.py) take the varlen call over padded spans where the
eager steps take varlen in half precision (only FlashAttention reads padded spans), else SDPA
with one padding mask.
"""

from __future__ import annotations

import torch

from inferd.models.attention.base import AttentionMetadata, MetadataBuilder
from inferd.models.attention.native import NativeBuilder
from inferd.models.attention.sdpa import SdpaBuilder
from inferd.models.attention.varlen import VarlenBuilder, varlen_supported
from inferd.models.config import ArchConfig
from inferd.models.kernels import PagedAttentionKernel

AttentionBuilder = MetadataBuilder[AttentionMetadata]


def select_attention(
    kernel: PagedAttentionKernel | None,
    arch: ArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
) -> AttentionBuilder:
    """The builder of the backend that serves eager steps (the rule above); `kernel`: the native
    attention kernel where the engine loaded the native kernels."""
    if kernel is not None:
        return NativeBuilder(block_size)
    if not (arch.layer_windows or arch.attention_sinks) and varlen_supported(
        device, dtype, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    ):
        return VarlenBuilder(block_size, device, blocks=dtype in (torch.float16, torch.bfloat16))
    return SdpaBuilder(block_size, arch.kv_window, device)


def graph_varlen(builder: AttentionBuilder) -> bool:
    """Whether CUDA-graph decode steps take the varlen call (the rule above)."""
    return isinstance(builder, VarlenBuilder) and builder.blocks
