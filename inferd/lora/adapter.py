"""A PEFT LoRA folder, read and checked against the served model, packed per linear layer.

The folder holds `adapter_config.json` (peft_type LORA) and `adapter_model.safetensors`, whose
keys are `base_model.model.<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r],
each module one checkpoint layer of the base model (`model.layers.3.self_attn.q_proj`). inferd
fuses q/k/v and gate/up into one linear layer each, so an adapter is packed per *inferd* layer:

    at:      [in, w]        the A of every shard of the layer the adapter targets, stacked and
                            transposed (w = sum of their ranks): one GEMM for all of them
    blocks:  per shard      its rank columns [r0, r1) of x at, its output columns [c0, c1),
                            and its B transposed [r1 - r0, c1 - c0]

so a layer's term is one shrink GEMM and one expand GEMM per shard, each over that shard's own
output columns: y[:, c0:c1] += (x at)[:, r0:r1] bt_i. (One B over all columns, zero off each
shard's block, would multiply and read those zeros: 3x the expand's work and bytes for q/k/v.)
The scaling, lora_alpha / r (rsLoRA: lora_alpha / sqrt(r); PEFT's per-module rank_pattern and
alpha_pattern honoured), is folded into each bt.

Other files reach the same packing through `check_config` and `pack_adapter`: the image lane's
UNet styles (inferd/diffusion/lora_files.py).

Refused with the reason (InvalidRequestError, a 400): a path that is not a folder, no
adapter_config.json or not a LoRA one, weights only as a pickle (`.bin`: safetensors only), a rank
over `max_lora_rank`, DoRA, trained biases, `modules_to_save`, targets the model lacks (embeddings,
lm_head, MoE experts, or names it has not), and factors shaped for another base model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from inferd.errors import InvalidRequestError
from inferd.lora.request import LoRARequest

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class ShardTarget:
    """Where one checkpoint layer lives in the model: shard `shard` of the fused linear layer
    `linear`, its output rows [row_start, row_start + rows)."""

    linear: str
    shard: int
    row_start: int
    rows: int
    in_features: int
    out_features: int  # the fused layer's


@dataclass(frozen=True)
class ShardFactors:
    """One shard's expand: rank columns [r0, r1) of x at -> output columns [c0, c1)."""

    r0: int
    r1: int
    c0: int
    c1: int
    bt: Tensor  # [r1 - r0, c1 - c0], scaling folded in


@dataclass(frozen=True)
class LinearFactors:
    """One inferd linear layer's part of an adapter, packed (module docstring)."""

    at: Tensor  # [in, w]
    blocks: tuple[ShardFactors, ...]

    def to(self, device: torch.device) -> LinearFactors:
        if self.at.device == device:
            return self
        blocks = tuple(ShardFactors(b.r0, b.r1, b.c0, b.c1, b.bt.to(device)) for b in self.blocks)
        return LinearFactors(self.at.to(device), blocks)


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter loaded in host memory, ready for a slot."""

    request: LoRARequest
    layers: dict[str, LinearFactors]  # by inferd linear layer name


def load_adapter(
    request: LoRARequest,
    targets: dict[str, ShardTarget],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Reads, checks and packs the folder `request.lora_path` for the layers `targets`."""
    folder = Path(request.lora_path).expanduser()
    config = _read_config(folder, request.lora_name)
    pairs = _read_pairs(folder, request.lora_name)
    return pack_adapter(request, config, pairs, targets, max_rank, dtype)


