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
    """`src` rewritten by `inferd quantize` (models/quantize.py) as llm-compressor writes its W8A8
    int8 scheme: every linear layer's weight int8 with a per-channel float32 scale, layers named
    in `ignore` left in float."""
    from inferd.models.quantize import quantize_checkpoint

    quantize_checkpoint(src, dst, ignore)
    return dst
