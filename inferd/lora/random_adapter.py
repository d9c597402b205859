"""Random-weight LoRA adapters in PEFT's format, for tests, benchmarks and demos (no hub).

    write_random_adapter(model_dir, out_dir, rank=8, targets=("q_proj", "v_proj"), seed=1)

writes `adapter_config.json` and `adapter_model.safetensors` exactly as PEFT's
`save_pretrained` does for a causal LM, so PEFT loads the folder too (the tests compare against
it). Both factors are random (PEFT initialises B to zero, an adapter that changes nothing), scaled
so the adapter moves the logits about as much as a fine-tune does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from inferd.models.config import ArchConfig

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shape(arch: ArchConfig, target: str) -> tuple[int, int]:
    """The target layer's (input, output) features."""
    d, hidden = arch.head_dim, arch.hidden_size
    q, kv, inter = (
        arch.num_attention_heads * d,
        arch.num_key_value_heads * d,
        arch.intermediate_size,
    )
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def write_random_adapter(
    model_dir: Path,
    out_dir: Path,
    rank: int = 8,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    alpha: float | None = None,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.05,
) -> Path:
    """A PEFT LoRA folder for the model in `model_dir`; `alpha` None: 2 * rank."""
    arch = ArchConfig.from_json(model_dir / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_hidden_layers):
        for target in targets:
            block = "self_attn" if target in _ATTENTION else "mlp"
            n_in, n_out = _shape(arch, target)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(rank, n_in, generator=gen) * (std / n_in**0.5) * 8
            b = torch.randn(n_out, rank, generator=gen) * (std / rank**0.5) * 8
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank if alpha is None else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
