"""The native decode step (`kernels/decode_step.cpp`: every layer of a decode step in one call, up
to 128 rows in float32 and bfloat16 with panel copies, int8 weights 1-8; one or more rows per
sequence) gives bit-for-bit the layer-by-layer fused path's results.

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
from inferd.models.attention.native import NativeMetadata
from inferd.models.kernels import NativeKernels, PagedBatch
from inferd.models.kernels.decode import DecodePlan, DecodeShape, GemvWeight, LayerWeights
from inferd.models.kernels.gemv import PanelWeight
from inferd.models.linear import has_int8_gemm
from inferd.models.moe import SparseMoE

pytest.importorskip("transformers")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),  # q/k/v bias
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k norms, head_dim != hidden / heads
    # MoE blocks (the router called back into torch) and a dense MLP layer between them.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 16,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
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
        ("qwen3_moe", "float32", None, "auto"),
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
        pytest.param(  # int8 experts: the int8 GEMV at every row count of the step
            "qwen3_moe",
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
    llm = _llm(
        (name, dtype, quantization, kv_cache_dtype),
        tmp_path,
        # int8 prefill quantizes activations over the whole batch, so a prefix-cache hit (a
        # different batch) would change the prefill's logits between the two runs.
        enable_prefix_caching=False,
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
    _gemv_as_the_step_runs_it(model, native_kernels, monkeypatch)
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
    # And with each MoE layer's experts one call each from Python (no experts' native call).
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in moes:
        monkeypatch.setattr(m, "panels", None)
    if moes:
        assert _results(llm, plan.max_rows) == native


def _gemv_as_the_step_runs_it(
    model: Any, native_kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer-by-layer path's int8 layers on the int8 GEMV for as many rows as the decode
    step sends it (the plan sends 3 and more rows to fbgemm, which sums in another order)."""
    assert model.decode is not None
    gemv_rows = min(model.decode.max_rows, native_kernels.gemv.int8_max_rows)
    for m in model.modules():
        if isinstance(m, linear.Linear):
            routes = [
                linear.Route(max(r.max_rows, gemv_rows), r.kernel) if r.kernel == "gemv_int8" else r
                for r in m.plan
            ]
            monkeypatch.setattr(m, "plan", tuple(routes))


# Sequences of a multi-row step: (context after the step, query rows). Rows 1 + 3 + 4 = 8 (the
# int8 step's most); the 3 and 4 rows cross a block boundary (8-token blocks).
MULTI_ROW_SEQS = ((13, 1), (18, 3), (35, 4))


# (checkpoint, dtype, quantization, KV cache dtype)
Case = tuple[str, str, str | None, str]
MULTI_ROW_CASES: list[Any] = [
    ("llama", "float32", None, "auto"),
    ("qwen3", "bfloat16", None, "auto"),  # q/k norms
    ("qwen2", "float32", None, "int8"),  # q/k/v bias, int8 K/V rows
    ("qwen3_moe", "bfloat16", None, "auto"),
    pytest.param(
        ("llama", "float32", "int8", "auto"),
        marks=pytest.mark.skipif(not has_int8_gemm(), reason="no VNNI int8 dot products"),
    ),
    pytest.param(
        ("qwen3_moe", "float32", "int8", "auto"),
        marks=pytest.mark.skipif(not has_int8_gemm(), reason="no VNNI int8 dot products"),
    ),
]


def _llm(case: Case, root: Path, **kwargs: Any) -> LLM:
    name, dtype, quantization, kv_cache_dtype = case
    return LLM(
        model=str(_checkpoint(name, root)),
        tokenizer="inferd-tiny",
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        small_batch_gemv="on",
        block_size=8,
        **kwargs,
    )


@pytest.mark.parametrize("case", MULTI_ROW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_multi_row_step_equals_the_layer_by_layer_path(
    case: Case, tmp_path: Path, native_kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of several query rows per sequence (a verify step's), each sequence's rows causal
    among themselves over its cached context: hidden states and written K/V bit for bit the
    layer-by-layer fused path's, on random tokens over a random cached context."""
    llm = _llm(case, tmp_path, kv_cache_memory=16 << 20)  # the caches are copied for each path
    engine = llm.llm_engine
    model = engine.model.model
    plan = model.decode
    assert plan is not None and plan.multi_row
    _gemv_as_the_step_runs_it(model, native_kernels, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    # Each sequence its own blocks, in a shuffled order (a table is not a range).
    blocks = torch.randperm(engine.runner.num_blocks, generator=gen).to(torch.int32)
    nbs = [(ctx + 7) // 8 for ctx, _ in MULTI_ROW_SEQS]
    tables = torch.zeros(len(nbs), max(nbs), dtype=torch.int32)
    for s, nb in enumerate(nbs):
        tables[s, :nb] = blocks[sum(nbs[:s]) : sum(nbs[: s + 1])]
    with torch.inference_mode():
        # The cached contexts: prefilled layer by layer, then the step on top, both ways.
        model.decode = None
        model(*_step_inputs(tables, [(ctx - q, ctx - q) for ctx, q in MULTI_ROW_SEQS], gen))
        before = [kv.clone() for kv in engine.runner.kv_caches]
        step = _step_inputs(tables, [(ctx, q) for ctx, q in MULTI_ROW_SEQS], gen)
        results = []
        for decode in (plan, None):
            for kv, saved in zip(engine.runner.kv_caches, before, strict=True):
                kv.copy_(saved)
            model.decode = decode
            out = model(*step)
            results.append((out, [kv.clone() for kv in engine.runner.kv_caches]))
    (native, native_kv), (layered, layered_kv) = results
    assert native.shape == (sum(q for _, q in MULTI_ROW_SEQS), model.norm.weight.shape[0])
    assert torch.equal(native, layered)
    assert all(torch.equal(a, b) for a, b in zip(native_kv, layered_kv, strict=True))


def _step_inputs(
    tables: torch.Tensor, seqs: list[tuple[int, int]], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, NativeMetadata]:
    """Random tokens for `seqs` ((context after the step, rows), the rows the context's last)
    over `tables`: input ids, positions and the native kernel's metadata."""
    q_len = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    positions = torch.cat([torch.arange(ctx - q, ctx) for ctx, q in seqs])
    slots = torch.cat(
        [
            tables[s, positions_of // 8].long() * 8 + positions_of % 8
            for s, positions_of in enumerate(torch.arange(ctx - q, ctx) for ctx, q in seqs)
        ]
    )
    paged = PagedBatch(
        block_tables=tables,
        q_start=(torch.cumsum(q_len, 0, dtype=torch.int32) - q_len),
        q_len=q_len,
        ctx_len=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
    )
    ids = torch.randint(1, 256, (int(q_len.sum()),), generator=gen)
    return ids, positions, NativeMetadata(slot_mapping=slots, paged=paged)


def _layer(hidden: int, inter: int, heads: tuple[int, int, int], kv: torch.Tensor) -> LayerWeights:
    hq, hkv, d = heads

    def lin(n: int, k: int) -> GemvWeight:
        panel = PanelWeight.of(torch.randn(n, k), None)
        assert panel is not None
        return GemvWeight("panel", panel, 128)

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
