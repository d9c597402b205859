"""Find a model folder and load its weights onto the device.

    path = resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", None, env)   # local, tiny, or Hub
    model, arch = load_model(path, torch.bfloat16, torch.device("cuda"), "auto", seed=0)

The model is built on the target device with uninitialised parameters, then safetensors files are
read tensor by tensor (memory-mapped, so host memory holds one tensor at a time), cast to the
model dtype and copied into place. Every checkpoint tensor must land somewhere and every
parameter must be filled; anything else is a ModelLoadError that names the tensor and the file.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from tqdm import tqdm

from inferd.config import Environment
from inferd.errors import ModelLoadError
from inferd.models.config import ArchConfig
from inferd.models.llama import LlamaForCausalLM, WeightTarget
from inferd.models.registry import get_model_class
from inferd.models.tiny import TINY_MODEL_NAME, ensure_tiny_model
from inferd.models.weights import Convert

logger = logging.getLogger("inferd.models")

LoadFormat = Literal["auto", "safetensors", "dummy"]

# What a Hub download fetches: configs, safetensors weights, tokenizer files, chat templates.
# Weights as `model*.safetensors` only: some repos (Mistral) also ship the same weights again as
# consolidated.safetensors in their own format, which would double the download.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.txt",
]
# Tensors some checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint (Gemma 3's ForConditionalGeneration) is served as its text tower: its
# language model's names (transformers >= 5, then < 5) -> the text model's; the other towers'
# tensors are skipped.
_TEXT_TOWER_NAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_OTHER_TOWERS = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)
DUMMY_RANGE = 1e-3


def resolve_model_path(name: str, revision: str | None, env: Environment) -> Path:
    """A local folder as is, `inferd-tiny` from the cache (built on first use), else the Hub."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if name == TINY_MODEL_NAME:
        return ensure_tiny_model(env.cache_dir)
    if name.startswith(("/", ".", "~")) or local.exists():
        raise ModelLoadError(f"model {name!r}: not a folder (looked for {local.resolve()})")
    return _download(name, revision, env.hf_offline)


def _download(repo_id: str, revision: str | None, offline: bool) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            local_files_only=offline,
            allow_patterns=HUB_ALLOW_PATTERNS,
        )
    except Exception as e:  # the hub raises many types (HTTP, offline, bad id, auth)
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the Hub"
        raise ModelLoadError(
            f"model {repo_id!r} (revision {revision or 'main'}): not a local folder, not "
            f"{TINY_MODEL_NAME!r}, and not found in {where}: {type(e).__name__}: {e}"
        ) from e
    return Path(folder)


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat,
    seed: int,
    arch: ArchConfig | None = None,
) -> tuple[LlamaForCausalLM, ArchConfig]:
    """Build the model described by `path/config.json` on `device` and fill its weights.

    Pass `arch` when the caller has parsed config.json already."""
    t0 = time.perf_counter()
    if arch is None:
        arch = ArchConfig.from_json(path / "config.json")
    cls = get_model_class(arch.architecture, arch.source)
    with torch.device(device):
        model = cls(arch, dtype)
    model.eval()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format in ("auto", "safetensors"):
        int8 = model.expect_int8(arch.quantization) if arch.quantization else []
        load_safetensors(model, weight_files(path))
        for linear in int8:
            linear.dequantize()
    else:
        raise ModelLoadError(f"unknown load_format {load_format!r}")
    model.finish_loading()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s from %s: %.1fM parameters, %s, device %s, %s weights, %.2f s",
        arch.architecture,
        path,
        num_params / 1e6,
        str(dtype).removeprefix("torch."),
        device,
        "dummy" if load_format == "dummy" else "safetensors",
        time.perf_counter() - t0,
    )
    return model, arch


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: those the index lists, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _files_from_index(index)
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors weights (other formats such as pytorch_model.bin are "
            "not supported; use load_format='dummy' for random weights)"
        )
    return files


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
    files = [index.parent / name for name in names]
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{index} lists {file.name}, which is missing from {file.parent}")
    return files


