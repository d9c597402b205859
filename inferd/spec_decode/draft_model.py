"""Draft-model drafts: a smaller model with the target's vocabulary proposes k greedy tokens.

The draft model has its own paged KV cache (its own `BlockManager` and pool) and keeps, per
request, the tokens whose draft K/V are in it. A proposal for the requests of one step:

    forward 1: each request's tokens the draft has no K/V for yet, up to its last known token
               (a whole prompt on its first proposal, one or two tokens in steady decode), as one
               chunk each; the last row's argmax is its first draft d1.
    forward j (2..k): d(j-1) of every request with k >= j, one row each; argmax: dj.

One draft forward per draft position over all the requests that draft, never one per request.
Request r with L known tokens then holds draft K/V for positions 0 .. L + k - 2 (dk is not fed).

Rollback. The draft's K/V of position p are right while the token it fed there is the request's
token p. At the next proposal the draft keeps the longest run of its tentative tokens (the drafts
it fed) that equals what the target accepted, and recomputes from there: K/V past that point are
stale but never read, since a row attends only to positions up to its own, each of which this or
an earlier forward wrote with the right token. Its blocks past L + k - 1 go back to the pool.

Lazily: the draft catches up on the prompt before its first proposal (one chunk of the whole
prompt, beside the other requests' rows), not while the target prefills, so a request that never
drafts costs the draft nothing; chunked prefill of the target needs nothing of it. No prefix
caching: a prompt is recomputed by the draft (its pool is small, and its prefill is the draft's
cost, a fraction of the target's). State is dropped (blocks freed) when a request finishes
(`release`), leaves the decoding set (preempted, or waiting for a grammar), or the draft's pool
has no room for it this step (it proposes nothing then); it is rebuilt at its next proposal.

Pure Python: the forward itself is the executor's (`executor/draft_runner.py`), handed in as
`DraftForward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferd.kv_cache.block_manager import BlockManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.output import ScheduledChunk
from inferd.scheduler.request import Request

# Chunks in, each chunk's greedy next token out (by request id); one forward of the draft model.
DraftForward = Callable[[list[ScheduledChunk]], dict[str, int]]

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _DraftSeq:
    """One request as the draft sees it: `seq.all_token_ids` are the tokens it fed (the request's
    known tokens, then its drafts but the last); K/V of the first `num_computed` are right."""

    seq: Request
    num_computed: int = 0
    # How many of seq's tokens were the request's own at the last proposal (the rest: drafts).
    num_known: int = 0


class DraftModelProposer:
    """drafter.Proposer over a draft model; see the module docstring."""

    def __init__(self, forward: DraftForward, blocks: BlockManager, max_model_len: int) -> None:
        self.forward = forward
        self.blocks = blocks
        self.max_model_len = max_model_len
        self._seqs: dict[str, _DraftSeq] = {}

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to k greedy drafts per request, k draft forwards in all (module docstring)."""
        decoding = {r.request_id for r in requests}
        self.release([rid for rid in self._seqs if rid not in decoding])
        ks = [min(k, self.max_model_len - r.num_tokens) for r, k in zip(requests, ks, strict=True)]
        seqs = [self._catch_up(r, k) if k > 0 else None for r, k in zip(requests, ks, strict=True)]
        active = [(s, k) for s, k in zip(seqs, ks, strict=True) if s is not None]
        chunks = [self._chunk(s, s.num_computed) for s, _ in active]
        for j in range(max((k for _, k in active), default=0)):
            if j > 0:
                chunks = [self._chunk(s, s.seq.num_tokens - 1) for s, k in active if k > j]
            tokens = self.forward(chunks)
            for c in chunks:
                c.request.all_token_ids.append(tokens[c.request.request_id])
        drafts: list[list[int]] = []
        for r, s in zip(requests, seqs, strict=True):
            if s is None:
                drafts.append([])
                continue
            s.num_computed = s.seq.num_tokens - 1
            s.num_known = r.num_tokens
            drafts.append(s.seq.all_token_ids[r.num_tokens :])
        return drafts

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self._seqs.pop(rid, None) is not None:
                self.blocks.free(rid)

    def _catch_up(self, r: Request, k: int) -> _DraftSeq | None:
        """The request's draft state, its blocks grown for k drafts and its fed tokens set to the
        request's (what the draft fed beyond them rolled back); None if the pool has no room."""
        s = self._seqs.get(r.request_id)
        if s is None:
            s = self._seqs[r.request_id] = _DraftSeq(_draft_request(r))
        fed, tokens = s.seq.all_token_ids, r.all_token_ids
        # The drafts fed past num_known stay computed while they equal the accepted tokens.
        n = s.num_known
        while n < s.num_computed and n < len(tokens) and fed[n] == tokens[n]:
            n += 1
        s.num_computed = min(n, s.num_computed, len(tokens) - 1)
        # Positions up to L + k - 2 are fed (the last draft is not).
        need = len(tokens) + k - 1
        if not self.blocks.allocate(r.request_id, need):
            self.release([r.request_id])
            return None
        self.blocks.trim(r.request_id, need)
        # The first num_known tokens are the request's own and never change: replace the rest.
        del fed[s.num_known :]
        fed.extend(tokens[s.num_known :])
        return s

    def _chunk(self, s: _DraftSeq, start: int) -> ScheduledChunk:
        """seq's tokens from `start` to its end, in one chunk that samples its last."""
        rid = s.seq.request_id
        return ScheduledChunk(s.seq, start, s.seq.num_tokens - start, self.blocks.block_table(rid))

    @property
    def num_seqs(self) -> int:
        """Requests whose draft state (and blocks) the proposer holds."""
        return len(self._seqs)


def _draft_request(r: Request) -> Request:
    """The draft's own sequence for request r (same id, greedy; its tokens are set per step)."""
    return Request(r.request_id, [], _GREEDY, max_tokens=0)
