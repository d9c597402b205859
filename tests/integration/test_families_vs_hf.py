"""Model families past Llama's shape against transformers: sliding windows (Mistral), Gemma 3,
Phi-3 and mixture-of-experts (Qwen3-MoE, Mixtral).

Each model is a tiny random-weight checkpoint written by transformers itself, with several layer
counts, GQA, tied and untied embeddings. The logits of one prefill equal transformers'; greedy
output through the engine equals `generate` token for token under continuous batching, chunked
prefill, preemption and prefix caching, with prompts + outputs well past the sliding windows, on
the native kernels and on the PyTorch fallback.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_cases import ENGINE_BASE  # noqa: E402
from test_engine_vs_hf import (  # noqa: E402
    _engine,
    _hf_greedy,
    _params,
    _run,
    _tokens,
    _workload,
)
from test_models_vs_hf import _prefill_logits, _prompt, _randomize  # noqa: E402

from inferd.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.errors import ModelLoadError  # noqa: E402
from inferd.executor.kv_pool import kv_bytes_per_block  # noqa: E402
from inferd.models.config import SUPPORTED_ARCHITECTURES, ArchConfig  # noqa: E402
from inferd.models.gpt_oss import Expert as GptOssExpert  # noqa: E402
from inferd.models.gpt_oss import dequantize_mxfp4  # noqa: E402
from inferd.models.kernels import NativeKernels, kernel_available  # noqa: E402
from inferd.models.linear import (  # noqa: E402
    LinearKind,
    NativeLinear,
    has_int8_gemm,
    prepare_linears,
)
from inferd.models.loader import load_model  # noqa: E402
from inferd.models.moe import Expert, SparseMoE  # noqa: E402

_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(8)],
    "long_factor": [1.5 + 0.25 * i for i in range(8)],
}

# gpt-oss's YaRN at test scale: a 64-token original context stretched 4x (the 256 positions).
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
_GPT_OSS = {
    **_IDS,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "rope_parameters": _YARN,
}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # The case: a 24-token window under prompts + outputs of up to 86 tokens.
    "mistral-window": ("MistralConfig", {"sliding_window": 24}),
    "mistral-window-3l-tied": (
        "MistralConfig",
        {"sliding_window": 7, "num_hidden_layers": 3, "tie_word_embeddings": True},
    ),
    # Local layers (window 10, their own RoPE base) around a global one; logit soft-capping.
    "gemma3": (
        "Gemma3TextConfig",
        {
            **_IDS,
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 10,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
        },
    ),
    # The older config layout: a pattern instead of layer_types (every 2nd layer global).
    "gemma3-untied-pattern": (
        "Gemma3TextConfig",
        {
            **_IDS,
            "head_dim": 32,
            "num_key_value_heads": 1,
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "tie_word_embeddings": False,
        },
    ),
    "phi3-longrope": (
        "Phi3Config",
        {**_IDS, "original_max_position_embeddings": 128, "rope_scaling": _LONGROPE},
    ),
    "phi3-window-tied": (
        "Phi3Config",
        {**_IDS, "sliding_window": 20, "num_hidden_layers": 1, "tie_word_embeddings": True},
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 16,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    # Sliding (window 12) and full layers alternating, sinks, YaRN, biased top-2 of 4 experts.
    "gpt-oss": ("GptOssConfig", {**_GPT_OSS, "sliding_window": 12}),
    "gpt-oss-3l-tied": (
        "GptOssConfig",
        {**_GPT_OSS, "sliding_window": 9, "num_hidden_layers": 3, "tie_word_embeddings": True},
    ),
    # Every layer local (layer_types): its blocks before the window are released too.
    "gpt-oss-all-sliding": (
        "GptOssConfig",
        {
            **_GPT_OSS,
            "sliding_window": 10,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention"] * 3,
            "num_experts_per_tok": 3,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": True,
            "sliding_window": 30,
        },
    ),
}


def _checkpoint(name: str, root: Path, seed: int = 1234, **overrides: Any) -> tuple[Any, Path]:
    cls_name, extra = FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**ENGINE_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(root / name)
    return model, root / name


def _shared_prefix_workload(seed: int) -> list[tuple[list[int], int]]:
    """The usual mixed workload, its first prompt and two late arrivals sharing a 40-token
    prefix (prefix-cache hits past the windows)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 380) for _ in range(40)]
    first, *late = [(prefix + [rng.randrange(5, 380) for _ in range(n)], 12) for n in (3, 9, 20)]
    return [first, *_workload(seed), *late]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    hf, folder = _checkpoint(name, tmp_path)
    model, arch = load_model(folder, torch.float32, torch.device("cpu"), "auto", seed=0)
    ids = _prompt(arch.vocab_size, 50)  # past every window
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


