"""Rotary position embedding (RoPE), Hugging Face's "rotate_half" (GPT-NeoX) convention.

A head vector x of D dims is split into halves x1 = x[:D/2], x2 = x[D/2:]; dim pair (i, i + D/2)
rotates by angle pos * inv_freq[i]:

    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)

which is exactly HF's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)` element for element,
with half the cache. cos/sin are precomputed in float32 for every position up to `cache_len`
(like HF, angles are float32 products `pos * inv_freq`), then cast once to the model dtype, so a
step only gathers rows by `positions`.

Scaling variants (`rope_scaling["rope_type"]`):
- None / "default": inv_freq = 1 / base^(2i/D).
- "linear": inv_freq / factor (position interpolation); context grows to max_pos * factor.
- "llama3": Llama 3.1's per-frequency interpolation between `low_freq_factor` and
  `high_freq_factor` wavelengths; max_position_embeddings is already the extended context.
- "dynamic" (dynamic NTK): like vLLM's DynamicNTKScalingRotaryEmbedding, one fixed base, the one
  NTK gives for a sequence of max_pos * factor tokens, used for every position, so K/V already in
  the paged cache never need re-rotating. Hugging Face instead recomputes the base from the current
  sequence length on every forward (the unscaled base up to max_position_embeddings). The two agree
  exactly only when HF's sequence length is max_pos * factor; elsewhere outputs differ slightly.
- "longrope" (Phi-3's, also named "su"): per-frequency factors, `short_factor` for positions
  below `original_max_position_embeddings` and `long_factor` from there on (vLLM's choice: a
  position's rotation never changes once its K is cached), cos and sin times the attention factor
  sqrt(1 + ln(max_pos / original) / ln(original)). Hugging Face switches every position of a
  sequence to the long factors once the sequence passes the original length; the two agree on
  sequences up to that length.
- "yarn" (gpt-oss): inverse frequencies blended between the interpolated (/ factor) and the
  original ones over the dims between the `beta_fast` and `beta_slow` rotation counts of
  `original_max_position_embeddings` (rounded outwards unless `truncate` is false), cos and sin
  times the attention factor (`attention_factor`, else 0.1 ln(factor) + 1, or the `mscale` /
  `mscale_all_dim` ratio), as transformers computes them; static, so positions never re-rotate.
  max_position_embeddings is already the extended context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    name = str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
    return "longrope" if name == "su" else name


def _longrope_inv_freq(head_dim: int, base: float, factors: list[float]) -> Tensor:
    # HF's expression: 1 / (ext_factors * base ** (2i / D)).
    ext = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * base**exponents)


def longrope_attention_factor(rope_scaling: dict[str, Any]) -> float:
    """cos and sin are scaled by this (HF's default when the config gives none)."""
    original = int(rope_scaling["original_max_position_embeddings"])
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling.get("factor") or rope_scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope_scaling: dict[str, Any]) -> float:
    """cos and sin are scaled by this."""
    factor = float(rope_scaling["factor"])
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    mscale, all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    return _yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any]) -> Tensor:
    factor = float(rope_scaling["factor"])
    original = int(rope_scaling["original_max_position_embeddings"])
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: the original frequency, 0: interpolated
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def base_inv_freq(head_dim: int, base: float) -> Tensor:
    # [D/2] float32, the same expression as HF so values are bit-identical.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: Tensor, rope_scaling: dict[str, Any]) -> Tensor:
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and the
    # band between is a linear blend in 1 / wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_ntk_base(base: float, head_dim: int, max_position: int, factor: float) -> float:
    """The NTK base for a sequence of max_position * factor tokens (vLLM's fixed choice)."""
    max_len = int(max_position * factor)
    scale = (factor * max_len / max_position) - (factor - 1)
    return base * float(scale ** (head_dim / (head_dim - 2)))


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None, max_position: int
) -> Tensor:
    """Inverse frequencies [D/2] float32 for one rope variant."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return base_inv_freq(head_dim, base)
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return base_inv_freq(head_dim, base) / factor
    if rope_type == "llama3":
        return _llama3_inv_freq(base_inv_freq(head_dim, base), rope_scaling)
    if rope_type == "dynamic":
        return base_inv_freq(head_dim, dynamic_ntk_base(base, head_dim, max_position, factor))
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def rope_cache_len(rope_scaling: dict[str, Any] | None, max_position: int) -> int:
    """Positions the model can address: linear and dynamic scaling extend the context by factor."""
    if rope_type_of(rope_scaling) in ("linear", "dynamic"):
        assert rope_scaling is not None
        return int(max_position * float(rope_scaling["factor"]))
    return max_position


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k of a flat batch; one instance is shared by every layer."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        cache_len: int | None = None,
    ) -> None:
        """`cache_len`: positions to tabulate (default: what the scaling reaches)."""
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_scaling = rope_scaling
        self.cache_len = cache_len or rope_cache_len(rope_scaling, max_position)
        # Computed on the CPU (cheap, and meta tensors have no values), then moved to the device
        # the model is being built on.
        cos, sin = (c.to(torch.get_default_device(), dtype) for c in self._build_cache())
        # [P, D/2] each, model dtype; recomputable, so not saved in a state dict.
        self.cos_cache: Tensor
        self.sin_cache: Tensor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _build_cache(self) -> tuple[Tensor, Tensor]:
        if rope_type_of(self.rope_scaling) == "longrope":
            return self._build_longrope_cache()
        with torch.device("cpu"):
            inv_freq = compute_inv_freq(
                self.head_dim, self.base, self.rope_scaling, self.max_position
            )
            t = torch.arange(self.cache_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        if rope_type_of(self.rope_scaling) == "yarn":
            assert self.rope_scaling is not None
            factor = yarn_attention_factor(self.rope_scaling)
            return freqs.cos() * factor, freqs.sin() * factor
        return freqs.cos(), freqs.sin()

    def _build_longrope_cache(self) -> tuple[Tensor, Tensor]:
        assert self.rope_scaling is not None
        scaling = self.rope_scaling
        original = int(scaling["original_max_position_embeddings"])
        with torch.device("cpu"):
            t = torch.arange(self.cache_len, dtype=torch.float32)
            short = _longrope_inv_freq(self.head_dim, self.base, scaling["short_factor"])
            long = _longrope_inv_freq(self.head_dim, self.base, scaling["long_factor"])
            is_long = (torch.arange(self.cache_len) >= original)[:, None]
            freqs = torch.where(is_long, torch.outer(t, long), torch.outer(t, short))  # [P, D/2]
            factor = longrope_attention_factor(scaling)
            return freqs.cos() * factor, freqs.sin() * factor

    def cos_sin(self, positions: Tensor) -> RopeCosSin:
        # positions: [T] int64 -> cos, sin: [T, 1, D/2]
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # positions: [T] int64   q: [T, Hq, D]   k: [T, Hkv, D]
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# cos, sin of the flat batch's positions: [T, 1, D/2] each.
RopeCosSin = tuple[Tensor, Tensor]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]   cos, sin: [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
