"""Sampler and SamplingMetadata against straightforward per-row references (numpy, Hugging Face)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from inferd.sampling.metadata import SamplingMetadata, SamplingRow, token_counts
from inferd.sampling.params import SamplingParams
from inferd.sampling.penalties import apply_penalties
from inferd.sampling.sampler import (
    Sampler,
    apply_min_p,
    apply_random_filters,
    apply_top_k,
    apply_top_k_top_p,
    make_generator,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def _row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: frozenset[int] = frozenset(),
) -> SamplingRow:
    gen = None if params.seed is None else make_generator(params.seed, CPU)
    return SamplingRow(params, list(prompt), list(output), eos, gen)


def _meta(rows: Sequence[SamplingRow], vocab_size: int) -> SamplingMetadata:
    return SamplingMetadata.build(rows, vocab_size, CPU)


def _logits(n: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


# ---- filters against per-row references ----


def _ref_top_k(row: np.ndarray, k: int) -> np.ndarray:
    """Keep mask: the k largest values (and ties with the k-th)."""
    if k <= 0 or k >= row.size:
        return np.isfinite(row)
    kth = np.sort(row)[::-1][k - 1]
    return row >= kth


def _ref_top_p(row: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(keep mask, ambiguous mask): keep a token if the mass strictly above it is < p."""
    probs = _softmax(row.astype(np.float64))
    order = np.argsort(-probs, kind="stable")
    above = np.zeros_like(probs)
    above[order] = np.cumsum(probs[order]) - probs[order]
    keep = (above < p) | (p >= 1.0)
    keep[order[0]] = True
    return keep & np.isfinite(row), np.abs(above - p) < 1e-5


def _ref_min_p(row: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    probs = _softmax(row.astype(np.float64))
    threshold = min_p * probs.max()
    return probs >= threshold, np.abs(probs - threshold) <= 1e-5 * threshold


def _assert_masked(got: torch.Tensor, original: torch.Tensor, keep: np.ndarray) -> None:
    """Kept entries unchanged, the others -inf (ambiguous entries already excluded by caller)."""
    g = got.numpy()
    assert np.array_equal(np.isfinite(g), keep)
    assert np.array_equal(g[keep], original.numpy()[keep])


TOP_KS = [0, 1, 2, 5, 17, 40, 64, 1000]


def test_top_k_matches_reference() -> None:
    v = 64
    logits = _logits(len(TOP_KS), v)
    meta = _meta([_row(SamplingParams(top_k=k)) for k in TOP_KS], v)
    assert meta.top_k is not None and meta.max_top_k == 40
    got = apply_top_k(logits.clone(), meta.top_k, meta.max_top_k)
    keep = np.stack([_ref_top_k(logits[i].numpy(), k) for i, k in enumerate(TOP_KS)])
    _assert_masked(got, logits, keep)
    assert (np.isfinite(got.numpy()).sum(1) == [min(k, v) if k else v for k in TOP_KS]).all()


def test_top_k_through_sort_path_matches_topk_path() -> None:
    v = 64
    logits = _logits(len(TOP_KS), v, seed=1)
    meta = _meta([_row(SamplingParams(top_k=k)) for k in TOP_KS], v)
    assert meta.top_k is not None
    ones = torch.ones(len(TOP_KS))
    by_sort = apply_top_k_top_p(logits.clone(), meta.top_k, ones)
    by_topk = apply_top_k(logits.clone(), meta.top_k, meta.max_top_k)
    assert torch.equal(by_sort, by_topk)


@pytest.mark.parametrize("seed", range(3))
def test_top_k_top_p_matches_reference(seed: int) -> None:
    v = 50
    cases = [(0, 1.0), (0, 0.9), (0, 0.5), (0, 0.01), (10, 0.7), (3, 0.95), (25, 1.0), (0, 0.3)]
    logits = _logits(len(cases), v, seed=seed, scale=2.0)
    rows = [_row(SamplingParams(top_k=k, top_p=p)) for k, p in cases]
    meta = _meta(rows, v)
    assert meta.top_p is not None
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p).numpy()
    for i, (k, p) in enumerate(cases):
        row = logits[i].numpy().copy()
        row[~_ref_top_k(row, k)] = NEG_INF  # top-p renormalizes after top-k
        keep, ambiguous = _ref_top_p(row, p)
        sure = ~ambiguous
        assert np.array_equal(np.isfinite(got[i])[sure], keep[sure]), (k, p)
        assert np.array_equal(got[i][keep], row[keep])


