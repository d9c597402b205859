"""Verifying draft tokens (speculative decoding) from the rows the sampler already samples.

A chunk with d drafts samples d + 1 rows: row i is the target model at the position after the
last known token and drafts[:i], sampled exactly as a step without drafts would sample it (its
penalties count drafts[:i] as outputs, a seeded row draws from the request's generator). The
drafts are accepted while each equals its row's sampled token; the chunk's new tokens are the
accepted drafts and the token sampled at the first row that disagrees (or the row after the last
draft: the bonus token).

Why this is lossless. Greedy: row i's token is the argmax a step without drafts would take, given
the same tokens before it. Random: n-gram drafts are a point mass q = 1[x], and rejection
sampling (Leviathan et al. 2023, Chen et al. 2023) accepts x with probability min(1, p(x) / q(x))
= p(x) and otherwise samples from norm(max(0, p - q)) = p without x. Sampling y ~ p and accepting
x when y = x does the same: P(accept) = p(x), and a rejected row's token is y ~ p given y != x.
Seeded rows stay reproducible (and give the tokens they give without speculation): a rejection
rewinds the generator to before the step and replays the draws of the rows kept (`Rewind`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferd.sampling.metadata import SamplingRow
from inferd.sampling.sampler import skip_draws
from inferd.scheduler.output import ScheduledChunk
from inferd.types import SampleLogprobs


def draft_rows(row: SamplingRow, chunk: ScheduledChunk) -> list[SamplingRow]:
    """The chunk's sampling rows: `row` (its last known token's), then one per draft, each with
    the drafts before it as outputs (for penalties and min_tokens)."""
    drafts = chunk.draft_token_ids
    out = row.output_token_ids
    return [row] + [
        SamplingRow(
            params=row.params,
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=out + drafts[:i],
            eos_token_ids=row.eos_token_ids,
            generator=row.generator,
            constrained=row.constrained,
        )
        for i in range(1, len(drafts) + 1)
    ]


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the tokens sampled at their rows."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


def accept(
    chunks: Sequence[ScheduledChunk],
    token_ids: list[int],
    logprobs: list[SampleLogprobs | None],
) -> tuple[list[list[int]], list[list[SampleLogprobs] | None]]:
    """Each chunk's new tokens (accepted drafts + one sampled) and their logprobs, from the
    sampled rows in chunk order (num_drafts + 1 rows per chunk)."""
    tokens: list[list[int]] = []
    lps: list[list[SampleLogprobs] | None] = []
    row = 0
    for c in chunks:
        n = c.num_drafts + 1
        sampled = token_ids[row : row + n]
        kept = num_accepted(c.draft_token_ids, sampled) + 1
        tokens.append(sampled[:kept])
        chunk_lps = logprobs[row : row + kept]
        lps.append(None if chunk_lps[0] is None else [lp for lp in chunk_lps if lp is not None])
        row += n
    return tokens, lps


@dataclass
class Rewind:
    """Generators of seeded random rows that verify drafts, as they were before the step."""

    saved: list[tuple[int, torch.Generator, torch.Tensor]]  # (chunk index, generator, state)
    vocab_size: int

    @classmethod
    def of(
        cls, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow], vocab_size: int
    ) -> Rewind:
        saved = []
        row = 0
        for i, c in enumerate(chunks):
            gen = rows[row].generator
            if c.num_drafts and gen is not None and not rows[row].params.greedy:
                saved.append((i, gen, gen.get_state()))
            row += c.num_drafts + 1
        return cls(saved, vocab_size)

    def __call__(self, chunks: Sequence[ScheduledChunk], tokens: list[list[int]]) -> None:
        """Leaves each generator as if only the rows kept had drawn."""
        for i, gen, state in self.saved:
            if len(tokens[i]) < chunks[i].num_drafts + 1:
                gen.set_state(state)
                skip_draws(gen, len(tokens[i]), self.vocab_size)
