"""Speculative decoding's parts on their own: the n-gram rule, the adaptive k rule, the draft
verification's output distribution (chi-square), the scheduler's draft budget, the config, the
counters on /metrics and the dashboard."""

from __future__ import annotations

import argparse

import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram
from scipy.stats import chisquare
from test_scheduler import EOS, make_request, make_scheduler

from inferd.config import EngineConfig, SpeculativeConfig
from inferd.engine_args import parse_json_object
from inferd.executor.spec_verify import Rewind, accept, draft_rows, num_accepted
from inferd.sampling.metadata import SamplingMetadata, SamplingRow
from inferd.sampling.params import SamplingParams
from inferd.sampling.sampler import Sampler, make_generator
from inferd.scheduler.output import ScheduledChunk
from inferd.scheduler.scheduler import Scheduler
from inferd.spec_decode.ngram import NgramProposer
from inferd.spec_decode.policy import (
    AdaptiveK,
    expected_tokens,
    recovered_acceptance,
    updated_acceptance,
)
from inferd.telemetry.metrics import EngineGauges, ServerMetrics, parse_samples
from inferd.telemetry.overview import BatchTotals, HistogramTotals, overview
from inferd.telemetry.request_log import RequestLog
from inferd.types import ModelRunnerOutput

# -- n-gram rule -------------------------------------------------------------------------------


def test_ngram_takes_the_longest_suffix_then_its_latest_occurrence() -> None:
    p = NgramProposer(1, 3)
    # [1, 2, 3] occurs at 0 (followed by 9) ; the 1-gram [3] also occurs at 5 (followed by 4).
    assert p.propose([1, 2, 3, 9, 9, 3, 4, 1, 2, 3], k=2) == [9, 9]
    # Only 1-grams match: the latest earlier [5] is followed by 7.
    assert p.propose([5, 6, 5, 7, 8, 5], k=3) == [7, 8, 5]
    assert p.propose([5, 6, 5, 7, 8, 5], k=1) == [7]


def test_ngram_proposes_nothing_without_a_match() -> None:
    assert NgramProposer(1, 3).propose([1, 2, 3, 4], k=4) == []
    assert NgramProposer(2, 3).propose([1, 2, 1], k=4) == []  # only a 1-gram repeats
    assert NgramProposer(1, 3).propose([1, 2, 1], k=0) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# -- adaptive k --------------------------------------------------------------------------------


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_single_stream_speculates_and_a_full_batch_does_not() -> None:
    k = AdaptiveK(k_max=4)
    assert k.choose(None, 1) == 0, "the first step measures a step without drafts"
    k.observe_step(draft_rows=0, seconds=0.010)
    assert k.choose(None, 1) == 4, "c unmeasured: try k_max"
    # A weight-bound step: 4 more rows cost 0.4 ms beside a 10 ms step (N c / D = 0.01).
    k.observe_step(draft_rows=4, seconds=0.0104)
    assert k.choose(0.8, 1) == 4
    assert k.choose(0.05, 1) == 1  # 0.05 > 0.01 but 0.05^2 < 0.01
    assert k.choose(0.005, 1) == 0
    # 64 streams: a row costs as much as a token (compute-bound): N c / D = 1.
    full = AdaptiveK(k_max=4, decode_s=0.1, row_s=0.0016)
    assert full.choose(0.9, 64) == 0
    # 16 streams: N c / D = 0.256; 0.5 > 0.256 > 0.5^2.
    assert full.choose(0.5, 16) == 1


def test_a_request_that_stopped_drafting_tries_again() -> None:
    k = AdaptiveK(k_max=3, decode_s=0.01, row_s=0.001)
    a: float | None = None
    for _ in range(5):
        a = updated_acceptance(a, proposed=3, accepted=0)
    assert a is not None and k.choose(a, 1) == 0
    for _ in range(40):  # steps without drafts: its acceptance drifts back to the prior
        a = recovered_acceptance(a)
    assert k.choose(a, 1) > 0
    assert recovered_acceptance(None) is None


def test_fixed_k_when_not_adaptive() -> None:
    assert AdaptiveK(k_max=2, adaptive=False).choose(0.0, 500) == 2