def pack_adapter(
    request: LoRARequest,
    config: dict[str, object],
    pairs: dict[str, dict[str, Tensor]],
    targets: dict[str, ShardTarget],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Checks and packs an adapter's factors, whatever file they came from: `config` a PEFT
    LoraConfig's fields (passed `check_config`), `pairs` {checkpoint module name: {"A": [r, in],
    "B": [out, r]}}."""
    name = request.lora_name
    factors = {m: _check_pair(name, m, p, targets, max_rank) for m, p in pairs.items()}
    return LoRAAdapter(request, _pack(factors, config, targets, dtype))


def refuse(name: str, reason: str) -> InvalidRequestError:
    """The 400 an adapter that cannot be applied exactly is refused with."""
    return InvalidRequestError(f"LoRA adapter {name!r}: {reason}", "lora_path")


def _read_config(folder: Path, name: str) -> dict[str, object]:
    if not folder.is_dir():
        raise refuse(name, f"{folder} is not a folder")
    path = folder / _CONFIG
    if not path.is_file():
        raise refuse(name, f"{folder} has no {_CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise refuse(name, f"{_CONFIG} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise refuse(name, f"{_CONFIG} is not a LoRA adapter's (peft_type LORA)")
    check_config(config, name, _CONFIG)
    return config


def check_config(config: dict[str, object], name: str, source: str) -> None:
    """Refuses a LoraConfig (its fields, read from `source`) whose adapter inferd cannot apply
    exactly."""
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(name, f"{source} is not a LoRA adapter's (peft_type LORA)")
    if config.get("use_dora"):
        raise refuse(name, "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise refuse(name, "adapters with trained biases are not supported (bias must be none)")
    if config.get("modules_to_save"):
        raise refuse(name, "modules_to_save (fully trained layers) are not supported")
    if not isinstance(config.get("r"), int) or not isinstance(
        config.get("lora_alpha", 8), int | float
    ):
        raise refuse(name, f"{source} needs an integer r and a numeric lora_alpha")


def _read_pairs(folder: Path, name: str) -> dict[str, dict[str, Tensor]]:
    """{checkpoint module name: {"A": [r, in], "B": [out, r]}}, as the file holds them."""
    path = folder / _WEIGHTS
    if not path.is_file():
        found = "adapter_model.bin" if (folder / "adapter_model.bin").exists() else "nothing"
        raise refuse(name, f"{folder} has no {_WEIGHTS} (found {found}; safetensors only)")
    pairs: dict[str, dict[str, Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.match(key)
                if match is None:
                    raise refuse(name, f"unexpected tensor {key!r} (only lora_A / lora_B)")
                pairs.setdefault(match["module"], {})[match["factor"]] = f.get_tensor(key)
    except (OSError, RuntimeError) as e:  # safetensors' errors for a corrupt file
        raise refuse(name, f"{_WEIGHTS} could not be read ({e})") from e
    if not pairs:
        raise refuse(name, f"{_WEIGHTS} holds no LoRA factors")
    return pairs


def _check_pair(
    name: str,
    module: str,
    pair: dict[str, Tensor],
    targets: dict[str, ShardTarget],
    max_rank: int,
) -> tuple[Tensor, Tensor]:
    target = targets.get(module)
    if target is None:
        raise refuse(name, f"targets {module}, which this model has no LoRA-capable layer for")
    if set(pair) != {"A", "B"}:
        raise refuse(name, f"{module} needs both lora_A and lora_B")
    a, b = pair["A"], pair["B"]
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise refuse(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
    if r > max_rank:
        raise refuse(name, f"rank {r} of {module} is over --max-lora-rank {max_rank}")
    if a.shape[1] != target.in_features or b.shape[0] != target.rows:
        raise refuse(
            name,
            f"{module} is shaped for another base model: lora_A {tuple(a.shape)}, lora_B "
            f"{tuple(b.shape)}; this model's layer is [{target.rows}, {target.in_features}]",
        )
    return a, b


def _scaling(config: dict[str, object], module: str, rank: int) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)), with PEFT's per-module alpha_pattern."""
    alpha = float(config.get("lora_alpha", 8))  # type: ignore[arg-type]
    patterns = config.get("alpha_pattern") or {}
    assert isinstance(patterns, dict)
    for key, value in patterns.items():
        # PEFT matches a pattern key against the module name's tail.
        if re.fullmatch(rf"(.*\.)?{key}", module):
            alpha = float(value)
            break
    return alpha / (rank**0.5 if config.get("use_rslora") else rank)


def _pack(
    factors: dict[str, tuple[Tensor, Tensor]],
    config: dict[str, object],
    targets: dict[str, ShardTarget],
    dtype: torch.dtype,
) -> dict[str, LinearFactors]:
    by_layer: dict[str, list[tuple[ShardTarget, str]]] = {}
    for module in factors:
        target = targets[module]
        by_layer.setdefault(target.linear, []).append((target, module))
    out: dict[str, LinearFactors] = {}
    for linear, shards in by_layer.items():
        shards.sort(key=lambda s: s[0].shard)
        width = sum(int(factors[m][0].shape[0]) for _, m in shards)
        first = shards[0][0]
        at = torch.empty(first.in_features, width, dtype=dtype)
        blocks = []
        col = 0
        for target, module in shards:
            fa, fb = factors[module]
            r = int(fa.shape[0])
            scale = _scaling(config, module, r)
            at[:, col : col + r] = fa.float().t().to(dtype)
            lo, hi = target.row_start, target.row_start + target.rows
            bt = (fb.float().t() * scale).to(dtype).contiguous()
            blocks.append(ShardFactors(col, col + r, lo, hi, bt))
            col += r
        out[linear] = LinearFactors(at, tuple(blocks))
    return out