def load_safetensors(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; check full coverage."""
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters(remove_duplicate=False))
    tied_head = "lm_head.weight" if model.config.tie_word_embeddings else None
    multimodal = model.config.architecture.endswith("ForConditionalGeneration")
    seen: set[str] = set()
    # Tensors of a Convert read so far, until it has all of them.
    pending: dict[Convert, dict[str, torch.Tensor]] = {}
    with _progress(files) as bar:
        for file in files:
            with _open(file) as f:
                for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    bar.update(1)
                    name = _text_tower_name(stored) if multimodal else stored
                    if name is None or name == tied_head or name.endswith(_IGNORED_SUFFIXES):
                        continue
                    target = layout.get(name)
                    if target is None:
                        raise ModelLoadError(
                            f"{file.name}: unexpected tensor {name!r}, which this "
                            f"{model.config.architecture} has no parameter for"
                        )
                    param = params[target.param_name]
                    if target.convert is None:
                        _copy_tensor(f, stored, file, param, target)
                    else:
                        _convert_tensor(f.get_tensor(stored), name, file, param, target, pending)
                    seen.add(name)
    missing = sorted(set(layout) - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"{files[0].parent}: checkpoint is missing {len(missing)} tensor(s): "
            f"{', '.join(missing[:5])}{more}"
        )


def _text_tower_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's, or None for another tower's."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for prefix, ours in _TEXT_TOWER_NAMES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name


def _copy_tensor(f: Any, name: str, file: Path, param: torch.Tensor, target: WeightTarget) -> None:
    expected = (target.rows, *param.shape[1:])
    found = tuple(f.get_slice(name).get_shape())
    if found == (target.rows,) and expected == (target.rows, 1):
        found = expected  # an int8 checkpoint's per-channel scales saved as a vector
    if found != expected:
        raise ModelLoadError(
            f"{file.name}: tensor {name!r} has shape {list(found)}, expected {list(expected)}"
        )
    tensor = f.get_tensor(name)
    with torch.no_grad():
        param[target.row_start : target.row_start + target.rows].copy_(tensor.view(expected))


def _convert_tensor(
    tensor: torch.Tensor,
    name: str,
    file: Path,
    param: torch.Tensor,
    target: WeightTarget,
    pending: dict[Convert, dict[str, torch.Tensor]],
) -> None:
    """Keeps `tensor` until its Convert has all its tensors, then copies what it makes."""
    convert = target.convert
    assert convert is not None
    parts = pending.setdefault(convert, {})
    parts[name] = tensor
    if len(parts) < len(convert.names):
        return
    del pending[convert]
    rows = convert.fn([parts[n] for n in convert.names])
    expected = (target.rows, *param.shape[1:])
    if tuple(rows.shape) != expected:
        raise ModelLoadError(
            f"{file.name}: tensors {list(convert.names)} make shape {list(rows.shape)}, "
            f"expected {list(expected)}"
        )
    with torch.no_grad():
        param[target.row_start : target.row_start + target.rows].copy_(rows)


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad files
        raise ModelLoadError(f"{file}: cannot read safetensors file: {e}") from e


@contextmanager
def _progress(files: list[Path]) -> Iterator[tqdm]:
    total = 0
    for file in files:
        with _open(file) as f:
            total += len(f.keys())
    # Only for a person watching: logs and pipes get the summary line from load_model instead.
    with tqdm(
        total=total, desc="loading weights", unit="tensor", disable=not _stderr_is_tty()
    ) as bar:
        yield bar


def _stderr_is_tty() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """vLLM-style random weights: uniform in [-1e-3, 1e-3], each parameter seeded by its name,
    so the result depends only on (seed, parameter name, shape), not on the build order."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator(device=param.device)
            gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
