"""Which quantization_config an int8 checkpoint may carry (models/quantized.py): llm-compressor's
W8A8 int8 layout loads; everything else is refused at load with the field that differs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inferd.cli import main
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


# -- `inferd quantize`: the command's own paths, no model run (so no VNNI needed) ---------------


def _float_folder(path: Path) -> Path:
    """The least a float Hugging Face folder has for `quantize`: config.json and one shard with
    two projections, an embedding and an lm_head."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "tokenizer.json").write_text("{}")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.embed_tokens.weight": torch.randn(16, 4, generator=g),
        "lm_head.weight": torch.randn(16, 4, generator=g),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_quantize_writes_int8_projections_and_refuses_what_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = _float_folder(tmp_path / "float"), tmp_path / "int8"
    assert main(["quantize", str(src), str(dst)]) == 0
    assert "2 linear weights as int8" in capsys.readouterr().out
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.int8
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # ignored by default
    assert (
        "model.layers.0.mlp.up_proj.weight_scale" in names and "lm_head.weight_scale" not in names
    )
    config = json.loads((dst / "config.json").read_text())
    # What inferd itself loads: the lm_head stays float, the projections are int8.
    rules = parse_quantization_config(config["quantization_config"], "int8/config.json")
    assert rules.ignores("lm_head") and not rules.ignores("model.layers.0.mlp.up_proj")
    assert (dst / "tokenizer.json").is_file()  # the other files come along
    # The refusals: each a one-line error and exit code 2, and no folder left half-written.
    assert main(["quantize", str(src), str(dst)]) == 2  # dst exists
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "a")]) == 2
    assert main(["quantize", str(dst), str(tmp_path / "b")]) == 2  # already quantized
    assert main(["quantize", str(src), str(tmp_path / "c"), "--ignore", "re:.*"]) == 2
    errors = capsys.readouterr().err
    for words in ("exists", "no config.json", "already quantized", "no linear weight"):
        assert words in errors
    assert not any((tmp_path / name).exists() for name in "abc")
