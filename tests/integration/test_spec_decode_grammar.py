"""Structured outputs under speculative decoding: a grammar mask per draft row.

The matcher's bookkeeping on the tiny model's tokenizer (each draft row gets the mask of the
state after the drafts before it; a refused draft ends the masked rows; verification's rollback
leaves the state of the drafts kept), then whole requests on the x30 cycling checkpoint of
test_spec_decode_vs_plain: a JSON schema, a regex and a free request in one batch give the same
outputs with drafts as without, greedy and seeded, with drafts both accepted and rejected and
constrained requests preempted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from test_spec_decode_vs_plain import (
    NGRAM,
    _check_drained,
    _choices,
    _cycling_checkpoint,
    _drain,
    _engine,
    _workload,
)

from inferd import LLMEngine, RequestOutput, SamplingParams
from inferd.config import read_environment
from inferd.models.loader import resolve_model_path
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.grammar import GrammarCompiler, RequestGrammar
from inferd.sampling.structured import StructuredOutputsParams as Structured
from inferd.scheduler.output import SchedulerOutput
from inferd.types import ModelRunnerOutput

VOCAB = 4096
WORDS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 4,
            "maxItems": 8,
        },
        "n": {"type": "integer"},
    },
    "required": ["words", "n"],
}


@pytest.fixture(scope="module")
def tiny() -> tuple[Tokenizer, GrammarCompiler]:
    tok = Tokenizer.from_pretrained(resolve_model_path("inferd-tiny", None, read_environment()))
    return tok, GrammarCompiler(tok.hf, VOCAB, sorted(tok.eos_token_ids))


def _mask_after(compiled: xgr.CompiledGrammar, tokens: list[int]) -> torch.Tensor:
    """The mask token-by-token decoding applies after `tokens`."""
    m = xgr.GrammarMatcher(compiled)
    for t in tokens:
        assert m.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    m.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def _allows(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_draft_rows_get_the_mask_of_the_drafts_before_them(
    tiny: tuple[Tokenizer, GrammarCompiler],
) -> None:
    tok, compiler = tiny
    compiled = compiler.submit(Structured(choice=["alpha beta gamma", "alpha delta"])).result()
    answer = tok.hf.encode("alpha beta gamma", add_special_tokens=False).ids
    eos = min(tok.eos_token_ids)
    assert len(answer) >= 3
    bitmask = xgr.allocate_token_bitmask(16, VOCAB)

    # Every draft accepted by the grammar, its stop token included: one row per draft + 1, each
    # the token-by-token mask; the grammar ended, so the drafts after the stop token are free.
    g = RequestGrammar(compiled)
    drafts = [*answer, eos, 7, 8]
    assert g.fill_draft_masks(bitmask, 3, drafts) == list(range(3, 3 + len(answer) + 1))
    for j in range(len(answer) + 1):
        assert torch.equal(bitmask[3 + j], _mask_after(compiled, answer[:j]))
    assert g.finished
    # All kept: the matcher holds those up to the stop token; the others are free tokens.
    assert g.rollback_drafts(len(drafts)) == len(answer) + 1
    assert g.finished and g.accept(8)

    # A draft the grammar refuses: its row is the last masked one, and refuses it.
    g = RequestGrammar(compiled)
    bad = next(t for t in range(VOCAB) if not _allows(_mask_after(compiled, answer[:1]), t))
    assert g.fill_draft_masks(bitmask, 0, [answer[0], bad, answer[2]]) == [0, 1]
    assert not _allows(bitmask[1], bad)
    assert g.rollback_drafts(1) == 1
    assert g.accept(answer[1])  # the state after the kept draft, then the step's sampled token
    bitmask2 = xgr.allocate_token_bitmask(1, VOCAB)
    g.matcher.fill_next_token_bitmask(bitmask2, 0)
    assert torch.equal(bitmask2[0], _mask_after(compiled, answer[:2]))

    # Verification kept none of the drafts, through the grammar's end: back to the start.
    g = RequestGrammar(compiled)
    g.fill_draft_masks(bitmask, 0, [*answer, eos])
    assert g.rollback_drafts(0) == 0
    assert not g.finished
    assert g.accept(answer[0])
    g.matcher.fill_next_token_bitmask(bitmask2, 0)
    assert torch.equal(bitmask2[0], _mask_after(compiled, answer[:1]))


def _run_mixed(engine: LLMEngine, sampling: dict[str, Any]) -> dict[str, RequestOutput]:
    """Each workload prompt as a JSON request, a regex request and a free one, in one batch."""
    kinds: dict[str, Structured | None] = {
        "json": Structured(json=WORDS, disable_any_whitespace=True),
        "regex": Structured(regex="([a-z]+ ){1,30}[a-z]+"),
        "free": None,
    }
    for i, prompt in enumerate(_workload()):
        for kind, structured in kinds.items():
            params = SamplingParams(max_tokens=70, structured_outputs=structured, **sampling)
            engine.add_request(f"{kind}{i}", {"prompt_token_ids": prompt}, params)
    return _drain(engine)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.5, "seed": 5, "n": 2}]
)
def test_structured_outputs_equal_without_speculation(
    sampling: dict[str, Any], tmp_path: Path
) -> None:
    path = _cycling_checkpoint("qwen3", tmp_path)
    want = _run_mixed(_engine(path, None), sampling)
    engine = _engine(path, NGRAM)
    assert engine.drafter is not None
    # The constrained requests' own drafts: verified, and accepted (a spy on the real counter).
    proposed = accepted = 0
    observe = engine.drafter.observe

    def spy(sched: SchedulerOutput, out: ModelRunnerOutput) -> tuple[int, int]:
        nonlocal proposed, accepted
        new = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        for c in sched.chunks:
            if c.num_drafts and c.request.grammar is not None:
                proposed += c.num_drafts
                accepted += len(new[c.request.request_id]) - 1
        return observe(sched, out)

    engine.drafter.observe = spy  # type: ignore[method-assign]
    got = _run_mixed(engine, sampling)

    assert _choices(got) == _choices(want)
    finished_json = [
        c.text
        for rid, o in got.items()
        if rid.startswith("json")
        for c in o.outputs
        if c.finish_reason == "stop"
    ]
    assert finished_json, "no JSON answer finished: the test proves less"
    for text in finished_json:
        jsonschema.validate(json.loads(text), WORDS)
    for rid, o in got.items():
        if rid.startswith("regex"):
            assert all(set(c.text) <= set("abcdefghijklmnopqrstuvwxyz ") for c in o.outputs)
    counters = engine.drafter.counters
    assert 0 < accepted <= counters.num_accepted_tokens, "no constrained draft was accepted"
    assert proposed > accepted, "no constrained draft was rejected"
    assert counters.num_draft_tokens > counters.num_accepted_tokens
    # Constrained requests were preempted too (their grammar state survives recompute).
    assert any(o.metrics.num_preemptions for rid, o in got.items() if not rid.startswith("free"))
    _check_drained(engine)
