"""Model-config pieces shared by the tests that compare inferd with Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Llama 3.1's rope scaling for tiny test models: with an original context of 64, the wavelengths of
# head_dim 16 fall in all three llama3 bands.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# The engine tests' tiny decoder: 2 layers, 4 query heads over 2 KV heads, weights drawn wide
# enough (0.3) that greedy choices are not near-ties everywhere.
ENGINE_BASE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
)


def save_checkpoint(config_class: str, extra: dict[str, Any], path: Path, seed: int) -> Path:
    """A random float32 checkpoint of ENGINE_BASE + `extra`, written by transformers itself."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**{**ENGINE_BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_int8_checkpoint(src: Path, dst: Path, ignore: tuple[str, ...] = ()) -> Path:
    """`src` rewritten as llm-compressor writes its W8A8 int8 scheme (compressed-tensors
    `int-quantized`): every linear layer's weight as int8 with a symmetric per-channel float32
    scale [out, 1] (round to nearest, scale = max |w| / 127, inferd's own rule), layers named
    in `ignore` left in float."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith("_proj.weight") or name == "lm_head.weight"
        if not linear or module in ignore:
            out[name] = t
            continue
        scale = (t.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        out[name] = torch.round(t.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        out[f"{module}.weight_scale"] = scale[:, None].contiguous()
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = int8_quantization_config(list(ignore))
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst


def int8_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for W8A8 int8 (dynamic per-token
    activations, static per-channel weights)."""
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
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
