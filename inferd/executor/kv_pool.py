"""The KV pool: its element type, how many blocks fit the budget, and its zeroed memory."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
import torch
from torch import Tensor

from inferd.config import CacheConfig
from inferd.errors import ModelLoadError
from inferd.models import kv_int8
from inferd.models.config import ArchConfig

_CPU_KV_CACHE_BYTES = 4 << 30


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed KV pool. Zeros, not garbage: masked keys still meet V in the attention matmul, and
    0 * NaN would poison a row.

    On CPU it is an anonymous mapping: zero pages are mapped lazily, so a multi-GiB pool costs
    nothing until blocks are first written, and it asks for transparent huge pages. With 4 KiB
    pages every fourth token's K (and V) row of a small model was a page fault on first write: ~80k
    faults on a 20k-token workload, 0.2-0.4 s of the KV write's time; a 2 MiB page faults once."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = int(np.prod(shape)) * dtype.itemsize
    buf = mmap.mmap(-1, max(size, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: plain pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=size).view(dtype).view(shape)


def kv_cache_dtype(cache: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: `cache.kv_cache_dtype`, or the model dtype for "auto"."""
    if cache.kv_cache_dtype == "auto":
        return dtype
    if cache.kv_cache_dtype in ("fp8", "fp8_e5m2"):
        return torch.float8_e5m2
    kv_dtype: torch.dtype = getattr(torch, cache.kv_cache_dtype)
    return kv_dtype


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers; dtype is the KV cache dtype."""
    row = kv_int8.row_width(arch.head_dim, dtype)
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * row * block_size * dtype.itemsize


def num_kv_blocks(
    arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> int:
    per_block = kv_bytes_per_block(arch, cache.block_size, dtype)
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cpu":
        budget = _CPU_KV_CACHE_BYTES
    else:
        free, total = torch.cuda.mem_get_info(device)
        # Weights are resident already; leave (1 - utilization) of the card plus a margin for
        # activations of the largest step. `used` counts every process and earlier engine on the
        # card, as vLLM's --gpu-memory-utilization does.
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used - (512 << 20)
        if budget < per_block:
            raise ModelLoadError(
                f"no GPU memory left for the KV cache: {used / 2**30:.1f} of {total / 2**30:.1f}"
                f" GiB are in use (weights, other engines or processes) against the "
                f"{cache.gpu_memory_utilization:.0%} that --gpu-memory-utilization allows; raise "
                "it, or set --kv-cache-memory"
            )
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ModelLoadError(
            f"KV cache budget {budget} bytes holds no {cache.block_size}-token block "
            f"({per_block} bytes each); raise --kv-cache-memory"
        )
    return int(num_blocks)