def test_top_p_keeps_at_least_the_most_likely_token() -> None:
    v = 50
    logits = _logits(4, v, seed=2)
    meta = _meta([_row(SamplingParams(top_p=1e-9, top_k=k)) for k in (0, 0, 5, 1)], v)
    assert meta.top_p is not None
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p)
    keep = np.zeros((4, v), dtype=bool)
    keep[np.arange(4), logits.argmax(dim=1).numpy()] = True
    _assert_masked(got, logits, keep)


def test_min_p_matches_reference() -> None:
    v = 80
    min_ps = [0.0, 0.01, 0.1, 0.3, 0.9, 1.0]
    logits = _logits(len(min_ps), v, seed=3)
    meta = _meta([_row(SamplingParams(min_p=m)) for m in min_ps], v)
    assert meta.min_p is not None
    got = apply_min_p(logits.clone(), meta.min_p).numpy()
    for i, m in enumerate(min_ps):
        keep, ambiguous = _ref_min_p(logits[i].numpy(), m)
        sure = ~ambiguous
        assert np.array_equal(np.isfinite(got[i])[sure], keep[sure])
        assert keep.any() and np.isfinite(got[i]).any()


def test_random_filters_apply_in_vllm_order() -> None:
    """temperature -> min_p -> top_k -> top_p, each row with its own values."""
    v = 40
    params = [
        SamplingParams(temperature=0.5, min_p=0.05, top_k=12, top_p=0.8),
        SamplingParams(temperature=2.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2, top_k=30),
        SamplingParams(temperature=0.0),  # greedy: left alone by the random filters
    ]
    logits = _logits(len(params), v, seed=4)
    got = apply_random_filters(logits.clone(), _meta([_row(p) for p in params], v)).numpy()
    for i, p in enumerate(params[:3]):
        row = logits[i].numpy().astype(np.float64) / p.temperature
        keep, amb_min_p = _ref_min_p(row, p.min_p)
        row[~keep] = NEG_INF
        row[~_ref_top_k(row, p.top_k)] = NEG_INF
        keep, amb_top_p = _ref_top_p(row, p.top_p)
        sure = ~(amb_min_p | amb_top_p)
        assert np.array_equal(np.isfinite(got[i])[sure], keep[sure])
        np.testing.assert_allclose(got[i][keep], row[keep], rtol=1e-6)
    assert np.array_equal(got[3], logits[3].numpy())


# ---- penalties ----


def _hf_repetition(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        proc = RepetitionPenaltyLogitsProcessor(penalty=r.params.repetition_penalty)
        out[i : i + 1] = proc(ids, logits[i : i + 1].clone())
    return out


def _openai_penalties(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    out = logits.copy()
    for i, r in enumerate(rows):
        for tok, count in Counter(r.output_token_ids).items():
            out[i, tok] -= r.params.frequency_penalty * count + r.params.presence_penalty
    return out


def _penalty_rows(v: int) -> list[SamplingRow]:
    rng = np.random.default_rng(5)

    def ids(n: int) -> list[int]:
        return rng.integers(0, v, size=n).tolist()

    return [
        _row(SamplingParams(repetition_penalty=1.3), ids(12), ids(7)),
        _row(SamplingParams(repetition_penalty=0.8), ids(5), ids(0)),
        _row(SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), ids(9), ids(20)),
        _row(SamplingParams(presence_penalty=-1.0, repetition_penalty=1.5), ids(3), ids(15)),
        _row(SamplingParams(), ids(8), ids(8)),  # no penalty: must stay bit-for-bit unchanged
        _row(SamplingParams(frequency_penalty=-2.0, temperature=0.0), [], ids(30)),
    ]


def test_penalties_match_hf_and_openai_references() -> None:
    v = 30
    rows = _penalty_rows(v)
    logits = _logits(len(rows), v, seed=6)
    meta = _meta(rows, v)
    assert meta.penalties is not None
    got = apply_penalties(logits.clone(), meta.penalties)
    expected = _openai_penalties(_hf_repetition(logits, rows).numpy(), rows)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])


