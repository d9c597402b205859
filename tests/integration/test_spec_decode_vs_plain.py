"""Speculative decoding (n-gram drafts) changes no output: token for token, with the same engine.

Each architecture's tiny random checkpoint gets its token embeddings scaled up (x30), so the
residual stream is mostly the current token and the model is close to a fixed map from one token
to the next: its outputs fall into cycles, which n-gram drafts predict (many drafts accepted),
after a start they do not (drafts rejected). Requests run under continuous batching with chunked
prefill, prefix caching and a KV pool small enough to preempt; the outputs must equal the same
engine's without speculation, and every block must come back.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hf_cases import save_checkpoint
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import CONFIGS, DEVICES
from test_engine_vs_hf import _engine as engine_vs_hf_engine

from inferd import LLMEngine, RequestOutput, SamplingParams
from inferd.executor.kv_pool import kv_bytes_per_block
from inferd.models.config import ArchConfig

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    # A fixed k: which drafts run must not depend on step timings, so the counts below hold.
    "adaptive": False,
}


# Every layer with an 8-token window: blocks before it go back to the pool while drafts are
# verified and rolled back (kv_cache/block_manager.py).
WINDOWED = ("MistralConfig", {"sliding_window": 8})


def _cycling_checkpoint(name: str, root: Path) -> Path:
    """The architecture's test checkpoint with its token embeddings scaled x30 (module doc)."""
    cls_name, extra = WINDOWED if name == "mistral-window" else CONFIGS[name]
    path = save_checkpoint(cls_name, extra, root / name, seed=1234)
    weights = path / "model.safetensors"
    state = load_file(weights)
    state["model.embed_tokens.weight"] *= 30.0
    save_file(state, weights, metadata={"format": "pt"})
    return path


def _engine(path: Path, spec: dict[str, Any] | None, device: str = "cpu") -> LLMEngine:
    """test_engine_vs_hf's engine (4-token blocks, 40 of them, 32-token steps) with `spec`;
    12 blocks where every layer has a window (each request then holds at most 11)."""
    if path.name != "mistral-window":
        return engine_vs_hf_engine(path, speculative_config=spec, device=device)
    memory = 12 * kv_bytes_per_block(ArchConfig.from_json(path / "config.json"), 4, torch.float32)
    return engine_vs_hf_engine(path, speculative_config=spec, device=device, kv_cache_memory=memory)


def _workload() -> list[list[int]]:
    """Prompts that repeat a short piece (n-gram matches from the first step), two sharing a
    prefix (a prefix-cache hit), one longer than a step's budget (chunked)."""
    rng = random.Random(3)
    prompts = []
    for n in (3, 41, 12, 25):
        piece = [rng.randrange(5, 380) for _ in range(max(1, n // 3))]
        prompts.append((piece * 3)[:n])
    prompts.append([*prompts[1][:36], 7, 8])
    return prompts


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    return _drain(engine)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Steps until every request finished; their last outputs by request id."""
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return results


def _choices(results: dict[str, RequestOutput]) -> dict[str, list[tuple[Any, ...]]]:
    return {
        rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
        for rid, out in results.items()
    }


def _check_drained(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    assert not engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [*sorted(CONFIGS), "mistral-window"])
def test_greedy_outputs_equal_without_speculation(name: str, device: str, tmp_path: Path) -> None:
    # On CUDA, steps with drafts run eagerly and the others replay the decode graphs.
    path = _cycling_checkpoint(name, tmp_path)
    prompts = _workload()
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    want = _run(_engine(path, None, device), prompts, params)
    engine = _engine(path, NGRAM, device)
    got = _run(engine, prompts, params)

    assert _choices(got) == _choices(want)
    counters = engine.drafter.counters if engine.drafter else None
    assert counters is not None
    assert counters.num_accepted_tokens > 0, "no draft was accepted"
    assert counters.num_draft_tokens > counters.num_accepted_tokens, "no draft was rejected"
    assert counters.accepted_per_pos[0] == max(counters.accepted_per_pos)
    # The scenario really chunked, preempted and hit the prefix cache.
    assert sum(out.metrics.num_preemptions for out in got.values()) > 0
    # (A windowed request's leading blocks are released, and evicted first in this small pool.)
    assert engine.scheduler.block_manager.window == (8 if name == "mistral-window" else None)
    assert engine.scheduler.prefix_cache.hits > 0 or name == "mistral-window"
    assert any(s.num_prefill_tokens == 32 for s in engine.step_stats.steps)
    assert any(s.num_draft_tokens for s in engine.step_stats.steps)
    _check_drained(engine)


def test_sampled_outputs_equal_without_speculation(tmp_path: Path) -> None:
    """Seeded sampling with penalties, n = 2, logprobs, and a stop string that ends requests
    within a step's accepted drafts: the same tokens, text and logprobs as without drafts."""
    path = _cycling_checkpoint("qwen3", tmp_path)
    prompts = _workload()
    params = SamplingParams(
        temperature=0.3,
        top_k=20,
        repetition_penalty=1.05,
        seed=11,
        n=2,
        logprobs=2,
        max_tokens=40,
        ignore_eos=True,
    )
    plain = _run(_engine(path, None), prompts, params)
    # A stop string that occurs late in one answer: some request then stops mid-step.
    text = plain["1"].outputs[0].text
    params = dataclasses.replace(params, stop=[text[len(text) // 2 : len(text) // 2 + 3]])
    want = _run(_engine(path, None), prompts, params)
    engine = _engine(path, NGRAM)
    got = _run(engine, prompts, params)

    assert _choices(got) == _choices(want)
    assert any(c.finish_reason == "stop" for out in got.values() for c in out.outputs)
    for rid, out in got.items():
        for c, w in zip(out.outputs, want[rid].outputs, strict=True):
            assert c.logprobs is not None and w.logprobs is not None
            assert len(c.logprobs) == len(c.token_ids)
            for lp, wlp, t in zip(c.logprobs, w.logprobs, c.token_ids, strict=True):
                assert lp[t].logprob == pytest.approx(wlp[t].logprob, abs=1e-4)
    assert engine.drafter is not None and engine.drafter.counters.num_accepted_tokens > 0
    _check_drained(engine)


def test_adaptive_k_keeps_outputs(tmp_path: Path) -> None:
    """With the adaptive rule on (k chosen from timings), outputs still equal."""
    path = _cycling_checkpoint("llama", tmp_path)
    prompts = _workload()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _run(_engine(path, None), prompts, params)
    engine = _engine(path, {**NGRAM, "adaptive": True})
    assert _choices(_run(engine, prompts, params)) == _choices(want)
    _check_drained(engine)
