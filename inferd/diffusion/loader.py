"""Loading a diffusers pipeline folder for the image lane: checked, safetensors only, no code.

    folder = resolve_image_model("inferd-tiny-sd", cache_dir)      # or a folder
    parts = load_pipeline(folder, ImageModelSpec(scheduler="EulerDiscreteScheduler"))
    parts.unet, parts.vae, parts.text_encoder, parts.tokenizer, parts.scheduler_template

The folder is diffusers' layout: `model_index.json` names each component's library and class.
Stable Diffusion 1.x/2.x pipelines load: a `UNet2DConditionModel`, an `AutoencoderKL`, a CLIP text
encoder and tokenizer, and one of the schedulers in `SCHEDULERS`. Every named class must be in the
allow-list below (a folder cannot make inferd import or run code of its choosing: no
`trust_remote_code`, no custom pipeline classes), every weight file must be safetensors
(`use_safetensors=True`: a pickle-only folder is refused). A safety checker, feature extractor
or image encoder in the folder is ignored: inferd never runs one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferd.diffusion.request import ImageLimits
from inferd.diffusion.tiny import TINY_SD_NAME, ensure_tiny_sd
from inferd.errors import ModelLoadError

# component -> the (library, class) pairs it may name.
_MODELS: dict[str, frozenset[tuple[str, str]]] = {
    "unet": frozenset({("diffusers", "UNet2DConditionModel")}),
    "vae": frozenset({("diffusers", "AutoencoderKL")}),
    "text_encoder": frozenset({("transformers", "CLIPTextModel")}),
    "tokenizer": frozenset(
        {("transformers", "CLIPTokenizer"), ("transformers", "CLIPTokenizerFast")}
    ),
}
# Schedulers whose per-request instances the engine steps (one model call per step each).
SCHEDULERS = (
    "DDIMScheduler",
    "DDPMScheduler",
    "PNDMScheduler",
    "LMSDiscreteScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler",
)
# Components inferd never loads or runs, whatever they name.
_IGNORED = frozenset({"safety_checker", "feature_extractor", "image_encoder"})
_PIPELINES = frozenset({"StableDiffusionPipeline"})
DEFAULT_GUIDANCE = 7.5  # diffusers' StableDiffusionPipeline default
MAX_N = 10  # OpenAI's images API bound


@dataclass(frozen=True)
class ImageModelSpec:
    """How to load one image model (from ImageEngineConfig)."""

    scheduler: str | None = None  # a class in SCHEDULERS; None: the folder's
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    default_steps: int = 50
    max_steps: int = 150
    max_image_size: int | None = None  # the longest side; None: twice the default size
    max_n: int = MAX_N


@dataclass
class PipelineParts:
    """The loaded components of one pipeline, on their device, in eval mode."""

    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    scheduler_template: Any  # never stepped: each request gets its own from its config
    vae_scale_factor: int
    device: torch.device
    dtype: torch.dtype
    limits: ImageLimits


def is_image_model(name_or_folder: str) -> bool:
    """True for `inferd-tiny-sd` and for a folder that has a `model_index.json`."""
    if name_or_folder == TINY_SD_NAME:
        return True
    return (Path(name_or_folder).expanduser() / "model_index.json").is_file()


def resolve_image_model(name_or_folder: str, cache_dir: Path) -> Path:
    """`inferd-tiny-sd` -> its folder (built on first use); else a diffusers folder."""
    if name_or_folder == TINY_SD_NAME:
        return ensure_tiny_sd(cache_dir)
    folder = Path(name_or_folder).expanduser()
    if not (folder / "model_index.json").is_file():
        raise ModelLoadError(
            f"{name_or_folder!r} is not a diffusers pipeline folder (no model_index.json)"
        )
    return folder


def read_model_index(folder: Path) -> dict[str, tuple[str, str]]:
    """The components `model_index.json` names, checked against the allow-lists."""
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/model_index.json: {e}") from e
    pipeline = index.get("_class_name")
    if pipeline not in _PIPELINES:
        raise ModelLoadError(
            f"{folder}: pipeline class {pipeline!r} is not served (supported: "
            f"{sorted(_PIPELINES)}; SDXL is not supported yet)"
        )
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or name in _IGNORED or not isinstance(value, list):
            continue
        if len(value) != 2 or not all(isinstance(v, str) for v in value):
            raise ModelLoadError(f"{folder}/model_index.json: {name!r} must be [library, class]")
        components[name] = (value[0], value[1])
    _check_allowed(folder, components)
    return components


def _check_allowed(folder: Path, components: dict[str, tuple[str, str]]) -> None:
    for name, pair in components.items():
        if name == "scheduler":
            if pair[0] != "diffusers" or pair[1] not in SCHEDULERS:
                raise ModelLoadError(
                    f"{folder}: scheduler {pair[1]!r} is not supported (one of {list(SCHEDULERS)})"
                )
        elif name not in _MODELS:
            raise ModelLoadError(f"{folder}: component {name!r} is not part of a served pipeline")
        elif pair not in _MODELS[name]:
            raise ModelLoadError(
                f"{folder}: {name} class {pair[0]}.{pair[1]} is not allowed "
                f"(allowed: {sorted(f'{lib}.{cls}' for lib, cls in _MODELS[name])})"
            )
    missing = {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} - components.keys()
    if missing:
        raise ModelLoadError(f"{folder}: model_index.json lacks {sorted(missing)}")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_pipeline(folder: Path, spec: ImageModelSpec) -> PipelineParts:
    """Loads and checks every component; ModelLoadError says what is wrong and where."""
    components = read_model_index(folder)
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    try:
        parts = _load_components(folder, components, spec, device, dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}: {e}") from e
    return parts


def _load_components(
    folder: Path,
    components: dict[str, tuple[str, str]],
    spec: ImageModelSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> PipelineParts:
    import diffusers
    from transformers import CLIPTextModel, CLIPTokenizer

    unet = diffusers.UNet2DConditionModel.from_pretrained(
        folder, subfolder="unet", use_safetensors=True, torch_dtype=dtype
    )
    vae = diffusers.AutoencoderKL.from_pretrained(
        folder, subfolder="vae", use_safetensors=True, torch_dtype=dtype
    )
    text_encoder = CLIPTextModel.from_pretrained(
        folder / "text_encoder", use_safetensors=True, dtype=dtype
    )
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    scheduler_class = spec.scheduler or components["scheduler"][1]
    if scheduler_class not in SCHEDULERS:
        raise ModelLoadError(f"scheduler {scheduler_class!r} is not one of {list(SCHEDULERS)}")
    folder_scheduler = getattr(diffusers, components["scheduler"][1])
    config = folder_scheduler.load_config(folder, subfolder="scheduler")
    template = getattr(diffusers, scheduler_class).from_config(config)
    if unet.config.get("time_cond_proj_dim") is not None or unet.config.get("addition_embed_type"):
        raise ModelLoadError(
            f"{folder}: this UNet needs extra conditioning (SDXL, LCM): unsupported"
        )
    modules: tuple[Any, ...] = (unet, vae, text_encoder)
    for module in modules:
        module.to(device).eval().requires_grad_(False)
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    return PipelineParts(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler_template=template,
        vae_scale_factor=scale,
        device=device,
        dtype=dtype,
        limits=derive_limits(int(unet.config.sample_size) * scale, scale, spec),
    )


def derive_limits(default_size: int, multiple: int, spec: ImageModelSpec) -> ImageLimits:
    """The model's native size by default, up to `max_image_size` (or twice native) a side."""
    max_size = spec.max_image_size or 2 * default_size
    max_size = max(multiple, max_size - max_size % multiple)
    return ImageLimits(
        default_width=default_size,
        default_height=default_size,
        max_width=max_size,
        max_height=max_size,
        size_multiple=multiple,
        default_steps=min(spec.default_steps, spec.max_steps),
        max_steps=spec.max_steps,
        default_guidance_scale=DEFAULT_GUIDANCE,
        max_n=spec.max_n,
    )
