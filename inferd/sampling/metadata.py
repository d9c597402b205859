"""Per-step sampling inputs: one batch's SamplingParams turned into tensors and flags.

Built once per step from one SamplingRow per row that samples. Every tensor is None when no row
needs the op it feeds, so the sampler skips that op entirely; rows that do not use an op that some
other row needs get its neutral value (temperature 1, top_k = V, top_p 1, min_p 0, penalties off),
which leaves their logits bit-for-bit unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from inferd.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()
    # The row's own random stream, kept by the caller across steps; required with params.seed.
    generator: torch.Generator | None = None
    # The row's logits are masked by its grammar before sampling.
    constrained: bool = False


@dataclass
class PenaltyTensors:
    """Inputs of the repetition / presence / frequency penalties. N rows, V = vocab size."""

    # [N, V] float32: how many times each token occurs in the row's output (zeros for rows
    # without any penalty).
    output_counts: Tensor
    repetition: Tensor | None = None  # [N] float32, 1.0 = off
    presence: Tensor | None = None  # [N] float32, 0.0 = off
    frequency: Tensor | None = None  # [N] float32, 0.0 = off
    # [N, V] bool: token occurs in the prompt; only built when some row has a repetition penalty.
    prompt_mask: Tensor | None = None


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [N] bool, True for greedy rows; only for batches mixing greedy and random rows.
    greedy_mask: Tensor | None = None
    # [N] float32, > 0 (1.0 for greedy rows); None when every random row has temperature 1.
    temperature: Tensor | None = None
    # [N] int64 in [1, V]; V means off. max_top_k: the largest k < V, known on the host so the
    # sampler never reads it back from the device.
    top_k: Tensor | None = None
    max_top_k: int = 0
    top_p: Tensor | None = None  # [N] float32 in (0, 1]; 1.0 = off
    min_p: Tensor | None = None  # [N] float32 in [0, 1]; 0.0 = off
    penalties: PenaltyTensors | None = None
    # (rows [K], token ids [K]) int64: logits set to -inf while a row is below its min_tokens.
    min_tokens_index: tuple[Tensor, Tensor] | None = None
    # row -> that row's generator, for random rows with a seed.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_unseeded_random: int = 0
    # Per row: params.logprobs (None = not asked); max_num_logprobs: their max, None if none.
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    # Some row's logits get a grammar mask before sampling (sampling/grammar.py).
    constrained: bool = False

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, no logprobs, penalties or min_tokens: the token is the argmax of
        the raw logits."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.penalties is None
            and self.min_tokens_index is None
            and not self.constrained
        )

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        greedy = [r.params.greedy for r in rows]
        random_params = [r.params for r, g in zip(rows, greedy, strict=True) if not g]
        num_logprobs = [r.params.logprobs for r in rows]
        asked = [n for n in num_logprobs if n is not None]
        meta = cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=not random_params,
            all_random=len(random_params) == len(rows),
            penalties=_penalty_tensors(rows, vocab_size, device),
            min_tokens_index=_min_tokens_index(rows, vocab_size, device),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            constrained=any(r.constrained for r in rows),
        )
        if random_params:
            _fill_random(meta, rows, greedy, device)
        return meta


def _fill_random(
    meta: SamplingMetadata, rows: Sequence[SamplingRow], greedy: list[bool], device: torch.device
) -> None:
    """Sets the tensors only random rows use; greedy rows get neutral values."""
    v = meta.vocab_size
    rand = [(r.params, i) for i, (r, g) in enumerate(zip(rows, greedy, strict=True)) if not g]
    if not meta.all_random:
        meta.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
    temps = [1.0 if g else r.params.temperature for r, g in zip(rows, greedy, strict=True)]
    if any(t != 1.0 for t in temps):
        meta.temperature = _floats(temps, device)
    ks = [
        v if g else _effective_top_k(r.params.top_k, v) for r, g in zip(rows, greedy, strict=True)
    ]
    active_ks = [k for k in ks if k < v]
    if active_ks:
        meta.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        meta.max_top_k = max(active_ks)
    meta.top_p = _optional_floats([p.top_p for p, _ in rand], greedy, 1.0, device)
    meta.min_p = _optional_floats([p.min_p for p, _ in rand], greedy, 0.0, device)
    meta.generators = _generators(rows, [i for _, i in rand])
    meta.num_unseeded_random = len(rand) - len(meta.generators)


def _generators(rows: Sequence[SamplingRow], random_rows: list[int]) -> dict[int, torch.Generator]:
    gens = {}
    for i in random_rows:
        seed, gen = rows[i].params.seed, rows[i].generator
        if seed is None:
            continue
        if gen is None:
            raise ValueError(f"row {i} has seed {seed} but no generator")
        gens[i] = gen
    return gens


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _optional_floats(
    random_values: list[float],
    greedy: list[bool],
    neutral: float,
    device: torch.device,
) -> Tensor | None:
    """A [N] tensor of one float param, or None when every random row has the neutral value."""
    if all(x == neutral for x in random_values):
        return None
    it = iter(random_values)
    return _floats([neutral if g else next(it) for g in greedy], device)


def _floats(values: list[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _penalty_tensors(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> PenaltyTensors | None:
    active = [_has_penalty(r.params) for r in rows]
    if not any(active):
        return None
    outputs = [r.output_token_ids if a else [] for r, a in zip(rows, active, strict=True)]
    pen = PenaltyTensors(output_counts=token_counts(outputs, vocab_size, device))
    rep = [r.params.repetition_penalty for r in rows]
    if any(x != 1.0 for x in rep):
        pen.repetition = _floats(rep, device)
        prompts = [r.prompt_token_ids if a else [] for r, a in zip(rows, active, strict=True)]
        pen.prompt_mask = token_counts(prompts, vocab_size, device) > 0
    presence = [r.params.presence_penalty for r in rows]
    if any(x != 0.0 for x in presence):
        pen.presence = _floats(presence, device)
    frequency = [r.params.frequency_penalty for r in rows]
    if any(x != 0.0 for x in frequency):
        pen.frequency = _floats(frequency, device)
    return pen


def token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] float32: counts[i, t] = occurrences of token t in seqs[i].

    Rows are padded with the id V into one [N, L] tensor and scatter-added into V + 1 columns;
    the padding column is then dropped.
    """
    width = max((len(s) for s in seqs), default=0)
    padded = np.full((len(seqs), width), vocab_size, dtype=np.int64)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    ids = torch.from_numpy(padded).to(device)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _min_tokens_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids or ())
        if not r.params.ignore_eos:
            banned |= r.eos_token_ids
        ids = sorted(t for t in banned if t < vocab_size)
        row_idx.extend([i] * len(ids))
        tok_idx.extend(ids)
    if not row_idx:
        return None
    as_tensor = torch.tensor([row_idx, tok_idx], dtype=torch.int64, device=device)
    return as_tensor[0], as_tensor[1]
