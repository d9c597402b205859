"""Checkpoints already quantized to int8: compressed-tensors' `int-quantized` format.

That is what llm-compressor writes for its W8A8 int8 scheme, and what vLLM loads as
CompressedTensorsW8A8Int8. `config.json` says

    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
                        "dynamic": false, ...},
            "input_activations": {"num_bits": 8, "type": "int", "dynamic": true, ...} | null}},
        "ignore": ["lm_head"]}

and each quantized linear layer `<name>` carries `<name>.weight`, int8 [out, in], and
`<name>.weight_scale`, [out, 1] (any float dtype): W = weight * weight_scale, one symmetric scale
per output channel. Layers named in `ignore` (exactly, or by a `re:` regular expression) keep a
float `<name>.weight`.

inferd's int8 path (`--quantization int8`) is the same scheme: per-channel symmetric int8
weights, activations quantized per call. So the checkpoint's own integers and scales go into
it unchanged, with no second rounding. Where that path cannot run (a GPU, a CPU without VNNI),
the weights are dequantized into the model's dtype. Anything else in a quantization_config
(another format, method, bit width or strategy; static activation scales; zero points) is
refused at load, with its name.

    ckpt = parse_quantization_config(config["quantization_config"], "config.json")
    ckpt.ignores("lm_head")   # True

models/quantize.py (`inferd quantize SRC DST`) writes such a checkpoint from a float one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferd.errors import ModelLoadError

SUPPORTED = 'compressed-tensors "int-quantized" (int8 weights, one symmetric scale per channel)'


@dataclass(frozen=True)
class Int8Checkpoint:
    """A checkpoint whose linear layers are stored as int8 + per-channel scales."""

    # Module names (Hugging Face's, e.g. "lm_head") or "re:<pattern>" of layers stored in float.
    ignore: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module:
                return True
        return False


def parse_quantization_config(qc: Any, source: str) -> Int8Checkpoint:
    """The checkpoint's `quantization_config`, or a ModelLoadError saying what is unsupported."""

    def refuse(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: quantization_config: {problem}; inferd loads {SUPPORTED}")

    if not isinstance(qc, dict):
        raise refuse(f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r} is not supported")
    fmt = qc.get("format")
    if fmt != "int-quantized":
        raise refuse(f"format {fmt!r} is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups is missing")
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"config_groups.{name} must be an object")
        _check_group(name, group, refuse)
    if qc.get("kv_cache_scheme") is not None:
        raise refuse("kv_cache_scheme (a quantized KV cache) is not supported")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise refuse("ignore must be a list of module names")
    return Int8Checkpoint(tuple(ignore))


def _check_group(name: str, group: dict[str, Any], refuse: Any) -> None:
    where = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise refuse(f"{where}.targets {group.get('targets')!r} is not supported (only ['Linear'])")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise refuse(f"{where}.weights is missing")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for key, value in want.items():
        if weights.get(key) != value:
            raise refuse(f"{where}.weights.{key} is {weights.get(key)!r}, not {value!r}")
    if weights.get("dynamic"):
        raise refuse(f"{where}.weights.dynamic is not supported")
    acts = group.get("input_activations")
    if acts is not None and not (isinstance(acts, dict) and acts.get("dynamic") is True):
        # Static activation scales (input_scale tensors) would need a kernel that uses them.
        raise refuse(f"{where}.input_activations must be dynamic or absent")
    if group.get("output_activations") is not None:
        raise refuse(f"{where}.output_activations is not supported")


def int8_quantization_config(ignore: Sequence[str]) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for W8A8 int8: static per-channel weights,
    dynamic per-token activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                    "group_size": None,
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                    "observer": None,
                },
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }
