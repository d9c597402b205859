"""The draft model's bookkeeping (spec_decode/draft_model.py) with a faked draft forward: which
positions each draft forward computes, rollback to the accepted tokens, and its block pool."""

from __future__ import annotations

from inferd.kv_cache.block_manager import BlockManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.output import ScheduledChunk
from inferd.scheduler.request import Request
from inferd.spec_decode.draft_model import DraftModelProposer


class _FakeDraft:
    """A draft whose next token is the last one + 1; it records each forward's chunks as
    (request id, start, input ids)."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int, list[int]]]] = []

    def __call__(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        self.calls.append([(c.request.request_id, c.start, c.token_ids()) for c in chunks])
        for c in chunks:
            assert len(c.block_ids) * 2 >= c.start + c.num_tokens, "a fed position has no block"
        return {c.request.request_id: c.token_ids()[-1] + 1 for c in chunks}


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0.0), max_tokens=100)


def _proposer(num_blocks: int = 32) -> tuple[DraftModelProposer, _FakeDraft]:
    draft = _FakeDraft()
    return DraftModelProposer(draft, BlockManager(num_blocks, 2, False), 64), draft


def test_k_forwards_batched_then_rollback_to_the_accepted_drafts() -> None:
    proposer, draft = _proposer()
    a, b = _request("a", [1, 2, 3]), _request("b", [7])
    assert proposer.propose_batch([a, b], [3, 1]) == [[4, 5, 6], [8]]
    # One forward per draft position over the requests still drafting; the last draft not fed.
    assert draft.calls == [
        [("a", 0, [1, 2, 3]), ("b", 0, [7])],
        [("a", 3, [4])],
        [("a", 4, [5])],
    ]
    # a: the target accepted 4, then sampled 9 (5 rejected); its draft K/V of position 4 (5)
    # are stale and recomputed. b: 8 accepted, then 9.
    for t in (4, 9):
        a.append_output_token(t)
    for t in (8, 9):
        b.append_output_token(t)
    draft.calls.clear()
    assert proposer.propose_batch([a, b], [2, 2]) == [[10, 11], [10, 11]]
    assert draft.calls[0] == [("a", 4, [9]), ("b", 1, [8, 9])]
    # Everything accepted plus a sampled token: the draft fed 10 already, so it starts at 11.
    for t in (10, 11, 12):
        a.append_output_token(t)
    draft.calls.clear()
    assert proposer.propose_batch([a], [1]) == [[13]]
    assert draft.calls == [[("a", 6, [11, 12])]]
    # b left the decoding set: its blocks are back. a holds its 8 tokens' blocks, no more.
    assert proposer.num_seqs == 1 and proposer.blocks.block_table("a") == [0, 1, 2, 3]
    proposer.release(["a"])
    proposer.blocks.check_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_no_room_in_the_draft_pool_means_no_drafts() -> None:
    proposer, draft = _proposer(num_blocks=3)
    small, big = _request("s", [1, 2]), _request("b", list(range(10)))
    assert proposer.propose_batch([small, big], [2, 2]) == [[3, 4], []]
    assert proposer.num_seqs == 1 and draft.calls[0] == [("s", 0, [1, 2])]
    # k = 0 drafts nothing and keeps the state; past max_model_len no drafts either.
    assert proposer.propose_batch([small], [0]) == [[]]
    assert proposer.num_seqs == 1
    proposer.max_model_len = 2
    assert proposer.propose_batch([small], [3]) == [[]]
    proposer.release(["s", "unknown"])
    assert proposer.blocks.num_free_blocks == 3
