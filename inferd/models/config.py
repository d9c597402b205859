"""The architecture of a model, parsed once from a Hugging Face `config.json`.

Reads both config layouts in the wild: transformers < 5 (`rope_theta` + `rope_scaling`,
`torch_dtype`) and transformers >= 5 (`rope_parameters`, `dtype`). Family quirks that the file
does not spell out are filled in from the architecture name (Qwen2 always has q/k/v bias, Qwen3
always normalises q and k per head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.errors import ModelLoadError
from inferd.models.quantized import Int8Checkpoint, parse_quantization_config
from inferd.models.rope import SUPPORTED_ROPE_TYPES, rope_cache_len, rope_type_of

# `model_type` -> architecture, for configs saved without `architectures` (a bare
# `PretrainedConfig.save_pretrained` writes none).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_MISSING = object()


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # May differ from hidden_size // num_attention_heads (e.g. Qwen3, Mistral Nemo).
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Normalised: None for plain RoPE, else a dict with "rope_type" and that type's parameters.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    o_proj_bias: bool  # bias on the output projection (Llama's attention_bias covers it too)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # Mistral-style sliding-window attention. PagedAttention has no window, so the engine must cap
    # max_model_len to this (see `max_context_len`); within the window full attention is exact.
    sliding_window: int | None
    torch_dtype: str | None  # "float32" / "bfloat16" / "float16" as saved, None if absent
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    source: str = "<dict>"  # the file this came from, for error messages
    # Linear layers stored as int8 + per-channel scales (models/quantized.py); None: float.
    quantization: Int8Checkpoint | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence this model can run: RoPE's reach, capped by the sliding window."""
        reach = rope_cache_len(self.rope_scaling, self.max_position_embeddings)
        return min(reach, self.sliding_window) if self.sliding_window else reach

    @classmethod
    def from_json(cls, path: Path) -> ArchConfig:
        if not path.is_file():
            raise ModelLoadError(f"model config not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read model config {path}: {e}") from e
        if not isinstance(data, dict):
            raise ModelLoadError(f"model config {path} is not a JSON object")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> ArchConfig:
        return _parse(_Fields(data, source))


class _Fields:
    """Typed access to config.json fields; every failure names the field and the file."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, name: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: field {name!r} {problem}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is _MISSING:
                raise self.error(name, "is missing")
            return default
        return value

    def get_int(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(name, _MISSING if default is None else default)
        return self._check_int(name, value, minimum)

    def opt_int(self, name: str, minimum: int = 1) -> int | None:
        value = self.data.get(name)
        return None if value is None else self._check_int(name, value, minimum)

    def _check_int(self, name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def get_float(self, name: str, default: Any = _MISSING) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(name, f"must be a positive number, got {value!r}")
        return float(value)

    def get_bool(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def token_ids(self, name: str) -> frozenset[int]:
        value = self.data.get(name)
        items = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
            raise self.error(name, f"must be a token id or a list of them, got {value!r}")
        return frozenset(items)


def _architecture(f: _Fields) -> str:
    archs = f.data.get("architectures")
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise f.error("architectures", f"must be a list of names, got {archs!r}")
        return archs[0]
    model_type = f.data.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise f.error("architectures", f"is missing and model_type {model_type!r} is not known")


def _rope(f: _Fields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either config layout."""
    params = f.data.get("rope_parameters")
    source_key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = params if params is not None else f.data.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise f.error(source_key, f"must be an object, got {scaling!r}")
    scaling = dict(scaling or {})
    theta = scaling.pop("rope_theta", None) or f.data.get("rope_theta") or 10000.0
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise f.error("rope_theta", f"must be a positive number, got {theta!r}")
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.error(source_key, f"has rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    _check_rope_keys(f, source_key, scaling)
    return float(theta), scaling


def _check_rope_keys(f: _Fields, source_key: str, scaling: dict[str, Any]) -> None:
    required = ["factor"]
    if scaling["rope_type"] == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in required:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise f.error(
                source_key, f"needs a positive {key!r} for rope_type {scaling['rope_type']!r}"
            )


def _sliding_window(f: _Fields) -> int | None:
    # Qwen2/3 configs carry a `sliding_window` that only applies with use_sliding_window=true.
    if not f.get_bool("use_sliding_window", True):
        return None
    return f.opt_int("sliding_window")


def _dtype(f: _Fields) -> str | None:
    value = f.data.get("torch_dtype") or f.data.get("dtype")
    if value is None:
        return None
    if not isinstance(value, str):
        raise f.error("torch_dtype", f"must be a dtype name, got {value!r}")
    return value.removeprefix("torch.")


def _parse(f: _Fields) -> ArchConfig:
    arch = _architecture(f)
    hidden, heads = f.get_int("hidden_size"), f.get_int("num_attention_heads")
    kv_heads = f.get_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads")
    head_dim = f.opt_int("head_dim") or hidden // heads
    if head_dim % 2:
        raise f.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
    if f.get("hidden_act", "silu") != "silu":
        raise f.error("hidden_act", f"must be 'silu', got {f.data['hidden_act']!r}")
    theta, scaling = _rope(f)
    qkv_bias = arch == "Qwen2ForCausalLM" or f.get_bool("attention_bias", False)
    return ArchConfig(
        architecture=arch,
        vocab_size=f.get_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.get_int("intermediate_size"),
        num_hidden_layers=f.get_int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.get_float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=f.get_int("max_position_embeddings", 2048),
        tie_word_embeddings=f.get_bool("tie_word_embeddings", False),
        attention_bias=qkv_bias,
        o_proj_bias=arch != "Qwen2ForCausalLM" and qkv_bias,
        mlp_bias=f.get_bool("mlp_bias", False),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(f),
        torch_dtype=_dtype(f),
        bos_token_id=f.opt_int("bos_token_id", minimum=0),
        eos_token_ids=f.token_ids("eos_token_id"),
        source=f.source,
        quantization=_quantization(f),
    )


def _quantization(f: _Fields) -> Int8Checkpoint | None:
    # Older compressed-tensors checkpoints name it compression_config.
    qc = f.data.get("quantization_config", f.data.get("compression_config"))
    return None if qc is None else parse_quantization_config(qc, f.source)
