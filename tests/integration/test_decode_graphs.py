"""The static-buffer decode path that CUDA graphs replay gives the same tokens as the eager path.

On a GPU the path is captured into graphs; here it runs eagerly (`capture=False`), which checks
the part that can go wrong without a GPU: bucketing, padded rows and the scratch block.
"""

from __future__ import annotations

import random

import pytest
import torch
from varlen_reference import reference_varlen

from inferd import LLM, SamplingParams
from inferd.models.attention import varlen
from inferd.models.attention.varlen import VarlenBatch


def _generate(llm: LLM) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(n)]}
        for n in (3, 40, 17, 90, 5)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 33, 12, 25)
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # type: ignore[arg-type]


def test_static_decode_path_matches_eager() -> None:
    llm = LLM(dtype="float32", device="cpu", block_size=8, max_num_seqs=8)
    eager = _generate(llm)
    engine = llm.llm_engine
    engine.runner.enable_decode_graphs(engine.max_model_len, 8, capture=False)
    static = _generate(llm)
    assert static == eager
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.graphs, "no decode step used the static path"
    # Padded rows wrote only to the scratch block, which no request owns.
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_static_decode_path_varlen_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # The batch a half-precision CUDA graph hands the varlen kernel (each row's padded span of
    # block slots, seqused_k = its context), checked on the CPU with the kernel replaced by its
    # per-sequence reference.
    calls = [0]

    def counted(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vb: VarlenBatch, scale: float
    ) -> torch.Tensor:
        calls[0] += 1
        assert vb.seqused_k is not None and vb.max_q == 1
        return reference_varlen(q, k, v, vb, scale)

    monkeypatch.setattr(varlen, "varlen_attention", counted)
    llm = LLM(
        dtype="float32", device="cpu", block_size=8, max_num_seqs=8, attention_backend="torch"
    )
    eager = _generate(llm)
    engine = llm.llm_engine
    engine.runner.enable_decode_graphs(engine.max_model_len, 8, capture=False)
    assert engine.runner.decode_graphs is not None
    engine.runner.decode_graphs.varlen = True
    assert _generate(llm) == eager
    assert calls[0] > 0, "no decode step took the varlen call"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_match_eager_on_cuda(dtype: str) -> None:
    # Each engine gets a small explicit KV budget: the default takes 90 % of the card, which
    # leaves nothing for a second engine in this process.
    # In bfloat16 the graphs' attention is the varlen kernel over padded spans, the eager steps'
    # the same kernel over packed contexts.
    kwargs = dict(
        dtype=dtype, device="cuda", block_size=8, max_num_seqs=8, kv_cache_memory=64 << 20
    )
    eager = _generate(LLM(enforce_eager=True, **kwargs))  # type: ignore[arg-type]
    llm = LLM(**kwargs)  # type: ignore[arg-type]
    assert _generate(llm) == eager
    graphs = llm.llm_engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    assert graphs.varlen == (dtype == "bfloat16")
    # Several batch buckets were captured (5 requests finishing one by one) and replayed.
    assert len(graphs.graphs) >= 3, graphs.graphs.keys()
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