# -- verification: lossless ----------------------------------------------------------------------


def _chunk(drafts: list[int], seed: int | None = None) -> tuple[ScheduledChunk, SamplingRow]:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8)
    request = make_request("r", [1, 2, 3], max_tokens=8)
    request.sampling_params = params
    gen = None if seed is None else make_generator(seed, "cpu")
    row = SamplingRow(params, request.prompt_token_ids, request.output_token_ids, generator=gen)
    return ScheduledChunk(request, 2, 1 + len(drafts), [0], drafts), row


def test_verified_tokens_follow_the_target_distribution() -> None:
    """Rejection sampling with a point-mass draft: over many seeded trials, the first new token
    is distributed as p0 whatever the draft, the draft is accepted with probability p0(draft),
    and the token after an accepted draft is distributed as p1."""
    vocab, trials, draft = 6, 3000, 2
    p0 = torch.tensor([0.05, 0.1, 0.4, 0.2, 0.15, 0.1])
    p1 = torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    chunks, rows = [], []
    for seed in range(trials):
        chunk, row = _chunk([draft], seed)
        chunks.append(chunk)
        rows.extend(draft_rows(row, chunk))
    meta = SamplingMetadata.build(rows, vocab, torch.device("cpu"))
    logits = torch.stack([p0.log(), p1.log()] * trials)
    sampled = Sampler()(logits, meta).token_ids.tolist()
    tokens, _ = accept(chunks, sampled, [None] * len(sampled))
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=vocab)
    assert _pvalue(first, p0) > 1e-3
    accepted = [t for t in tokens if len(t) == 2]
    assert abs(len(accepted) / trials - p0[draft].item()) < 0.04
    second = torch.bincount(torch.tensor([t[1] for t in accepted]), minlength=vocab)
    assert _pvalue(second, p1) > 1e-3


