"""RoPE variants against transformers' own rope code (inv_freq, cos/sin, rotated q/k)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.models.rope import (
    RotaryEmbedding,
    compute_inv_freq,
    dynamic_ntk_base,
    rope_cache_len,
    rope_type_of,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

HEAD_DIM = 32
MAX_POS = 64
THETA = 10000.0

SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    # gpt-oss's: the correction range not rounded outwards.
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 8,
    },
}


def _hf_config(scaling: dict[str, Any] | None) -> Any:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_theta=THETA,
        rope_scaling=scaling,
    )


def _ours(scaling: dict[str, Any] | None, dtype: torch.dtype = torch.float32) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, scaling, dtype)


def _hf_inv_freq(kind: str) -> torch.Tensor:
    config = _hf_config(SCALINGS[kind])
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    # Dynamic NTK at the length inferd fixes its base for.
    seq_len = rope_cache_len(SCALINGS[kind], MAX_POS) if kind == "dynamic" else None
    return ROPE_INIT_FUNCTIONS[rope_type_of(SCALINGS[kind])](config, None, seq_len=seq_len)[0]


def _hf_cos_sin(kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Any, Any]:
    rotary = LlamaRotaryEmbedding(_hf_config(SCALINGS[kind]))
    return rotary(torch.zeros(1, dtype=dtype), positions[None])


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_inv_freq_equals_transformers(kind: str) -> None:
    ours = compute_inv_freq(HEAD_DIM, THETA, SCALINGS[kind], MAX_POS)
    assert ours.dtype == torch.float32 and ours.shape == (HEAD_DIM // 2,)
    assert torch.equal(ours, _hf_inv_freq(kind))


def test_scaled_variants_differ_from_default() -> None:
    default = compute_inv_freq(HEAD_DIM, THETA, None, MAX_POS)
    for kind in ("linear", "dynamic", "llama3", "yarn", "yarn-untruncated"):
        assert not torch.equal(compute_inv_freq(HEAD_DIM, THETA, SCALINGS[kind], MAX_POS), default)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_cache_equals_transformers(kind: str, dtype: torch.dtype) -> None:
    rotary = _ours(SCALINGS[kind], dtype)
    # Every position the cache holds; for dynamic the last one makes HF scale to the same base.
    positions = torch.arange(rotary.cache_len)
    cos, sin = _hf_cos_sin(kind, positions, dtype)
    half = HEAD_DIM // 2
    assert torch.equal(cos[0, :, half:], cos[0, :, :half])  # HF repeats the halves
    assert torch.equal(rotary.cos_cache, cos[0, :, :half])
    assert torch.equal(rotary.sin_cache, sin[0, :, :half])


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rotated_q_k_equal_transformers(kind: str) -> None:
    rotary = _ours(SCALINGS[kind])
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv = 10, 4, 2
    positions = torch.randint(0, rotary.cache_len, (t,), generator=gen)
    positions[0] = rotary.cache_len - 1  # for dynamic: HF's seq_len = max position + 1
    q = torch.randn(t, hq, HEAD_DIM, generator=gen)
    k = torch.randn(t, hkv, HEAD_DIM, generator=gen)
    q_ours, k_ours = rotary(positions, q, k)
    cos, sin = _hf_cos_sin(kind, positions, torch.float32)
    # HF layout: [B, H, S, D] with cos [B, S, D] unsqueezed at dim 1.
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1
    )
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_dynamic_base_is_vllms_fixed_choice() -> None:
    factor = SCALINGS["dynamic"]["factor"]  # type: ignore[index]
    max_len = MAX_POS * factor
    expected = THETA * ((factor * max_len / MAX_POS) - (factor - 1)) ** (HEAD_DIM / (HEAD_DIM - 2))
    assert dynamic_ntk_base(THETA, HEAD_DIM, MAX_POS, factor) == pytest.approx(expected)


def test_cache_len() -> None:
    assert rope_cache_len(None, MAX_POS) == MAX_POS
    assert rope_cache_len(SCALINGS["llama3"], MAX_POS) == MAX_POS
    assert rope_cache_len(SCALINGS["linear"], MAX_POS) == 4 * MAX_POS
    assert rope_cache_len(SCALINGS["dynamic"], MAX_POS) == int(2.5 * MAX_POS)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(0, MAX_POS // 2 - 1),
    n=st.integers(0, MAX_POS // 2 - 1),
    shift=st.integers(0, MAX_POS // 2),
)
def test_scores_depend_only_on_relative_position(m: int, n: int, shift: int) -> None:
    rotary = _ours(None)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, HEAD_DIM, generator=gen, dtype=torch.float32)
    k = torch.randn(1, 1, HEAD_DIM, generator=gen, dtype=torch.float32)

    def score(pq: int, pk: int) -> float:
        rq, _ = rotary(torch.tensor([pq]), q, q)
        _, rk = rotary(torch.tensor([pk]), k, k)
        return float((rq * rk).sum())

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-4)