def test_no_penalty_metadata_without_penalties() -> None:
    meta = _meta([_row(SamplingParams(), [1, 2], [3])], 10)
    assert meta.penalties is None


def test_penalties_change_greedy_choice() -> None:
    v = 5
    logits = torch.tensor([[0.0, 0.0, 3.0, 2.9, 0.0]])
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=1.2), [2], [])]
    assert Sampler()(logits.clone(), _meta(rows, v)).token_ids.tolist() == [3]
    rows = [_row(SamplingParams(temperature=0.0, presence_penalty=0.5), [], [2])]
    assert Sampler()(logits.clone(), _meta(rows, v)).token_ids.tolist() == [3]


def test_token_counts() -> None:
    seqs = [[1, 1, 4], [], [0, 9, 9, 9]]
    counts = token_counts(seqs, 10, CPU)
    expected = np.zeros((3, 10))
    for i, s in enumerate(seqs):
        for t, c in Counter(s).items():
            expected[i, t] = c
    assert np.array_equal(counts.numpy(), expected)


# ---- greedy, min_tokens, mixed batches ----


def test_greedy_is_argmax() -> None:
    logits = _logits(7, 100, seed=7)
    rows = [_row(SamplingParams(temperature=0.0, seed=i)) for i in range(7)]
    meta = _meta(rows, 100)
    assert meta.all_greedy and meta.temperature is None
    out = Sampler()(logits.clone(), meta)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == np.argmax(logits.numpy(), axis=1).tolist()


def test_min_tokens_blocks_eos_and_stop_ids_then_allows_them() -> None:
    v = 10
    logits = torch.arange(v, dtype=torch.float32).unsqueeze(0)  # 9 (EOS) best, then 8, 7
    eos = frozenset({9, 99})  # 99 is outside the vocabulary: ignored
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    picks = []
    for n_out in range(5):
        meta = _meta([_row(params, output=[0] * n_out, eos=eos)], v)
        assert (meta.min_tokens_index is not None) == (n_out < 3)
        picks.append(Sampler()(logits.clone(), meta).token_ids.item())
    assert picks == [7, 7, 7, 9, 9]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8], ignore_eos=True)
    meta = _meta([_row(ignore, eos=eos)], v)
    assert Sampler()(logits.clone(), meta).token_ids.item() == 9


def test_min_tokens_holds_for_random_rows() -> None:
    v = 6
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 8.0]]).repeat(500, 1)
    rows = [_row(SamplingParams(min_tokens=2), eos=frozenset({5}))] * 500
    torch.manual_seed(0)
    ids = Sampler()(logits.clone(), _meta(rows, v)).token_ids
    assert (ids != 5).all()


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    v = 50
    logits = _logits(6, v, seed=8)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(top_k=3, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.5),
    ]
    rows = [_row(p, prompt=[int(logits[i].argmax())]) for i, p in enumerate(params)]
    meta = _meta(rows, v)
    assert meta.greedy_mask is not None and meta.greedy_mask.tolist() == [p.greedy for p in params]
    penalized = _hf_repetition(logits, rows)
    out = Sampler()(logits.clone(), meta).token_ids.tolist()
    for i in (0, 2, 4):
        assert out[i] == int(penalized[i].argmax())
    assert out[3] in logits[3].topk(3).indices.tolist()