_GREEDY_CASES = [(name, backend) for name in sorted(FAMILIES) for backend in ("auto", "torch")]


@pytest.mark.parametrize(("name", "backend"), _GREEDY_CASES)
def test_greedy_matches_transformers(name: str, backend: str, tmp_path: Path) -> None:
    hf, path = _checkpoint(name, tmp_path)
    work = _shared_prefix_workload(seed=len(name))
    engine = _engine(path, attention_backend=backend)
    window = engine.arch.kv_window
    if window is not None:
        # Windows on every layer release blocks: a pool of 4 blocks more than one request's
        # most (the window before a 32-token chunk, and the chunk) still preempts.
        num_blocks = (32 + window - 2) // 4 + 2 + 4
        memory = num_blocks * kv_bytes_per_block(engine.arch, 4, torch.float32)
        engine = _engine(path, attention_backend=backend, kv_cache_memory=memory)
    results = _run(engine, work)
    got = _tokens(results)
    want = [_hf_greedy(hf, prompt, n) for prompt, n in work]
    for i, (prompt, _) in enumerate(work):
        assert got[str(i)] == want[i], f"request {i} (prompt {len(prompt)})"
    # The shared-prefix prompts once more: their prefix (past the windows) comes from the cache
    # (with every layer windowed, only while its leading blocks were not evicted yet).
    again = _run(engine, [work[0], work[-1]])
    assert _tokens(again) == {"0": want[0], "1": want[-1]}
    assert window is not None or all(o.metrics.num_cached_tokens >= 40 for o in again.values())
    if backend == "auto" and kernel_available():
        assert engine.runner.attn_kernel is not None and engine.model.model.fused is not None
        # Llama-shaped layers (Mistral's windows, Phi-3) decode in one native call too.
        assert (engine.model.model.decode is not None) == engine.model.model.plain_layers
    arch = engine.arch
    if arch.sliding_window is not None:
        longest = max(len(p) + n for p, n in work)
        assert engine.max_model_len > arch.sliding_window and longest > 2 * arch.sliding_window
    if arch.moe is not None:  # the step stats count the rows each expert received
        stats = engine.step_stats.steps
        assert all(len(s.expert_rows) == arch.moe.num_experts for s in stats)
        layers = sum(arch.moe.sparse_layers)
        want_rows = sum(s.num_batched_tokens for s in stats) * arch.moe.top_k * layers
        # (The last layer routes only the rows that sample.)
        assert 0 < sum(sum(s.expert_rows) for s in stats) <= want_rows
    # Chunked prefill and preemption happened; nothing leaked.
    assert sum(out.metrics.num_preemptions for out in results.values()) > 0
    assert any(s.num_prefill_tokens == 32 for s in engine.step_stats.steps)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_windowed_sequence_longer_than_the_pool_completes(backend: str, tmp_path: Path) -> None:
    # Every layer has a 7-token window, so blocks wholly before it go back to the pool: a
    # 130-token sequence runs in 12 blocks of 4 (48 slots), its output transformers' own, then
    # again from the prefix cache, beside a shorter request sharing its prompt.
    hf, path = _checkpoint("mistral-window-3l-tied", tmp_path)
    arch = ArchConfig.from_json(path / "config.json")
    config = EngineConfig.from_kwargs(
        model=str(path),
        tokenizer="inferd-tiny",
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        block_size=4,
        kv_cache_memory=12 * kv_bytes_per_block(arch, 4, torch.float32),
        max_num_batched_tokens=16,
    )
    engine = LLMEngine(config)
    bm = engine.scheduler.block_manager
    assert bm.window == 7 and engine.max_model_len == arch.max_context_len
    prompt = _prompt(arch.vocab_size, 50)
    want = _hf_greedy(hf, prompt, 80)
    engine.add_request("long", {"prompt_token_ids": prompt}, _params(80))
    most_held = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        most_held = max(most_held, bm.num_blocks - bm.num_free_blocks)
        bm.check_invariants()
    assert outs[0].outputs[0].token_ids == want
    # The window before a 16-token chunk plus the chunk: (16 + 7 - 2) // 4 + 2 = 7 blocks.
    assert most_held <= 7 < bm.num_blocks_for(len(prompt) + 80)
    again = _run(engine, [(prompt, 20), (prompt[:30], 10)])
    assert _tokens(again) == {"0": want[:20], "1": _hf_greedy(hf, prompt[:30], 10)}
    assert bm.num_free_blocks == bm.num_blocks
    if backend == "torch":
        # The decode path CUDA graphs replay (run eagerly here): released entries read block 0,
        # which each layer's window mask leaves out.
        engine.runner.enable_decode_graphs(engine.max_model_len, 8, capture=False)
        assert _tokens(_run(engine, [(prompt, 80)])) == {"0": want}
        graphs = engine.runner.decode_graphs
        assert graphs is not None and graphs.graphs, "no decode step used the static path"


