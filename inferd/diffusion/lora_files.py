"""A UNet LoRA style's file, read the way diffusers' `load_lora_weights` reads it, and packed for
the batched LoRA layer (inferd/lora/adapter.py's `pack_adapter`).

Accepted (safetensors only, no pickle):
- a folder holding `pytorch_lora_weights.safetensors`, as `save_lora_weights` writes it: keys
  `unet.<module>.lora.down.weight` / `lora.up.weight` (or PEFT's `lora_A` / `lora_B`), with the
  LoraConfig (`lora_alpha`, `rank_pattern`, `alpha_pattern`, `use_rslora`) in the file's
  `lora_adapter_metadata` when the trainer saved it; without it diffusers' own derivation holds
  (scale 1, or kohya's `.alpha` tensors);
- a folder holding exactly one `.safetensors` file, or the path of one: kohya / A1111 naming
  (`lora_unet_..._lora_down.weight`, `.lora_up.weight`, `.alpha`), converted by diffusers' own
  converter (`lora_state_dict`).

Module names are the UNet's own (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`),
each one target of inferd/diffusion/lora.py: a linear layer, or a 1x1 convolution (SD 1.x's
`proj_in` / `proj_out`), whose conv-shaped factors [r, in, 1, 1] are a linear layer's [r, in].

Refused with the reason (InvalidRequestError, a 400): no safetensors file (or a `.bin` only),
text-encoder layers, DoRA, trained LoRA biases, LoKr / LoHa and other non-LoRA tensors,
convolution LoRA with a kernel over 1x1 (LoCon), ranks over `--max-lora-rank`, and modules the
UNet lacks or factors shaped for another UNet (adapter.py's checks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
from diffusers.utils.peft_utils import get_peft_kwargs
from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
from safetensors import SafetensorError, safe_open
from torch import Tensor

from inferd.lora.adapter import LoRAAdapter, ShardTarget, check_config, pack_adapter, refuse
from inferd.lora.request import LoRARequest

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_UNET = "unet."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
# Tensors of adapters that are not plain LoRA; diffusers drops some of them with a warning.
_NOT_LORA = ("dora_scale", "lora_magnitude_vector", "lokr_", "hada_", "lora_mid")


def read_unet_lora(
    request: LoRARequest,
    targets: dict[str, ShardTarget],
    max_rank: int,
    dtype: torch.dtype,
    unet_config: Mapping[str, Any] | None = None,
) -> LoRAAdapter:
    """Reads, checks and packs the style `request.lora_path` for the UNet layers `targets`.
    `unet_config`: the UNet's diffusers config, which maps SGM block names (`input_blocks`) of
    kohya files to diffusers' ones, as `load_lora_weights` does."""
    name = request.lora_name
    path = weights_file(Path(request.lora_path).expanduser(), name)
    tensors, metadata = _read(path, name)
    # kohya / A1111 keys -> diffusers' (and their `.alpha`s -> network alphas), as diffusers does.
    state_dict, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(
        tensors, unet_config=unet_config
    )
    # diffusers' names (`lora.down`) -> PEFT's (`lora_A`); PEFT's are left as they are.
    unet = convert_unet_state_dict_to_peft(_unet_part(state_dict, name))
    config = _config(unet, alphas, metadata)
    check_config(config, name, path.name)
    pairs = _pairs(unet, name)
    return pack_adapter(request, config, pairs, targets, max_rank, dtype)


