"""The architecture of a model, parsed once from a Hugging Face `config.json`.

Reads both config layouts in the wild: transformers < 5 (`rope_theta` + `rope_scaling`,
`torch_dtype`) and transformers >= 5 (`rope_parameters`, `dtype`). Family quirks that the file
does not spell out are filled in from the architecture name (Qwen2 always has q/k/v bias, Qwen3
and Gemma 3 always normalise q and k per head, Gemma scales its embeddings and norms by 1 + w).

A sliding window is per layer (`layer_windows`): Mistral's applies to every layer, Gemma 3's to
its local layers (`layer_types`, or the older `sliding_window_pattern`), Qwen2's from
`max_window_layers` on. It limits what a layer attends to, never how long a sequence may be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.errors import ModelLoadError
from inferd.models.config_fields import Fields as _Fields
from inferd.models.quantized import Int8Checkpoint, parse_quantization_config
from inferd.models.rope import SUPPORTED_ROPE_TYPES, rope_cache_len, rope_type_of

# `model_type` -> architecture, for configs saved without `architectures` (a bare
# `PretrainedConfig.save_pretrained` writes none).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# What models/registry.py builds (docs/models.md says what each needs). Checked first, so an
# architecture outside it (DeepSeek) is named as such, not by the first field it lacks.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(set(_MODEL_TYPE_TO_ARCH.values())))
_GEMMA = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma3TextConfig's defaults: Hub configs (a multimodal checkpoint's text_config most of all)
# leave out whatever equals them.
_GEMMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_GPT_OSS = "GptOssForCausalLM"
_MOE_STYLES = {"Qwen3MoeForCausalLM": "qwen", "MixtralForCausalLM": "mixtral", _GPT_OSS: "gpt_oss"}
# Activations of the gated MLP: HF's name -> ours.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token's router picks `top_k` of `num_experts` gated MLPs
    (softmax over the router logits in float32, the top k, renormalised when `norm_topk_prob`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    # Per layer: True for the MoE block, False for the dense MLP (Qwen3-MoE's mlp_only_layers,
    # decoder_sparse_step).
    sparse_layers: tuple[bool, ...]
    # Checkpoint names: "qwen" (mlp.gate, mlp.experts.E.{gate,up,down}_proj), "mixtral"
    # (block_sparse_moe.gate, block_sparse_moe.experts.E.{w1,w3,w2}) or "gpt_oss" (mlp.router,
    # mlp.experts.{gate_up,down}_proj stacked, with biases; its routing and clamped SwiGLU too:
    # models/gpt_oss.py).
    style: str
    # gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit), and experts stored as MXFP4.
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False


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
    # The config's sliding window, where some layer uses it (`layer_windows` says which).
    sliding_window: int | None
    torch_dtype: str | None  # "float32" / "bfloat16" / "float16" as saved, None if absent
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    source: str = "<dict>"  # the file this came from, for error messages
    # Linear layers stored as int8 + per-channel scales (models/quantized.py); None: float.
    quantization: Int8Checkpoint | None = None
    # Per layer: the last how many positions it attends to (None: all). Empty: every layer full.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE of the sliding-window layers where it is their own (Gemma 3's local base); None: the
    # global one.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    hidden_act: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    norm_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 3)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    fused_checkpoint: bool = (
        False  # q/k/v and gate/up stored fused (Phi-3's qkv_proj, gate_up_proj)
    )
    moe: MoEConfig | None = None
    # A learned logit per query head in each softmax's denominator (gpt-oss's attention sinks).
    attention_sinks: bool = False

    # Linear / dynamic RoPE scaling extends the context past max_position_embeddings (Llama's
    # configs); False where max_position_embeddings is the extended context already (Gemma 3).
    rope_extends_context: bool = True

    @property
    def max_context_len(self) -> int:
        """Longest sequence this model can run: RoPE's reach (a sliding window limits what a
        layer attends to, not the length)."""
        if not self.rope_extends_context:
            return self.max_position_embeddings
        return rope_cache_len(self.rope_scaling, self.max_position_embeddings)

    @property
    def kv_window(self) -> int | None:
        """The largest sliding window when every layer has one, else None: the span of positions
        before a query that any layer still reads (KV blocks before it can be released)."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

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
        return _parse(_Fields(_text_tower(data), source))