def test_sliding_window_is_not_the_context_length() -> None:
    # The bug: Mistral-7B-v0.1 (window 4,096, context 32,768) was capped at 4,096.
    base = {"model_type": "mistral", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2}
    base |= {"intermediate_size": 128}
    arch = ArchConfig.from_dict(
        {**base, "num_attention_heads": 4, "max_position_embeddings": 32768, "sliding_window": 4096}
    )
    assert arch.max_context_len == 32768
    assert [arch.window(i) for i in range(2)] == [4096, 4096]


def test_gemma3_multimodal_checkpoint_serves_its_text_tower(tmp_path: Path) -> None:
    # Gemma3ForConditionalGeneration: the config's text_config, the language model's tensors
    # (the vision tower's skipped); logits on text equal the multimodal model's.
    _, extra = FAMILIES["gemma3"]
    text = {**ENGINE_BASE, **extra}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, **_IDS
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomize(hf, 3)
    hf.save_pretrained(tmp_path / "mm")
    model, arch = load_model(tmp_path / "mm", torch.float32, torch.device("cpu"), "auto", seed=0)
    assert arch.architecture == "Gemma3ForConditionalGeneration"
    ids = _prompt(arch.vocab_size, 30)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_moe_router_and_experts_match_transformers(tmp_path: Path) -> None:
    # The router's logits, the experts chosen and their weights are transformers' own in
    # float32, bit for bit; the block's output equals its per-expert loop.
    hf, folder = _checkpoint("qwen3-moe", tmp_path)
    model, _ = load_model(folder, torch.float32, torch.device("cpu"), "auto", seed=0)
    block = model.model.layers[0].ffn
    assert isinstance(block, SparseMoE)
    x = torch.randn(37, ENGINE_BASE["hidden_size"], generator=torch.Generator().manual_seed(0))
    hf_block = hf.model.layers[0].mlp
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_block.gate(x)
        weights, experts = block.route(x)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        torch.testing.assert_close(block.mix(x), hf_block(x[None])[0], atol=1e-6, rtol=1e-6)
    assert sum(block.take_counts()) == 37 * 2  # 37 rows, top 2


# (kind, dtype) -> the kernels every expert's plan runs (models/linear.py's table).
_EXPERT_PLANS = {
    ("onednn", torch.float32): {"panel"},
    ("onednn", torch.bfloat16): {"panel"},
    ("int8", torch.float32): {"gemv_int8", "int8"},
    ("int8", torch.bfloat16): {"gemv_int8", "int8"},
}
# The relative error each allows against F.linear on the model dtype's weights: float32 sums in
# another order; bfloat16 rounds the activations between GEMMs; int8 rounds weights and inputs.
_EXPERT_ERROR = {("onednn", torch.float32): 1e-6, ("onednn", torch.bfloat16): 2e-2}
_EXPERT_ERROR[("int8", torch.float32)] = _EXPERT_ERROR[("int8", torch.bfloat16)] = 3e-2


# (moe_intermediate_size, hidden_size, top k) of the expert tests: the family's (gate/up halves
# of half a panel: the one call's two-barrier form at every row count) and whole-panel halves
# (from 64 assignments moe_experts.cpp's moe_fused, SiLU * up and the weighted sums in the
# panels' epilogues) with a hidden size of one and a half panels and 4 products a token to sum
# in order.
_EXPERT_SHAPES = [(32, 64, 2), (128, 96, 4)]


