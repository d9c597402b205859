"""Loading a diffusers pipeline folder for the image lane: checked, safetensors only, no code.

    folder = resolve_image_model("inferd-tiny-sd", cache_dir)      # or a folder
    parts = load_pipeline(folder, ImageModelSpec(scheduler="EulerDiscreteScheduler"))
    parts.unet, parts.vae, parts.text_encoder, parts.tokenizer, parts.scheduler_template

The folder is diffusers' layout: `model_index.json` names each component's library and class.
Stable Diffusion 1.x/2.x pipelines load (a `UNet2DConditionModel`, an `AutoencoderKL`, a CLIP text
encoder and tokenizer, and one of the schedulers in `SCHEDULERS`), and SDXL's
(`StableDiffusionXLPipeline`: a second tokenizer and a `CLIPTextModelWithProjection` whose pooled
output and the image's size condition the UNet). Every named class must be in the
allow-list below (a folder cannot make inferd import or run code of its choosing: no
`trust_remote_code`, no custom pipeline classes), every weight file must be safetensors
(`use_safetensors=True`: a pickle-only folder is refused). A safety checker, feature extractor
or image encoder in the folder is ignored: inferd never runs one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from inferd.config import ImageScheduler
from inferd.diffusion.request import ImageLimits
from inferd.diffusion.tiny import BUILT_IN, ensure_tiny_sd
from inferd.diffusion.validate import MAX_N
from inferd.errors import ModelLoadError

# component -> the (library, class) pairs it may name.
_MODELS: dict[str, frozenset[tuple[str, str]]] = {
    "unet": frozenset({("diffusers", "UNet2DConditionModel")}),
    "vae": frozenset({("diffusers", "AutoencoderKL")}),
    "text_encoder": frozenset({("transformers", "CLIPTextModel")}),
    "tokenizer": frozenset(
        {("transformers", "CLIPTokenizer"), ("transformers", "CLIPTokenizerFast")}
    ),
    "text_encoder_2": frozenset({("transformers", "CLIPTextModelWithProjection")}),
    "tokenizer_2": frozenset(
        {("transformers", "CLIPTokenizer"), ("transformers", "CLIPTokenizerFast")}
    ),
}
_SD = frozenset({"unet", "vae", "text_encoder", "tokenizer", "scheduler"})
# Pipeline class -> the components it must have (and may have: nothing else is loaded).
_PIPELINES = {
    "StableDiffusionPipeline": _SD,
    "StableDiffusionXLPipeline": _SD | {"text_encoder_2", "tokenizer_2"},
}
# Schedulers whose per-request instances the engine steps (one model call per step each).
SCHEDULERS: tuple[str, ...] = get_args(ImageScheduler)
# Components inferd never loads or runs, whatever they name.
_IGNORED = frozenset({"safety_checker", "feature_extractor", "image_encoder"})
DEFAULT_GUIDANCE = 7.5  # diffusers' StableDiffusionPipeline default


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
    # One (tokenizer, text encoder) pair for SD 1.x/2.x; SDXL's two, in its order.
    text_encoders: list[tuple[Any, Any]]
    scheduler_template: Any  # never stepped: each request gets its own from its config
    vae_scale_factor: int
    device: torch.device
    dtype: torch.dtype
    limits: ImageLimits
    # SDXL: an empty negative prompt is zeros, not the encoded "" (model_index.json's
    # force_zeros_for_empty_prompt, as diffusers' pipeline reads it).
    zero_empty_negative: bool = False

    @property
    def sdxl(self) -> bool:
        return len(self.text_encoders) == 2


def is_image_model(name_or_folder: str) -> bool:
    """True for a built-in (`inferd-tiny-sd`, `inferd-tiny-sdxl`) and for a folder that has a
    `model_index.json`."""
    if name_or_folder in BUILT_IN:
        return True
    return (Path(name_or_folder).expanduser() / "model_index.json").is_file()


def resolve_image_model(name_or_folder: str, cache_dir: Path) -> Path:
    """A built-in name -> its folder (built on first use); else a diffusers folder."""
    if name_or_folder in BUILT_IN:
        return ensure_tiny_sd(cache_dir, name_or_folder)
    folder = Path(name_or_folder).expanduser()
    if not (folder / "model_index.json").is_file():
        raise ModelLoadError(
            f"{name_or_folder!r} is not a diffusers pipeline folder (no model_index.json)"
        )
    return folder


def read_index(folder: Path) -> dict[str, Any]:
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/model_index.json: {e}") from e
    if not isinstance(index, dict):
        raise ModelLoadError(f"{folder}/model_index.json: not a JSON object")
    return index


def read_model_index(folder: Path) -> dict[str, tuple[str, str]]:
    """The components `model_index.json` names, checked against the allow-lists."""
    index = read_index(folder)
    pipeline = index.get("_class_name")
    if pipeline not in _PIPELINES:
        raise ModelLoadError(
            f"{folder}: pipeline class {pipeline!r} is not served (supported: {sorted(_PIPELINES)})"
        )
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or name in _IGNORED or not isinstance(value, list):
            continue
        if len(value) != 2 or not all(isinstance(v, str) for v in value):
            raise ModelLoadError(f"{folder}/model_index.json: {name!r} must be [library, class]")
        components[name] = (value[0], value[1])
    _check_allowed(folder, components, _PIPELINES[pipeline])
    return components


def _check_allowed(
    folder: Path, components: dict[str, tuple[str, str]], expected: frozenset[str]
) -> None:
    for name, pair in components.items():
        if name == "scheduler":
            if pair[0] != "diffusers" or pair[1] not in SCHEDULERS:
                raise ModelLoadError(
                    f"{folder}: scheduler {pair[1]!r} is not supported (one of {list(SCHEDULERS)})"
                )
        elif name not in _MODELS or name not in expected:
            raise ModelLoadError(f"{folder}: component {name!r} is not part of a served pipeline")
        elif pair not in _MODELS[name]:
            raise ModelLoadError(
                f"{folder}: {name} class {pair[0]}.{pair[1]} is not allowed "
                f"(allowed: {sorted(f'{lib}.{cls}' for lib, cls in _MODELS[name])})"
            )
    missing = expected - components.keys()
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

    unet = diffusers.UNet2DConditionModel.from_pretrained(
        folder, subfolder="unet", use_safetensors=True, torch_dtype=dtype
    )
    sdxl = "text_encoder_2" in components
    _check_conditioning(folder, unet.config, sdxl)
    vae = diffusers.AutoencoderKL.from_pretrained(
        folder, subfolder="vae", use_safetensors=True, torch_dtype=_vae_dtype(folder, dtype)
    )
    encoders = [_text_encoder(folder, "", "CLIPTextModel", dtype)]
    if sdxl:
        encoders.append(_text_encoder(folder, "_2", "CLIPTextModelWithProjection", dtype))
    modules: list[Any] = [unet, vae, *(encoder for _, encoder in encoders)]
    for module in modules:
        module.to(device).eval().requires_grad_(False)
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    return PipelineParts(
        unet=unet,
        vae=vae,
        text_encoders=encoders,
        scheduler_template=_scheduler(folder, components["scheduler"][1], spec.scheduler),
        vae_scale_factor=scale,
        device=device,
        dtype=dtype,
        limits=derive_limits(int(unet.config.sample_size) * scale, scale, spec),
        zero_empty_negative=sdxl and bool(read_index(folder).get("force_zeros_for_empty_prompt")),
    )


def _check_conditioning(folder: Path, config: Any, sdxl: bool) -> None:
    """SDXL's UNet takes its added text and time embeddings; nothing else extra is served."""
    added = config.get("addition_embed_type")
    if config.get("time_cond_proj_dim") is not None or added != ("text_time" if sdxl else None):
        raise ModelLoadError(
            f"{folder}: a UNet with this conditioning (addition_embed_type={added!r}, "
            f"time_cond_proj_dim={config.get('time_cond_proj_dim')!r}) is not supported"
        )


def _vae_dtype(folder: Path, dtype: torch.dtype) -> torch.dtype:
    """float16 overflows in a VAE that says `force_upcast` (SDXL's): that one runs in float32,
    as diffusers' pipeline upcasts it."""
    if dtype != torch.float16:
        return dtype
    try:
        config = json.loads((folder / "vae" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return dtype
    return torch.float32 if config.get("force_upcast") else dtype


def _text_encoder(folder: Path, suffix: str, cls: str, dtype: torch.dtype) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder / f"tokenizer{suffix}")
    encoder = getattr(transformers, cls).from_pretrained(
        folder / f"text_encoder{suffix}", use_safetensors=True, dtype=dtype
    )
    return tokenizer, encoder


def _scheduler(folder: Path, folder_class: str, chosen: str | None) -> Any:
    """The template every request's scheduler is built from: `chosen` (or the folder's class)
    over the folder's scheduler config."""
    import diffusers

    name = chosen or folder_class
    if name not in SCHEDULERS:
        raise ModelLoadError(f"scheduler {name!r} is not one of {list(SCHEDULERS)}")
    config = getattr(diffusers, folder_class).load_config(folder, subfolder="scheduler")
    return getattr(diffusers, name).from_config(config)


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
