"""Device and dtype resolution: the one place that decides where tensors live."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform

import torch

from inferd.config import DeviceConfig, DType
from inferd.errors import ModelLoadError

logger = logging.getLogger("inferd.executor")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: DeviceConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device='cuda' was asked for, but no CUDA device is available")
    return torch.device(cfg.device)


def resolve_dtype(
    requested: DType, checkpoint_dtype: str | None, device: torch.device
) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype where the device runs it well.

    CPU: float32 stays float32, half types run as bfloat16 (CPU float16 kernels are slow).
    CUDA: half types stay; a float32 checkpoint runs in bfloat16, as vLLM runs it in half precision.
    """
    if requested != "auto":
        dtype = _DTYPES[requested]
        if dtype == torch.float16 and device.type == "cpu":
            raise ModelLoadError(
                "float16 is supported on CUDA only; use bfloat16 or float32 on CPU"
            )
        return dtype
    ckpt = _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if device.type == "cpu":
        return torch.float32 if ckpt == torch.float32 else torch.bfloat16
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def configure_threads(device: torch.device, num_threads: int | None) -> None:
    if device.type == "cpu" and num_threads is not None:
        torch.set_num_threads(num_threads)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Freed memory at the top of the heap up to this much stays mapped for reuse.
_KEEP_BYTES = 1 << 30


def keep_freed_memory(device: torch.device) -> bool:
    """Stops glibc returning a CPU step's freed activations to the OS; True when it applied.

    A 2,048-token prefill step of the small model allocates 5-23 MiB outputs per linear layer.
    glibc serves blocks that size with mmap or trims them off the heap when freed (its thresholds
    adapt, so it varies run to run), and the next step page-faults all of it back in, zeroed:
    45,000 minor faults in one such step, 0.57-0.61 s against 0.51 s with none (measured, same
    process, docs/benchmarks.md). vLLM's CPU backend avoids the same cost by preloading tcmalloc.
    The Qwen2-0.5B shape's prefill activations are larger than glibc's largest mmap threshold
    (32 MiB: an 80 MiB gate/up output), so they were always mapped per use: 1.43 million faults
    over the 32-request mixed workload; 60,000 with every block served from the heap.
    Serving every block from the heap (M_MMAP_MAX 0) and trimming only past 1 GiB keeps freed
    memory for the next step (the heap then holds the largest step's activations) without a second
    allocator; glibc still falls back to mmap if the heap cannot grow. Other C libraries: no
    change."""
    if device.type != "cpu" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.info("mallopt refused the allocator thresholds; freed memory may be unmapped")
    return ok


def release_freed_memory(device: torch.device) -> None:
    """Hands memory freed during start-up (the dense weights the linear layers' own copies
    replaced, models/linear.py; the greedy screen's build buffers) back to the OS. Under
    keep_freed_memory glibc trims only the top of its heap, so blocks freed below it would stay
    resident: 0.6 GiB of the bfloat16 Qwen2-0.5B shape's start-up (bench/NOTES.md)."""
    if device.type == "cpu" and platform.libc_ver()[0] == "glibc":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
