"""`inferd quantize SRC DST`: a float checkpoint written as an int8 one (models/quantized.py's
compressed-tensors `int-quantized` format), with the rule `--quantization int8` applies at load:
round to nearest, one symmetric scale per output channel (max |w| / 127).

Shard by shard, under the same file names, with an updated index and config.json; the other
files (tokenizer, generation config, chat template) are copied. The result loads in inferd as
int8 without a flag, starts faster (nothing to quantize) and is about a quarter of a float32
checkpoint's linear weights; other compressed-tensors readers (vLLM) load it too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inferd.errors import ModelLoadError
from inferd.models.linear import quantize_int8
from inferd.models.loader import weight_files
from inferd.models.quantized import Int8Checkpoint, int8_quantization_config


@dataclass(frozen=True)
class QuantizeReport:
    quantized: int  # linear weights written as int8
    kept: int  # tensors copied as they were
    bytes_in: int
    bytes_out: int


def quantize_checkpoint(
    src: Path, dst: Path, ignore: Sequence[str] = ("lm_head",)
) -> QuantizeReport:
    """Writes `src` (a float Hugging Face folder) to `dst` as a compressed-tensors int-quantized
    checkpoint. Linear weights are `<module>.weight` of 2-D tensors whose module is a `*_proj`
    or the lm_head (the layers of every architecture inferd serves); `ignore` lists modules
    (exact names or `re:` patterns) kept in float."""
    if dst.exists():
        raise ModelLoadError(f"{dst} exists; quantize writes a new folder")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{src}: not a Hugging Face model folder (no config.json)")
    config = json.loads(config_path.read_text())
    if "quantization_config" in config or "compression_config" in config:
        raise ModelLoadError(f"{config_path}: the checkpoint is already quantized")
    rules = Int8Checkpoint(tuple(ignore))
    files = weight_files(src)
    dst.mkdir(parents=True)
    quantized = kept = bytes_in = bytes_out = 0
    weight_map: dict[str, str] = {}
    for file in files:
        out, n, size = _convert_shard(file, rules)
        quantized, kept, bytes_in = quantized + n, kept + len(out) - 2 * n, bytes_in + size
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        bytes_out += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(out, file.name))
    if quantized == 0:
        shutil.rmtree(dst)
        raise ModelLoadError(f"{src}: no linear weight to quantize (every one ignored?)")
    config["quantization_config"] = int8_quantization_config(ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text()).get("metadata", {})
        body = {"metadata": {**meta, "total_size": bytes_out}, "weight_map": weight_map}
        (dst / index.name).write_text(json.dumps(body, indent=2) + "\n")
    written = {"config.json", index.name}
    for other in sorted(src.iterdir()):
        if other.is_file() and other.suffix != ".safetensors" and other.name not in written:
            shutil.copy2(other, dst / other.name)
    return QuantizeReport(quantized, kept, bytes_in, bytes_out)


def _convert_shard(file: Path, rules: Int8Checkpoint) -> tuple[dict[str, torch.Tensor], int, int]:
    """One shard's tensors with its linear weights as int8 and their `weight_scale` beside them
    (the rest as they are); also how many weights were quantized and the shard's bytes read."""
    out: dict[str, torch.Tensor] = {}
    quantized = size = 0
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            t = f.get_tensor(name)
            size += t.numel() * t.element_size()
            module = name.removesuffix(".weight")
            leaf = module.rpartition(".")[2]
            linear = name.endswith(".weight") and t.dim() == 2
            linear = linear and (leaf.endswith("_proj") or leaf == "lm_head")
            if linear and not rules.ignores(module):
                q, scale = quantize_int8(t)
                out[name], out[f"{module}.weight_scale"] = q, scale[:, None].contiguous()
                quantized += 1
            else:
                out[name] = t
    return out, quantized, size