def weights_file(path: Path, name: str) -> Path:
    """The style's safetensors file: `path` itself, its `pytorch_lora_weights.safetensors`, or
    its only `.safetensors` file."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise refuse(name, f"{path.name} is not a .safetensors file (safetensors only)")
        return path
    if not path.is_dir():
        raise refuse(name, f"{path} is neither a folder nor a file")
    if (path / WEIGHT_NAME).is_file():
        return path / WEIGHT_NAME
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(f.name for f in found)
        raise refuse(name, f"{path} holds several .safetensors files ({names}): name one")
    pickles = [f.name for f in path.iterdir() if f.suffix in (".bin", ".pt", ".ckpt")]
    seen = f" (found {', '.join(pickles)}; safetensors only)" if pickles else ""
    raise refuse(name, f"{path} has no {WEIGHT_NAME} or other .safetensors file{seen}")


def _read(path: Path, name: str) -> tuple[dict[str, Tensor], dict[str, object] | None]:
    """The file's tensors and its LoRA metadata (the LoraConfig's fields, prefixed `unet.`)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a mapping)
            header = f.metadata() or {}
    except (OSError, RuntimeError, SafetensorError) as e:
        raise refuse(name, f"{path.name} could not be read ({e})") from e
    if not tensors:
        raise refuse(name, f"{path.name} holds no tensors")
    for key in tensors:
        if any(marker in key for marker in _NOT_LORA):
            raise refuse(name, f"{key!r}: only plain LoRA is supported (not DoRA, LoKr, LoHa)")
    raw = header.get(LORA_ADAPTER_METADATA_KEY)
    try:
        metadata = json.loads(raw) if raw else None
    except ValueError as e:
        raise refuse(name, f"{LORA_ADAPTER_METADATA_KEY} is not valid JSON ({e})") from e
    if metadata is not None and not isinstance(metadata, dict):
        raise refuse(name, f"{LORA_ADAPTER_METADATA_KEY} is not a JSON object")
    return tensors, metadata


def _unet_part(state_dict: dict[str, Tensor], name: str) -> dict[str, Tensor]:
    """The UNet's tensors, `unet.` stripped; any other part (a text encoder's) is refused."""
    others = sorted({key.split(".", 1)[0] for key in state_dict if not key.startswith(_UNET)})
    if others:
        raise refuse(
            name,
            f"holds layers for {', '.join(others)}: only the UNet's are supported (the text "
            "encoder runs once per request, outside the batched UNet)",
        )
    return {key.removeprefix(_UNET): value for key, value in state_dict.items()}


def _config(
    unet: dict[str, Tensor],
    alphas: dict[str, float] | None,
    metadata: dict[str, object] | None,
) -> dict[str, object]:
    """The LoraConfig's fields diffusers would build: the saved metadata, else derived from the
    ranks and kohya's alphas (diffusers' `get_peft_kwargs`)."""
    if metadata is not None:
        return {k.removeprefix(_UNET): v for k, v in metadata.items() if k.startswith(_UNET)}
    ranks = {f"^{k}": int(v.shape[1]) for k, v in unet.items() if "lora_B" in k and v.ndim > 1}
    own = {k.removeprefix(_UNET): v for k, v in (alphas or {}).items() if k.startswith(_UNET)}
    # Attention alphas come out of diffusers' kohya converter under the old processor names
    # (`attn1.processor.to_v_lora.down.weight.alpha`), which match no module: diffusers then
    # drops them with a warning when they differ from the most common alpha. Renamed like the
    # factors, each module keeps its own alpha, as kohya defines it.
    own = convert_unet_state_dict_to_peft(own)
    kwargs: dict[str, object] = get_peft_kwargs(ranks, own or None, unet, is_unet=True)
    return kwargs


def _pairs(unet: dict[str, Tensor], name: str) -> dict[str, dict[str, Tensor]]:
    """{module: {"A": [r, in], "B": [out, r]}}; 1x1 convolution factors as linear ones."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in unet.items():
        match = _KEY.match(key)
        if match is None:
            raise refuse(name, f"unexpected tensor unet.{key} (only LoRA down/up factors)")
        pairs.setdefault(match["module"], {})[match["factor"]] = _as_linear(value, key, name)
    if not pairs:
        raise refuse(name, "holds no UNet LoRA factors")
    return pairs


def _as_linear(factor: Tensor, key: str, name: str) -> Tensor:
    if factor.dim() != 4:
        return factor
    kernel = tuple(factor.shape[2:])
    if kernel != (1, 1):
        raise refuse(
            name,
            f"unet.{key} is a {kernel[0]}x{kernel[1]} convolution LoRA (LoCon): only linear "
            "and 1x1 convolution layers are supported",
        )
    return factor[:, :, 0, 0]
