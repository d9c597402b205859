"""Random-weight LoRA styles for an image model's UNet, for tests, benchmarks and demos (no hub).

    write_random_style(model_dir, out_dir, rank=4, seed=1)   # or a UNet module for model_dir

writes `out_dir/pytorch_lora_weights.safetensors` through diffusers' own
`StableDiffusionPipeline.save_lora_weights`, as its training scripts do (PEFT's `lora_A` /
`lora_B` key names under `unet.`, no LoraConfig metadata: scale 1), so diffusers'
`load_lora_weights(out_dir)` reads the folder too (the tests compare against it). Both factors
are random (a freshly trained LoRA's B is zero, a style that changes nothing), scaled so each
targeted layer's output moves by about `strength` times its input's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from torch import nn

# Attention projections and feed-forward layers: what LoRA style trainers target.
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")


def write_random_style(
    model: Path | nn.Module,
    out_dir: Path,
    *,
    rank: int = 4,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    strength: float = 0.3,
) -> Path:
    """A seeded random style for `model` (a diffusers folder, whose UNet's layers are read from
    its config, or the UNet itself); returns `out_dir`. `targets`: module-name endings (every
    `nn.Linear` whose name ends with one)."""
    unet = model if isinstance(model, nn.Module) else _layers_of(model)
    g = torch.Generator().manual_seed(seed)
    layers: dict[str, torch.Tensor] = {}
    for name, module in unet.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(tuple(targets)):
            n_in, n_out = module.in_features, module.out_features
            layers[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            b = torch.randn(n_out, rank, generator=g) * (strength / rank**0.5)
            layers[f"{name}.lora_B.weight"] = b
    if not layers:
        raise ValueError(f"no linear layer of the UNet ends with any of {targets}")
    out_dir.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(str(out_dir), unet_lora_layers=layers)
    return out_dir


def _layers_of(model_dir: Path) -> nn.Module:
    """The folder's UNet on the meta device: its layers' names and shapes, no weights."""
    config = UNet2DConditionModel.load_config(str(model_dir / "unet"))
    with torch.device("meta"):
        unet: nn.Module = UNet2DConditionModel.from_config(config)
    return unet