def _pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` to the distribution `p`."""
    observed = counts.double()
    expected = p.double() / p.double().sum() * observed.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def test_rewind_leaves_a_seeded_stream_as_without_drafts() -> None:
    """After a rejection the generator stands where the kept rows alone would have left it."""
    vocab = 5
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 50.0  # every row samples 4: draft 4 is accepted, draft 0 rejected
    chunk, row = _chunk([4, 0], seed=7)
    rows = draft_rows(row, chunk)
    rewind = Rewind.of([chunk], rows, vocab)
    sampled = Sampler()(logits.clone(), SamplingMetadata.build(rows, vocab, torch.device("cpu")))
    tokens, _ = accept([chunk], sampled.token_ids.tolist(), [None] * 3)
    assert tokens == [[4, 4]]
    rewind([chunk], tokens)
    reference = make_generator(7, "cpu")
    for _ in range(2):  # the two kept rows' draws
        torch.rand(1, generator=reference)
    assert row.generator is not None
    assert torch.equal(row.generator.get_state(), reference.get_state())


def test_num_accepted() -> None:
    assert num_accepted([1, 2, 3], [1, 2, 9, 4]) == 2
    assert num_accepted([], [5]) == 0
    assert num_accepted([1, 2], [1, 2, 3]) == 2


# -- the scheduler's draft budget ----------------------------------------------------------------


def _decode_all(s: Scheduler, rids: list[str]) -> None:
    """One step in which every request in `rids` samples token 50."""
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(rids, [[50] for _ in rids]))


def test_drafts_never_take_a_later_requests_decode_token() -> None:
    s = make_scheduler(budget=4, max_seqs=4)
    reqs = [make_request(r, 1, max_tokens=10) for r in "abc"]
    for r in reqs:
        s.add_request(r)
    _decode_all(s, ["a", "b", "c"])  # prefills (1 token each) and first tokens
    # Budget 4 for three decodes: a may verify one draft (4 - 1 - 2 reserved for b and c).
    reqs[0].draft_token_ids = [7, 8, 9]
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens, c.draft_token_ids) for c in out.chunks] == [
        ("a", 2, [7]),
        ("b", 1, []),
        ("c", 1, []),
    ]
    assert reqs[0].draft_token_ids == [], "the scheduler takes the drafts"


def test_drafts_stop_at_max_tokens_and_rejected_blocks_are_freed() -> None:
    s = make_scheduler(budget=64)
    r = make_request("a", 2, max_tokens=6)
    s.add_request(r)
    _decode_all(s, ["a"])  # prompt -> first output (2 + 1 tokens)
    r.draft_token_ids = [5, 6, 7, 8, 9]
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == [5, 6, 7, 8], "at most max_tokens - outputs - 1 drafts"
    assert len(chunk.block_ids) == 2  # positions 2 .. 6
    # The first draft rejected: one new token, and the block only the drafts needed goes back.
    s.update_from_output(out, ModelRunnerOutput(["a"], [[11]]))
    assert r.output_token_ids == [50, 11] and r.num_computed_tokens == 3
    assert len(s.block_manager.block_table("a")) == 1
    s.block_manager.check_invariants()


class _EndedGrammar:
    """A grammar whose stop token was among the step's accepted drafts: the runner advanced it
    over all of the step's tokens, so it reads finished before the scheduler appends them."""

    active = False
    finished = True

    def accept(self, token_id: int) -> bool:
        return True

    def rollback_drafts(self, num_kept: int) -> int:
        return 0


def test_a_grammar_ending_within_a_step_stops_at_its_stop_token() -> None:
    s = make_scheduler(budget=64)
    r = make_request("a", 2, max_tokens=10)
    s.add_request(r)
    _decode_all(s, ["a"])
    r.grammar = _EndedGrammar()
    r.draft_token_ids = [5, EOS, 9]
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[5, EOS, 9, 4]]))
    # Not after 5 (the grammar was not finished there), and nothing after the stop token.
    assert r.output_token_ids == [50, 5, EOS] and r.is_finished
    s.block_manager.check_invariants()


# -- config --------------------------------------------------------------------------------------


def test_config_checks_its_keys() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    assert (spec.lookup_min, spec.lookup_max) == (5, 5)
    assert SpeculativeConfig(num_speculative_tokens=1).lookup_min == 1
    for bad in (
        {"method": "draft_model", "num_speculative_tokens": 2},
        {
            "method": "draft_model",
            "model": "x",
            "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 2,
        },
        {"method": "ngram", "model": "x", "num_speculative_tokens": 2},
        {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        {"num_speculative_tokens": 0},
        {"method": "eagle", "num_speculative_tokens": 2},
        {"num_speculative_tokens": 2, "unknown": 1},
    ):
        with pytest.raises(ValueError):
            EngineConfig.from_kwargs(speculative_config=bad)


def test_flag_takes_a_json_object() -> None:
    assert parse_json_object('{"num_speculative_tokens": 2}') == {"num_speculative_tokens": 2}
    for bad in ("{oops", "[1, 2]"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_json_object(bad)


# -- telemetry -----------------------------------------------------------------------------------


def test_counters_are_exported_and_the_overview_has_the_acceptance() -> None:
    gauges = EngineGauges(
        spec_decode_num_drafts_total=4,
        spec_decode_num_draft_tokens_total=10,
        spec_decode_num_accepted_tokens_total=6,
        spec_decode_accepted_per_pos=(4, 2, 0),
    )
    samples = parse_samples(ServerMetrics(lambda: gauges).render().decode())
    assert samples["inferd_spec_decode_num_drafts_total"] == 4
    assert samples["inferd_spec_decode_num_draft_tokens_total"] == 10
    assert samples["inferd_spec_decode_num_accepted_tokens_total"] == 6
    assert samples['inferd_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 2
    llm = overview(RequestLog(), 60.0, gauges, (_no_batches(), None), "tiny")["llm"]
    assert isinstance(llm, dict) and llm["engine"]["spec_decode_acceptance_rate"] == 0.6
    off = overview(RequestLog(), 60.0, EngineGauges(), (_no_batches(), None), "tiny")["llm"]
    assert isinstance(off, dict) and off["engine"]["spec_decode_acceptance_rate"] is None


def _no_batches() -> BatchTotals:
    empty = HistogramTotals.read(Histogram("h", "h", ["model"], registry=CollectorRegistry()))
    return BatchTotals(0.0, empty, empty)
