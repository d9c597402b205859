"""Device and dtype resolution: the one place that decides where tensors live."""

from __future__ import annotations

import torch

from inferd.config import DeviceConfig, DType
from inferd.errors import ModelLoadError

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