def test_metadata_flags_skip_unneeded_ops() -> None:
    meta = _meta([_row(SamplingParams(temperature=1.0)), _row(SamplingParams(seed=1))], 10)
    assert meta.all_random and not meta.all_greedy
    assert (meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.penalties) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert meta.min_tokens_index is None
    assert meta.greedy_mask is None and meta.max_num_logprobs is None
    assert list(meta.generators) == [1] and meta.num_unseeded_random == 1


def test_seed_without_generator_rejected() -> None:
    row = SamplingRow(SamplingParams(seed=3), [], [])
    with pytest.raises(ValueError, match="generator"):
        _meta([row], 10)


# ---- seeded reproducibility ----


def _run_steps(
    params: Sequence[SamplingParams], v: int, steps: int, logits_fn: Any
) -> list[list[int]]:
    """Samples `steps` tokens for every row; row i's logits at step s are logits_fn(i, s)."""
    rows = [_row(p, prompt=[1, 2, 3]) for p in params]
    sampler = Sampler()
    for s in range(steps):
        logits = torch.stack([logits_fn(p, s) for p in params])
        ids = sampler(logits, _meta(rows, v)).token_ids.tolist()
        for r, t in zip(rows, ids, strict=True):
            r.output_token_ids.append(t)
    return [r.output_token_ids for r in rows]


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch() -> None:
    v, steps = 64, 40
    table = {}

    def logits_fn(p: SamplingParams, step: int) -> torch.Tensor:
        # Each row's logits depend only on its own identity and the step.
        key = (id(p), step)
        if key not in table:
            table[key] = _logits(1, v, seed=hash(key) % 2**31, scale=2.0)[0]
        return table[key]

    a = SamplingParams(temperature=0.9, seed=1234)
    b = SamplingParams(temperature=0.7, top_p=0.9, seed=99)
    others = [
        SamplingParams(top_k=5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(min_p=0.1, top_p=0.5, presence_penalty=1.0),
        SamplingParams(temperature=1.3, seed=7, min_tokens=10),
    ]
    torch.manual_seed(1)
    alone_a = _run_steps([a], v, steps, logits_fn)[0]
    torch.manual_seed(2)
    alone_b = _run_steps([b], v, steps, logits_fn)[0]
    torch.manual_seed(3)
    batched = _run_steps([others[0], b, others[1], a, others[2], others[3]], v, steps, logits_fn)
    assert batched[3] == alone_a
    assert batched[1] == alone_b
    torch.manual_seed(4)
    reordered = _run_steps([a, *others, b], v, steps, logits_fn)
    assert reordered[0] == alone_a and reordered[-1] == alone_b
    other_seed = _run_steps([SamplingParams(temperature=0.9, seed=4321)], v, steps, logits_fn)
    assert other_seed[0] != alone_a


# ---- statistics ----


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum())


# Chi-square critical value for <= 9 degrees of freedom at p = 1e-4 is ~33.7.
_CHI2_LIMIT = 34.0


def _draw_many(params: SamplingParams, logits_row: torch.Tensor, n: int) -> np.ndarray:
    v = logits_row.shape[0]
    meta = _meta([_row(params)] * n, v)
    ids = Sampler()(logits_row.repeat(n, 1), meta).token_ids.numpy()
    return np.bincount(ids, minlength=v)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.7, top_k=4),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(min_p=0.2),
    ],
)
def test_unseeded_distribution_matches_softmax(params: SamplingParams) -> None:
    torch.manual_seed(123)
    logits_row = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.8])
    counts = _draw_many(params, logits_row, 40_000)
    row = logits_row.numpy().astype(np.float64) / params.temperature
    keep, _ = _ref_min_p(row, params.min_p)
    row[~keep] = NEG_INF
    row[~_ref_top_k(row, params.top_k)] = NEG_INF
    keep, _ = _ref_top_p(row, params.top_p)
    row[~keep] = NEG_INF
    assert _chi_square(counts, _softmax(row)) < _CHI2_LIMIT


