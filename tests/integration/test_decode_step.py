"""The native decode step (`kernels/decode_step.cpp`: every layer of a decode step in one call, up
to 128 rows in float32 and bfloat16 with panel copies, else 1-16, int8 weights 1-8) gives
bit-for-bit the layer-by-layer fused path's results.

Both run the same kernels in the same order, so greedy tokens and every log-probability must be
equal, not close, across the architecture flags it handles (q/k/v bias, q/k norms, GQA), both
float dtypes and int8 weights. The layer-by-layer path sends only 1-2 float32 rows to the GEMV
(`linear.GEMV_MAX_ROWS`; oneDNN sums 3-16 rows in another order), so for the comparison both runs
let it take as many as the decode step does (with panel copies: every row count on the panel GEMM,
in both paths already).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_cases import save_checkpoint

from inferd import LLM, SamplingParams
from inferd.models import linear
from inferd.models.kernels import NativeKernels
from inferd.models.kernels.decode import DecodePlan, DecodeShape, GemvWeight, LayerWeights
from inferd.models.linear import has_int8_gemm

pytest.importorskip("transformers")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),  # q/k/v bias
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k norms, head_dim != hidden / heads
}


def _checkpoint(name: str, root: Path) -> Path:
    cls_name, extra = CASES[name]
    return save_checkpoint(cls_name, extra, root / name, seed=0)


def _results(llm: LLM, rows: int) -> list[Any]:
    # `rows` requests decode together and finish one by one (steps of `rows` down to 2 rows),
    # then one decodes alone (1 row). Prompts of 8-39 tokens and up to 130 outputs fit the tiny
    # models' 256-token window at 128 rows, and all prompts one prefill step (the test's LLM).
    prompts: list[Any] = [
        {"prompt_token_ids": [t % 256 for t in range(20 + 9 * i, 28 + 9 * i + i % 32)]}
        for i in range(rows)
    ]
    params = [
        SamplingParams(max_tokens=rows - i + 2, temperature=0.0, ignore_eos=True, logprobs=3)
        for i in range(rows)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs += llm.generate(prompts[:1], params[0], use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    ("name", "dtype", "quantization", "kv_cache_dtype"),
    [
        ("llama", "float32", None, "auto"),
        ("qwen2", "float32", None, "auto"),
        ("qwen3", "bfloat16", None, "auto"),
        ("llama", "float32", None, "bfloat16"),  # a KV cache in another dtype than the model
        ("qwen2", "bfloat16", None, "fp8"),  # float8_e5m2 K/V
        ("llama", "float32", None, "int8"),  # int8 K/V rows with their scales
        pytest.param(
            "llama",
            "float32",
            "int8",
            "auto",
            marks=pytest.mark.skipif(not has_int8_gemm(), reason="no VNNI int8 dot products"),
        ),
    ],
)
def test_equals_the_layer_by_layer_path(
    name: str,
    dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    tmp_path: Path,
    native_kernels: NativeKernels,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(
        model=str(_checkpoint(name, tmp_path)),
        tokenizer="inferd-tiny",
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        small_batch_gemv="on",
        # int8 prefill quantizes activations over the whole batch, so a prefix-cache hit (a
        # different batch) would change the prefill's logits between the two runs.
        enable_prefix_caching=False,
        block_size=8,
        max_num_batched_tokens=4096,
    )
    model = llm.llm_engine.model.model
    plan = model.decode
    assert plan is not None, "the native decode step was not built"
    calls: list[int] = []
    real = DecodePlan.__call__

    def counting(self: DecodePlan, embed: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(embed.shape[0])
        return real(self, embed, *args)

    monkeypatch.setattr(DecodePlan, "__call__", counting)
    gemv_rows = min(plan.max_rows, native_kernels.gemv.max_rows)
    for m in model.modules():  # the layer-by-layer path's linear layers on the GEMV too
        if isinstance(m, linear.Linear):
            routes = [
                linear.Route(max(r.max_rows, gemv_rows), r.kernel) if r.kernel == "gemv_int8" else r
                for r in m.plan
            ]
            monkeypatch.setattr(m, "plan", tuple(routes))
    native = _results(llm, plan.max_rows)
    # 128 rows on the panel GEMM (bfloat16 where the CPU has AVX512_BF16); int8 8.
    panel_rows = native_kernels.gemv.panel_rows[getattr(torch, dtype)]
    want = 8 if quantization else panel_rows or 16
    assert plan.max_rows == want
    assert set(range(1, plan.max_rows + 1)) <= set(calls), f"step row counts {set(calls)}"
    model.decode = None
    calls.clear()
    assert _results(llm, plan.max_rows) == native
    assert not calls


def _layer(hidden: int, inter: int, heads: tuple[int, int, int], kv: torch.Tensor) -> LayerWeights:
    hq, hkv, d = heads

    def lin(n: int, k: int) -> GemvWeight:
        return GemvWeight(torch.randn(n, k), None)

    return LayerWeights(
        torch.ones(hidden),
        torch.ones(hidden),
        None,
        None,
        kv,
        lin((hq + 2 * hkv) * d, hidden),
        lin(hidden, hq * d),
        lin(2 * inter, hidden),
        lin(hidden, inter),
    )


def test_plan_refuses_a_layout_the_kernels_do_not_take(native_kernels: NativeKernels) -> None:
    hq, hkv, d, hidden, inter = 4, 2, 16, 64, 96
    kv = torch.zeros(2, 5, 8, hkv, d)
    cos, sin = torch.ones(32, d // 2), torch.zeros(32, d // 2)
    shape = DecodeShape(hq, hkv, d, 1e-6, 0.0, d**-0.5)
    good = _layer(hidden, inter, (hq, hkv, d), kv)
    native_kernels.decode.plan([good], torch.ones(hidden), cos, sin, shape)
    # A q/k/v weight for more heads than the shape says.
    bad = _layer(hidden, inter, (hq + 1, hkv, d), kv)
    with pytest.raises(ValueError, match="qkv"):
        native_kernels.decode.plan([bad], torch.ones(hidden), cos, sin, shape)
    # A KV cache whose head layout differs.
    bad = _layer(hidden, inter, (hq, hkv, d), torch.zeros(2, 5, 8, hkv, d * 2))
    with pytest.raises(ValueError, match="KV cache"):
        native_kernels.decode.plan([bad], torch.ones(hidden), cos, sin, shape)
    # bfloat16 norms in a float32 model.
    with pytest.raises(ValueError):
        native_kernels.decode.plan([good], torch.ones(hidden).bfloat16(), cos, sin, shape)