def _text_tower(data: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text model (Gemma 3's `text_config`), with the outer architecture
    name and token ids: only the language model is served."""
    text = data.get("text_config")
    if not isinstance(text, dict):
        return data
    outer = {k: data[k] for k in ("architectures", "quantization_config") if k in data}
    merged = {**text, **outer}
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        merged.setdefault(key, data.get(key))
    return merged


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


def _rope(
    f: _Fields, layer_type: str | None = None, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either config layout; `layer_type`: the
    parameters of that kind of layer (Gemma 3's "full_attention" / "sliding_attention")."""
    params = f.data.get("rope_parameters")
    source_key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = params if params is not None else f.data.get("rope_scaling")
    if layer_type is not None and isinstance(scaling, dict) and layer_type in scaling:
        scaling, source_key = scaling[layer_type], f"{source_key}.{layer_type}"
    elif layer_type == "sliding_attention":  # older Gemma 3 configs: only the base is its own
        return _local_theta(f, default_theta), None
    if scaling is not None and not isinstance(scaling, dict):
        raise f.error(source_key, f"must be an object, got {scaling!r}")
    scaling = dict(scaling or {})
    scaling.pop("partial_rotary_factor", None)  # checked in _check_partial_rotary
    theta = scaling.pop("rope_theta", None) or f.data.get("rope_theta") or default_theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise f.error("rope_theta", f"must be a positive number, got {theta!r}")
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.error(source_key, f"has rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings", f.data.get("original_max_position_embeddings")
        )
        scaling.setdefault("max_position_embeddings", f.get_int("max_position_embeddings", 2048))
    _check_rope_keys(f, source_key, scaling)
    return float(theta), scaling


def _local_theta(f: _Fields, default: float) -> float:
    theta = f.data.get("rope_local_base_freq") or default
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise f.error("rope_local_base_freq", f"must be a positive number, got {theta!r}")
    return float(theta)


def _check_partial_rotary(f: _Fields) -> None:
    params = f.data.get("rope_parameters")
    value = f.data.get("partial_rotary_factor")
    if isinstance(params, dict):
        value = params.get("partial_rotary_factor", value)
    if value is not None and value != 1.0:
        raise f.error(
            "partial_rotary_factor",
            f"is {value}; only rotary embeddings over the whole head are supported",
        )


def _check_rope_keys(f: _Fields, source_key: str, scaling: dict[str, Any]) -> None:
    if scaling["rope_type"] == "longrope":
        _check_longrope(f, source_key, scaling)
        return
    required = ["factor"]
    if scaling["rope_type"] == "yarn":
        required += ["original_max_position_embeddings"]
    if scaling["rope_type"] == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for key in required:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise f.error(
                source_key, f"needs a positive {key!r} for rope_type {scaling['rope_type']!r}"
            )


def _check_longrope(f: _Fields, source_key: str, scaling: dict[str, Any]) -> None:
    head_dim = f.opt_int("head_dim") or f.get_int("hidden_size") // f.get_int("num_attention_heads")
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list) or len(value) != head_dim // 2:
            raise f.error(
                source_key, f"needs {key!r}: a list of head_dim / 2 = {head_dim // 2} numbers"
            )
    if not isinstance(scaling.get("original_max_position_embeddings"), int):
        raise f.error("original_max_position_embeddings", "is needed by longrope scaling")


def _sliding_window(f: _Fields) -> int | None:
    # Qwen2/3 configs carry a `sliding_window` that only applies with use_sliding_window=true.
    if not f.get_bool("use_sliding_window", True):
        return None
    return f.opt_int("sliding_window")


def _layer_windows(f: _Fields, arch: str, window: int | None) -> tuple[int | None, ...]:
    """Each layer's sliding window: `layer_types` where the config lists them, else the family's
    rule (Gemma 3: every `sliding_window_pattern`-th layer global; Qwen2/3: layers from
    max_window_layers on; the others: every layer)."""
    n = f.get_int("num_hidden_layers")
    if window is None:
        return ()
    types = f.data.get("layer_types")
    if types is None and arch in _GEMMA:
        pattern = f.get_int("sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    elif types is None and arch == _GPT_OSS:  # sliding first, then every other layer
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif types is None and "max_window_layers" in f.data:
        first = f.get_int("max_window_layers", minimum=0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif types is None:
        types = ["sliding_attention"] * n
    if not isinstance(types, list) or len(types) != n:
        raise f.error("layer_types", f"must list one type per layer ({n}), got {types!r}")
    known = {"sliding_attention": window, "full_attention": None}
    if any(t not in known for t in types):
        raise f.error("layer_types", f"has an unknown layer type; known: {sorted(known)}")
    windows = tuple(known[t] for t in types)
    return windows if any(windows) else ()


def _dtype(f: _Fields) -> str | None:
    value = f.data.get("torch_dtype") or f.data.get("dtype")
    if value is None:
        return None
    if not isinstance(value, str):
        raise f.error("torch_dtype", f"must be a dtype name, got {value!r}")
    return value.removeprefix("torch.")


def _activation(f: _Fields) -> str:
    name = "hidden_activation" if "hidden_activation" in f.data else "hidden_act"
    value = f.get(name, "silu")
    if value not in _ACTIVATIONS:
        raise f.error(name, f"must be one of {sorted(_ACTIVATIONS)}, got {value!r}")
    return _ACTIVATIONS[value]


def _moe(f: _Fields, arch: str) -> MoEConfig | None:
    style = _MOE_STYLES.get(arch)
    if style is None:
        return None
    n = f.get_int("num_hidden_layers")
    experts = f.opt_int("num_experts") or f.get_int("num_local_experts")
    if style in ("mixtral", "gpt_oss"):  # every layer sparse, experts of intermediate_size
        gpt_oss = style == "gpt_oss"
        return MoEConfig(
            experts,
            f.get_int("num_experts_per_tok"),
            f.get_int("intermediate_size"),
            not gpt_oss,  # gpt-oss: a softmax over the top k, already normalised
            (True,) * n,
            style,
            f.get_float("swiglu_alpha", 1.702),
            f.get_float("swiglu_limit", 7.0),
            mxfp4=gpt_oss and _quant_method(f) == "mxfp4",
        )
    dense = f.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise f.error("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    step = f.get_int("decoder_sparse_step", 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return MoEConfig(
        experts,
        f.get_int("num_experts_per_tok"),
        f.get_int("moe_intermediate_size"),
        f.get_bool("norm_topk_prob", False),
        sparse,
        style,
    )


def _gemma_fields(f: _Fields, arch: str, window: int | None) -> dict[str, Any]:
    """ArchConfig fields of the Gemma 3 text model (none for the other families)."""
    if arch not in _GEMMA:
        return {}
    if f.data.get("attn_logit_softcapping") is not None:
        raise f.error("attn_logit_softcapping", "is not supported (Gemma 3 leaves it unset)")
    if f.get_bool("use_bidirectional_attention", False):
        raise f.error("use_bidirectional_attention", "is not supported (a causal LM is served)")
    local_theta, local_scaling = _rope(f, "sliding_attention", 10000.0)
    # transformers caps the logits in Gemma3ForCausalLM only (its ForConditionalGeneration does
    # not); Gemma 3's released configs leave the cap unset.
    cap = f.data.get("final_logit_softcapping") if arch == "Gemma3ForCausalLM" else None
    return dict(
        local_rope_theta=local_theta if window else None,
        local_rope_scaling=local_scaling,
        norm_offset=True,
        scale_embeddings=True,
        sandwich_norms=True,
        attention_scale=f.get_float("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcapping=None if cap is None else f.get_float("final_logit_softcapping"),
        rope_extends_context=False,
    )


def _parse(f: _Fields) -> ArchConfig:
    arch = _architecture(f)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.error(
            "architectures",
            f"names {arch!r}, an unsupported architecture; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    if arch in _GEMMA:
        f = _Fields({**_GEMMA_DEFAULTS, **f.data}, f.source)
    hidden, heads = f.get_int("hidden_size"), f.get_int("num_attention_heads")
    kv_heads = f.get_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads")
    head_dim = f.opt_int("head_dim") or hidden // heads
    if head_dim % 2:
        raise f.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
    _check_partial_rotary(f)
    gemma = arch in _GEMMA
    default_theta = 1e6 if gemma else 150000.0 if arch == _GPT_OSS else 10000.0
    theta, scaling = _rope(f, "full_attention" if gemma else None, default_theta)
    qkv_bias = arch == "Qwen2ForCausalLM" or f.get_bool("attention_bias", arch == _GPT_OSS)
    window = _sliding_window(f)
    layer_windows = _layer_windows(f, arch, window)
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
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_GEMMA),
        sliding_window=window if layer_windows else None,
        torch_dtype=_dtype(f),
        bos_token_id=f.opt_int("bos_token_id", minimum=0),
        eos_token_ids=f.token_ids("eos_token_id"),
        source=f.source,
        quantization=_quantization(f),
        layer_windows=layer_windows,
        hidden_act=_activation(f),
        fused_checkpoint=arch == "Phi3ForCausalLM",
        moe=_moe(f, arch),
        attention_sinks=arch == _GPT_OSS,
        **_gemma_fields(f, arch, window),
    )


def _quantization(f: _Fields) -> Int8Checkpoint | None:
    # Older compressed-tensors checkpoints name it compression_config.
    qc = f.data.get("quantization_config", f.data.get("compression_config"))
    if _quant_method(f) == "mxfp4" and _architecture(f) == _GPT_OSS:
        return None  # gpt-oss's MXFP4 experts, dequantized at load (MoEConfig.mxfp4)
    return None if qc is None else parse_quantization_config(qc, f.source)


def _quant_method(f: _Fields) -> object:
    qc = f.data.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None