def test_seeded_stream_distribution_matches_softmax() -> None:
    v = 6
    logits_row = torch.tensor([0.2, 1.0, -0.3, 0.7, 0.0, 1.4])
    row = _row(SamplingParams(temperature=0.9, seed=5))
    sampler = Sampler()
    ids = [
        sampler(logits_row.unsqueeze(0).clone(), _meta([row], v)).token_ids.item()
        for _ in range(4000)
    ]
    counts = np.bincount(ids, minlength=v)
    assert _chi_square(counts, _softmax(logits_row.numpy().astype(np.float64) / 0.9)) < _CHI2_LIMIT


# ---- logprobs ----


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprobs_are_raw_with_ranks() -> None:
    v = 30
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=0.5, top_k=3),
        SamplingParams(logprobs=3, temperature=0.0, presence_penalty=2.0),
        SamplingParams(logprobs=5, top_p=0.5, frequency_penalty=1.0, temperature=2.0),
    ]
    rows = [_row(p, prompt=[0, 1, 2], output=[3, 4, 4, 5]) for p in params]
    logits = _logits(len(rows), v, seed=9)
    meta = _meta(rows, v)
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits.clone(), meta)
    assert out.logprobs is not None
    ids = out.token_ids.tolist()
    for i in range(len(rows)):
        ref = _log_softmax(logits[i].numpy())  # raw: no penalty, no temperature
        order = np.argsort(-ref)
        assert out.logprobs.top_token_ids[i].tolist() == order[:5].tolist()
        np.testing.assert_allclose(out.logprobs.top_logprobs[i].numpy(), ref[order[:5]], atol=1e-5)
        np.testing.assert_allclose(out.logprobs.sampled_logprobs[i].item(), ref[ids[i]], atol=1e-5)
        assert out.logprobs.sampled_ranks[i].item() == 1 + int((ref > ref[ids[i]]).sum())

    per_row = out.to_sample_logprobs(rows)
    assert per_row[0] is None
    assert per_row == out.to_sample_logprobs(rows, ids)
    for i in (1, 2, 3):
        lp = per_row[i]
        assert lp is not None
        n = params[i].logprobs
        assert n is not None
        ref = _log_softmax(logits[i].numpy())
        top = np.argsort(-ref)[:n].tolist()
        assert set(lp) == {ids[i], *top}
        for rank, t in enumerate(top, start=1):
            assert lp[t].rank == rank
        assert lp[ids[i]].rank == 1 + int((ref > ref[ids[i]]).sum())
        for t, entry in lp.items():
            assert entry.logprob == pytest.approx(ref[t], abs=1e-5)
            assert entry.decoded_token is None


def test_no_logprobs_when_none_asked() -> None:
    rows = [_row(SamplingParams()), _row(SamplingParams(temperature=0.0))]
    out = Sampler()(_logits(2, 10), _meta(rows, 10))
    assert out.logprobs is None
    assert out.to_sample_logprobs(rows) == [None, None]


def test_more_logprobs_than_vocabulary() -> None:
    rows = [_row(SamplingParams(logprobs=20, temperature=0.0))]
    logits = _logits(1, 6)
    out = Sampler()(logits.clone(), _meta(rows, 6))
    lp = out.to_sample_logprobs(rows)[0]
    assert lp is not None and sorted(lp) == list(range(6))
    assert sorted(e.rank for e in lp.values()) == list(range(1, 7))


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), _meta([], 10))
    assert out.token_ids.shape == (0,)


def test_min_tokens_ban_never_empties_a_row() -> None:
    from inferd.sampling.penalties import apply_min_tokens

    inf = float("-inf")
    # Row 0 has other tokens: EOS (id 1) is banned. Row 1 (a finished grammar's mask) has only
    # EOS left: it keeps it.
    logits = torch.tensor([[0.5, 2.0, 1.0], [inf, 3.0, inf]])
    index = (torch.tensor([0, 1]), torch.tensor([1, 1]))
    out = apply_min_tokens(logits, index)
    assert out.tolist() == [[0.5, inf, 1.0], [inf, 3.0, inf]]
