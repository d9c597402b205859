"""Which quantization_config an int8 checkpoint may carry (models/quantized.py): llm-compressor's
W8A8 int8 layout loads; everything else is refused at load with the field that differs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from inferd.errors import ModelLoadError
from inferd.models.config import ArchConfig
from inferd.models.quantized import Int8Checkpoint, parse_quantization_config

# The least a W8A8 int8 config says (tests/integration/hf_cases.py writes llm-compressor's
# whole layout, observers and all).
W8A8: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
        }
    },
    "ignore": ["lm_head", "re:.*mlp\\.gate_proj$"],
}


def test_w8a8_int8_loads_with_its_ignore_list() -> None:
    ckpt = parse_quantization_config(W8A8, "config.json")
    assert ckpt.ignores("lm_head")
    assert ckpt.ignores("model.layers.3.mlp.gate_proj")
    assert not ckpt.ignores("model.layers.3.mlp.up_proj")
    assert not ckpt.ignores("model.lm_head.extra")


def test_weight_only_groups_load_too() -> None:
    qc = copy.deepcopy(W8A8)
    qc["config_groups"]["g"]["input_activations"] = None
    assert parse_quantization_config(qc, "c") == Int8Checkpoint(tuple(W8A8["ignore"]))


def _with(path: str, value: Any) -> dict[str, Any]:
    qc = copy.deepcopy(W8A8)
    *parents, last = path.split(".")
    node = qc
    for key in parents:
        node = node[key]
    node[last] = value
    return qc


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("quant_method", "gptq", "quant_method 'gptq'"),
        ("format", "pack-quantized", "format 'pack-quantized'"),
        ("format", "float-quantized", "format 'float-quantized'"),
        ("config_groups.g.weights.num_bits", 4, "num_bits is 4"),
        ("config_groups.g.weights.strategy", "group", "strategy is 'group'"),
        ("config_groups.g.weights.symmetric", False, "symmetric is False"),
        ("config_groups.g.targets", ["re:.*q_proj"], "targets"),
        ("config_groups.g.input_activations", {"dynamic": False}, "dynamic or absent"),
        ("kv_cache_scheme", {"num_bits": 8}, "kv_cache_scheme"),
        ("ignore", "lm_head", "ignore must be a list"),
    ],
)
def test_other_schemes_are_refused_by_name(path: str, value: Any, says: str) -> None:
    with pytest.raises(ModelLoadError, match="int-quantized") as err:
        parse_quantization_config(_with(path, value), "ckpt/config.json")
    assert says in str(err.value) and "ckpt/config.json" in str(err.value)


def test_the_architecture_config_carries_it() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert ArchConfig.from_dict(base).quantization is None
    assert ArchConfig.from_dict({**base, "quantization_config": W8A8}).quantization is not None
    # Older compressed-tensors checkpoints call it compression_config.
    assert ArchConfig.from_dict({**base, "compression_config": W8A8}).quantization is not None
    with pytest.raises(ModelLoadError, match="quant_method"):
        ArchConfig.from_dict({**base, "quantization_config": {"quant_method": "awq"}})
