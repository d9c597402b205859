"""The sampler: logits [N, V] -> one token id per row (+ logprobs when asked), all batched.

Order, as in vLLM v1:
  raw logprobs (log_softmax of the model's logits, before anything below)
  -> min_tokens -> repetition / frequency / presence penalties
  -> greedy rows: argmax
  -> random rows: temperature -> min_p -> top_k -> top_p -> exponential race.

Hot-path rules: every op is one batched tensor op over [N, V], skipped when no row needs it
(see SamplingMetadata); the only per-row Python loop draws noise for seeded rows with their own
generators; nothing reads a device value back until the caller reads the token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inferd.sampling.metadata import SamplingMetadata, SamplingRow
from inferd.sampling.penalties import apply_min_tokens, apply_penalties
from inferd.types import Logprob, SampleLogprobs

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A row's own random stream: the same seed gives the same tokens whatever shares the batch."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class LogprobsLists:
    """LogprobsTensors read back to the host, one list entry per row."""

    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]
    sampled_logprobs: list[float]
    sampled_ranks: list[int]

    def sample_logprobs(self, row: int, token_id: int, num_logprobs: int) -> SampleLogprobs:
        """The sampled token plus the row's top `num_logprobs` tokens.

        The top entries are written last, so a sampled token that is also among them keeps its
        position in the top list as its rank (vLLM's convention; the two differ only on ties).
        """
        out = {token_id: Logprob(self.sampled_logprobs[row], self.sampled_ranks[row])}
        ids = self.top_token_ids[row][:num_logprobs]
        lps = self.top_logprobs[row][:num_logprobs]
        for rank, (tid, lp) in enumerate(zip(ids, lps, strict=True), start=1):
            out[tid] = Logprob(lp, rank)
        return out


@dataclass
class LogprobsTensors:
    """Logprobs of the raw model logits. N rows, K = the largest logprobs any row asked for."""

    top_token_ids: Tensor  # [N, K] int64, most likely first
    top_logprobs: Tensor  # [N, K] float32
    sampled_logprobs: Tensor  # [N] float32
    sampled_ranks: Tensor  # [N] int64; 1 + number of tokens strictly more likely

    def tolist(self) -> LogprobsLists:
        return LogprobsLists(
            top_token_ids=self.top_token_ids.tolist(),
            top_logprobs=self.top_logprobs.tolist(),
            sampled_logprobs=self.sampled_logprobs.tolist(),
            sampled_ranks=self.sampled_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] int64
    logprobs: LogprobsTensors | None = None  # None when no row asked for logprobs

    def to_sample_logprobs(
        self, rows: Sequence[SamplingRow], token_ids: list[int] | None = None
    ) -> list[SampleLogprobs | None]:
        """Per row: its SampleLogprobs, or None where params.logprobs is None.

        Pass `token_ids` when the caller has read them back already, to save one device sync.
        """
        if self.logprobs is None:
            return [None] * len(rows)
        ids = self.token_ids.tolist() if token_ids is None else token_ids
        lists = self.logprobs.tolist()
        return [
            None
            if r.params.logprobs is None
            else lists.sample_logprobs(i, ids[i], r.params.logprobs)
            for i, r in enumerate(rows)
        ]


class Sampler:
    """Samples one token per row. `logits` is consumed: it is modified in place.

    `argmax` (optional): a native argmax over CPU logits in the model dtype (FusedOps.argmax).
    A batch whose rows are all greedy with nothing to apply to their logits (`plain_greedy`)
    takes it on the logits as they are; everything else runs on a float32 copy."""

    def __init__(self, argmax: Callable[[Tensor], Tensor] | None = None) -> None:
        self.argmax = argmax

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if self.argmax is not None and meta.plain_greedy and logits.device.type == "cpu":
            return SamplerOutput(token_ids=self.argmax(logits))
        logits = logits.float()
        # Raw logprobs (vLLM v1's default): before penalties, temperature and filters.
        raw = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.min_tokens_index is not None:
            logits = apply_min_tokens(logits, meta.min_tokens_index)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        token_ids = self._sample(logits, meta)
        if raw is None or meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        return SamplerOutput(token_ids, gather_logprobs(raw, token_ids, meta.max_num_logprobs))

    def _sample(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        # Taken before the random-path ops below change `logits` in place.
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        logits = apply_random_filters(logits, meta)
        draw = exponential_race if logits.is_cuda else inverse_cdf
        sampled = draw(logits.softmax(dim=-1), meta.generators, meta.num_unseeded_random > 0)
        if greedy is None:
            return sampled
        assert meta.greedy_mask is not None
        return torch.where(meta.greedy_mask, greedy, sampled)


def apply_random_filters(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Temperature, then min_p, then top_k and top_p, each only if some row uses it."""
    if meta.temperature is not None:
        logits.div_(meta.temperature.unsqueeze(1))
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_p is not None:
        return apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    if meta.top_k is not None:
        return apply_top_k(logits, meta.top_k, meta.max_top_k)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drops tokens with p < min_p * p_max.

    Softmax is monotone with one normalizer per row, so this is logit < max_logit + log(min_p):
    no softmax needed. min_p = 0 gives log 0 = -inf, which drops nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Keeps each row's k largest logits (ties at the k-th value are all kept).

    top_k: [N] in [1, V], where V (> max_top_k) means off. topk(max_top_k) is far cheaper than a
    full sort when k is small.
    """
    top = logits.topk(max_top_k, dim=-1).values  # [N, max_top_k], descending
    kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [N, 1]
    kth.masked_fill_((top_k > max_top_k).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor) -> Tensor:
    """Top-k (if given) then top-p over one ascending sort of each row.

    Top-p keeps the smallest set of most likely tokens whose mass reaches p, renormalized after
    top-k: in ascending order a token is dropped when the cumulative mass up to and including it
    is <= 1 - p. The most likely token is always kept. Rows with p = 1 drop nothing.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [N, V]
    if top_k is not None:
        # top_k in [1, V]: the k-th largest sits at ascending position V - k.
        kth = sorted_logits.gather(1, (sorted_logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    cut = (1.0 - top_p).masked_fill_(top_p >= 1.0, -1.0).unsqueeze(1)
    drop = cum <= cut
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def exponential_race(
    probs: Tensor, generators: dict[int, torch.Generator], draw_unseeded: bool
) -> Tensor:
    """argmax(probs / q), q ~ Exponential(1) i.i.d.: an exact sample from each row of `probs`.

    (argmax_i p_i / q_i is argmin_i q_i / p_i, the first of N exponential clocks with rates p_i to
    ring, which is i with probability p_i.) Seeded rows draw their q with their own generator over
    exactly V values, so their stream does not depend on the rest of the batch. Consumes `probs`.
    """
    q = torch.empty_like(probs)
    if draw_unseeded:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # q = 0 would turn a banned token's 0 / 0 into NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def inverse_cdf(
    probs: Tensor, generators: dict[int, torch.Generator], draw_unseeded: bool
) -> Tensor:
    """One uniform per row, looked up in the row's cumulative distribution: the CPU path.

    On CPU, V exponentials per row (the race above; torch.multinomial draws the same way) cost
    ~30 ms for 64 rows of a 32k vocabulary, while a cumulative sum and one uniform per row cost a
    few ms. Seeded rows draw their uniform with their own generator, so their stream does not
    depend on the rest of the batch.
    """
    cdf = probs.cumsum_(dim=-1)  # [N, V], consumes probs
    u = (
        torch.rand(cdf.shape[0], 1, dtype=cdf.dtype)
        if draw_unseeded
        else cdf.new_zeros(cdf.shape[0], 1)
    )
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=cdf.dtype)
    # Scale by the row total (~1 up to rounding); a token with zero probability has a flat CDF
    # step, which searchsorted(right=True) never lands on.
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return idx.clamp_max_(cdf.shape[1] - 1)


def skip_draws(gen: torch.Generator, num_rows: int, vocab_size: int) -> None:
    """Advances a seeded row's generator as `num_rows` sampled rows would: exactly the draws of
    `exponential_race` on CUDA, of `inverse_cdf` elsewhere (keep the three in step). Speculative
    decoding rewinds a generator to before its verified rows, then replays the rows it kept."""
    for _ in range(num_rows):
        if gen.device.type == "cuda":
            torch.empty(vocab_size, device=gen.device).exponential_(generator=gen)
        else:
            torch.rand(1, generator=gen, dtype=torch.float32)


def gather_logprobs(raw_logprobs: Tensor, token_ids: Tensor, k: int) -> LogprobsTensors:
    """Top-k logprobs of each row, and the sampled token's logprob and rank."""
    k = min(k, raw_logprobs.shape[-1])
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
    else:
        n = raw_logprobs.shape[0]
        top_lp = raw_logprobs.new_empty((n, 0))
        top_ids = token_ids.new_empty((n, 0))
    return LogprobsTensors(
        top_token_ids=top_ids,
        top_logprobs=top_lp,
        sampled_logprobs=sampled.squeeze(1),
        sampled_ranks=ranks,
    )
