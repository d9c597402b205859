"""Speculative decoding with a draft model changes no output, and both KV pools come back.

The target is test_spec_decode_vs_plain's cycling checkpoint (embeddings x30); the draft is cut
from it (`write_truncated_draft`: its embeddings, first decoder layer, final norm and lm_head),
so it agrees with the target on some tokens and not on others: its acceptance is measured, and
both accepted and rejected drafts must occur. Requests run under continuous batching with
chunked prefill, prefix caching and a pool small enough to preempt (the draft's state of a
preempted request is dropped and rebuilt), each against the same engine without speculation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from hf_cases import save_checkpoint
from test_spec_decode_vs_plain import (
    _check_drained,
    _choices,
    _cycling_checkpoint,
    _engine,
    _run,
    _workload,
)

from inferd import LLMEngine, SamplingParams
from inferd.errors import ModelLoadError
from inferd.models.tiny import write_truncated_draft
from inferd.spec_decode.draft_model import DraftModelProposer


def _draft_spec(draft: Path) -> dict[str, Any]:
    # A fixed k: which drafts run must not depend on step timings.
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 3,
        "adaptive": False,
    }


def _target_and_draft(name: str, root: Path) -> tuple[Path, Path]:
    path = _cycling_checkpoint(name, root)
    return path, write_truncated_draft(path, root / f"{name}-draft", num_layers=1)


def _check_draft_drained(engine: LLMEngine) -> None:
    """The target's pool and the draft's: every block free, no draft state left."""
    _check_drained(engine)
    assert engine.drafter is not None
    proposer = engine.drafter.proposer
    assert isinstance(proposer, DraftModelProposer)
    proposer.blocks.check_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks, "a draft block leaked"
    assert proposer.num_seqs == 0


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_outputs_equal_without_speculation(name: str, tmp_path: Path) -> None:
    path, draft = _target_and_draft(name, tmp_path)
    prompts = _workload()
    # Lengths that end mid-draft (not multiples of k + 1), two choices each.
    params = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True, n=2)
    want = _run(_engine(path, None), prompts, params)
    engine = _engine(path, _draft_spec(draft))
    got = _run(engine, prompts, params)

    assert _choices(got) == _choices(want)
    assert engine.drafter is not None
    counters = engine.drafter.counters
    assert counters.num_accepted_tokens > 0, "no draft was accepted"
    assert counters.num_draft_tokens > counters.num_accepted_tokens, "no draft was rejected"
    # The scenario really chunked, preempted and hit the prefix cache.
    assert sum(out.metrics.num_preemptions for out in got.values()) > 0
    assert engine.scheduler.prefix_cache.hits > 0
    assert any(s.num_prefill_tokens == 32 for s in engine.step_stats.steps)
    _check_draft_drained(engine)


def test_sampled_outputs_equal_without_speculation(tmp_path: Path) -> None:
    """Seeded sampling, n = 2, and a stop string that ends a request within a step's accepted
    drafts: the same tokens and text as without drafts."""
    path, draft = _target_and_draft("llama", tmp_path)
    prompts = _workload()
    params = SamplingParams(temperature=0.3, top_k=20, seed=11, n=2, max_tokens=40, ignore_eos=True)
    plain = _run(_engine(path, None), prompts, params)
    text = plain["1"].outputs[0].text
    params = dataclasses.replace(params, stop=[text[len(text) // 2 : len(text) // 2 + 3]])
    want = _run(_engine(path, None), prompts, params)
    engine = _engine(path, _draft_spec(draft))
    got = _run(engine, prompts, params)

    assert _choices(got) == _choices(want)
    assert any(c.finish_reason == "stop" for out in got.values() for c in out.outputs)
    assert engine.drafter is not None and engine.drafter.counters.num_accepted_tokens > 0
    _check_draft_drained(engine)


def test_abort_mid_run_frees_the_draft_pool(tmp_path: Path) -> None:
    path, draft = _target_and_draft("llama", tmp_path)
    engine = _engine(path, _draft_spec(draft))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(_workload()):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(12):
        engine.step()
    assert engine.drafter is not None and engine.drafter.counters.num_drafts > 0
    engine.abort_request([str(i) for i in range(len(_workload()))])
    while engine.has_unfinished_requests():
        engine.step()
    _check_draft_drained(engine)


def test_vocab_mismatch_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint("LlamaConfig", {}, tmp_path / "target", seed=1)
    other = save_checkpoint("LlamaConfig", {"vocab_size": 512}, tmp_path / "draft", seed=1)
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match=r"vocab_size 512.* 384"):
        _engine(path, spec)