def _prepared_twice(
    name: str,
    kind: LinearKind,
    dtype: torch.dtype,
    root: Path,
    native_kernels: NativeKernels,
    **overrides: Any,
) -> tuple[Any, Any]:
    """(the family's model prepared as `kind`, the same model left on F.linear); skips where the
    CPU has no kernel of `kind` for `dtype`."""
    gemv = native_kernels.gemv
    if kind == "onednn" and not gemv.panel_rows[dtype]:
        pytest.skip(f"no {dtype} panel GEMM on this CPU")
    if kind == "int8" and not has_int8_gemm():
        pytest.skip("no VNNI int8 dot products on this CPU")
    _, folder = _checkpoint(name, root, **overrides)
    ref, _ = load_model(folder, dtype, torch.device("cpu"), "auto", seed=0)
    model, _ = load_model(folder, dtype, torch.device("cpu"), "auto", seed=0)
    prepare_linears(model, kind, NativeLinear(gemv, second_layouts=kind == "int8"))
    return model, ref


@pytest.mark.parametrize(("inter", "hidden", "top_k"), _EXPERT_SHAPES)
@pytest.mark.parametrize(("kind", "dtype"), list(_EXPERT_PLANS))
def test_moe_experts_run_the_dense_layers_plan(
    kind: LinearKind,
    dtype: torch.dtype,
    inter: int,
    hidden: int,
    top_k: int,
    tmp_path: Path,
    native_kernels: NativeKernels,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each expert's gate/up and down are Linear layers, so prepare_linears gives them the dense
    # layers' kernels, each weight held once in its kernel's layout; the block's output stays
    # the dense F.linear one's within the kernel's precision, at a decode step's rows (1-2 rows
    # per expert: the int8 GEMV) and a prefill's (several per expert); one row either side of
    # 64 assignments (from there the one call's fused form, where gate/up's halves are whole
    # panels) and of 512 (from there the other form's threads share the gather and the weighted
    # sums); 700: over 128 rows per expert, the panel loop's most, in chunks. The one native
    # call runs
    # the panels at every row count and the int8 GEMV at 1-2 rows per expert (more: the
    # per-expert calls), and gives the per-expert calls' bits.
    if kind == "int8" and (inter, hidden, top_k) != _EXPERT_SHAPES[0]:
        pytest.skip("int8 experts: 1-2 rows per expert, one shape is enough")
    shape = {"moe_intermediate_size": inter, "hidden_size": hidden, "num_experts_per_tok": top_k}
    model, ref = _prepared_twice("qwen3-moe", kind, dtype, tmp_path, native_kernels, **shape)
    block, want_block = model.model.layers[0].ffn, ref.model.layers[0].ffn
    assert isinstance(block, SparseMoE) and isinstance(want_block, SparseMoE)
    assert isinstance(block.experts, torch.nn.ModuleList)
    for expert in block.experts:
        assert isinstance(expert, Expert)
        for linear in (expert.gate_up_proj, expert.down_proj):
            assert {r.kernel for r in linear.plan} == _EXPERT_PLANS[kind, dtype]
            assert linear.weight.numel() == 0, "one copy: the kernel's"
    assert block.panels is not None
    assert block.panels.kernel == ("gemv_int8" if kind == "int8" else "panel")
    ran: list[bool] = []
    one_call = native_kernels.ops.moe_layer

    def spied(*args: Any) -> tuple[torch.Tensor, list[int]] | None:
        ran.append((done := one_call(*args)) is not None)
        return done

    monkeypatch.setattr(native_kernels.ops, "moe_layer", spied)
    g = torch.Generator().manual_seed(0)
    counts = (1, 2, 63 // top_k, 64 // top_k, 37, 511 // top_k, 512 // top_k, 300, 700)
    for rows in counts:
        x = torch.randn(rows, hidden, generator=g).to(dtype)
        with torch.no_grad():
            got, want = block.mix(x, native_kernels.ops), want_block.mix(x)
            assert any(ran) == (rows <= 2 or kind != "int8")
            ran.clear()
            panels, block.panels = block.panels, None  # the per-expert calls
            assert torch.equal(got, block.mix(x, native_kernels.ops))
            block.panels = panels
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < _EXPERT_ERROR[kind, dtype], err
    assert sum(block.take_counts()) == sum(counts) * top_k * 2  # each path counts


@pytest.mark.parametrize(("kind", "dtype"), list(_EXPERT_PLANS))
def test_gpt_oss_experts_run_the_dense_layers_plan(
    kind: LinearKind,
    dtype: torch.dtype,
    tmp_path: Path,
    native_kernels: NativeKernels,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # gpt-oss's experts load stacked, then become one module each of two biased Linear layers,
    # the stacked tensors released: prepare_linears gives them the dense layers' kernels, each
    # weight held once, and the block's output stays the dense F.linear one's within the
    # kernel's precision (the clamped SwiGLU between them on PyTorch's ops), at a decode step's
    # rows and a prefill's. On panel copies each projection is one call over every expert.
    model, ref = _prepared_twice("gpt-oss", kind, dtype, tmp_path, native_kernels)
    assert not any("experts.w13" in name for name, _ in model.named_parameters())
    block, want_block = model.model.layers[0].ffn, ref.model.layers[0].ffn
    assert isinstance(block, SparseMoE) and isinstance(want_block, SparseMoE)
    assert isinstance(block.experts, torch.nn.ModuleList) and block.panels is None
    for expert in block.experts:
        assert isinstance(expert, GptOssExpert)
        for linear in (expert.gate_up_proj, expert.down_proj):
            assert {r.kernel for r in linear.plan} == _EXPERT_PLANS[kind, dtype]
            assert linear.weight.numel() == 0, "one copy: the kernel's"
    ran: list[int] = []
    one_call = native_kernels.ops.grouped_panels

    def spied(*args: Any) -> torch.Tensor:
        ran.append(1)
        return one_call(*args)

    monkeypatch.setattr(native_kernels.ops, "grouped_panels", spied)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 5, 37, 300):
        x = torch.randn(rows, block.router.shape[1], generator=g).to(dtype)
        with torch.no_grad():
            got, want = block.mix(x, native_kernels.ops), want_block.mix(x)
            # Panel experts: each projection one call over all experts, the per-expert values.
            assert len(ran) == (2 if kind == "onednn" else 0)
            ran.clear()
            assert torch.equal(got, block.mix(x))
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < _EXPERT_ERROR[kind, dtype], err


def test_unsupported_architecture_is_named_before_its_fields() -> None:
    # DeepSeek V3's config has fields inferd does not read (multi-head latent attention): the
    # error names the architecture and lists the supported ones, not the first odd field.
    config = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}
    with pytest.raises(ModelLoadError) as err:
        ArchConfig.from_dict(config)
    assert "DeepseekV3ForCausalLM" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def _mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*shape, 16] and scales `shape` (2^-7 .. 2^-4: small weights)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.int32)
    scales = torch.randint(120, 124, shape, generator=gen, dtype=torch.int32)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_dequantization_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 8, 4), torch.Generator().manual_seed(0))
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble, both halves
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), theirs.transpose(1, 2))


def test_gpt_oss_mxfp4_sharded_checkpoint_matches_transformers(tmp_path: Path) -> None:
    # The Hub's layout: experts as MXFP4 blocks + scales, `quantization_config.quant_method`
    # mxfp4, sharded with an index. transformers' model holds the same experts dequantized.
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, folder = _checkpoint("gpt-oss-3l-tied", tmp_path)
    tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    gen = torch.Generator().manual_seed(5)
    cfg = hf.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for n, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj, shape in (
                ("gate_up_proj", (e, 2 * i, h // 32)),
                ("down_proj", (e, h, i // 32)),
            ):
                blocks, scales = _mxfp4(shape, gen)
                getattr(experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
                name = f"model.layers.{n}.mlp.experts.{proj}"
                del tensors[name]
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    out = tmp_path / "mxfp4"
    out.mkdir()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, out / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (out / "config.json").write_text(json.dumps(config))
    model, arch = load_model(out, torch.float32, torch.device("cpu"), "auto", seed=0)
    assert arch.moe is not None and arch.moe.mxfp4 and arch.quantization is None
    ids = _prompt(arch.vocab_size, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=1e-4, rtol=1e-4)
