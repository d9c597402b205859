"""bench/router.py's pure parts: the workloads' ideal hit rate, the issue's KV sizing rule, the
per-cell salting (ids and text), a peer router's command line, and hit rates per time window."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from router_cluster import CounterSampler, Replica, peer_command
from router_workloads import (
    BLOCK_SIZE,
    Shape,
    cell_prompts,
    closed_form_hit_rate,
    ideal_hit_rate,
    ideal_hit_tokens,
    prompts_for,
    size_pools,
)

SHAPE = Shape(
    groups=4,
    prefix_len=8 * BLOCK_SIZE,
    suffix_len=BLOCK_SIZE,
    output_len=4,
    num_requests=40,
    turns=3,
    zipf_s=1.5,
    seed=0,
)


def test_the_ideal_hit_rate_of_grouped_prompts_is_the_closed_form() -> None:
    # A suffix of exactly one block never completes a block before the last token is computed,
    # so the block-level H* and the issue's formula agree exactly.
    prompts = prompts_for("uniform", SHAPE)
    assert ideal_hit_rate(prompts) == pytest.approx(closed_form_hit_rate(SHAPE))


def test_no_sharing_has_no_ideal_hits_and_a_repeat_hits_every_full_block_but_the_last() -> None:
    assert sum(ideal_hit_tokens(prompts_for("nosharing", SHAPE))) == 0
    p = list(range(100, 100 + 3 * BLOCK_SIZE))
    assert ideal_hit_tokens([p, p]) == [0, 2 * BLOCK_SIZE]


def test_multiturn_sessions_grow_to_the_prefix_length() -> None:
    prompts = prompts_for("multiturn", SHAPE)
    assert len(prompts) == SHAPE.groups * SHAPE.turns
    assert max(len(p) for p in prompts) == SHAPE.prefix_len


@pytest.mark.parametrize(("replicas", "ratio", "share"), [(2, 1.5, 0.75), (4, 2.5, 0.625)])
def test_the_pools_follow_the_issues_sizing_rule(replicas: int, ratio: float, share: float) -> None:
    sizing = size_pools(groups=8, prefix_blocks=64, replicas=replicas, ratio=None)
    assert sizing.ratio_one == pytest.approx(ratio, rel=0.01)
    assert sizing.share_of_cluster == pytest.approx(share, rel=0.01)


class _Codec:
    """A stand-in tokenizer: one token per character code."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_cells_are_salted_apart_as_ids_and_as_text() -> None:
    prompts = [[70, 71], [72]]
    a, b = cell_prompts(prompts, 1, None), cell_prompts(prompts, 2, None)
    assert a.sent == a.ids == [[1, 70, 71], [1, 72]]
    assert a.ids[0][0] != b.ids[0][0]
    text = cell_prompts(prompts, 3, _Codec())
    assert text.sent == ["[3] FG", "[3] H"]
    assert text.ids[0] == [ord(c) for c in "[3] FG"]
    with pytest.raises(ValueError, match="salt"):
        cell_prompts(prompts, 10_000, None)


def test_a_peer_command_gets_the_port_and_one_word_per_replica() -> None:
    replicas = [Replica("http://a:1", 1, None), Replica("http://b:2", 2, None)]
    cmd = peer_command("peer --port {port} --worker-urls {workers} --x", replicas, 9000)
    assert cmd == ["peer", "--port", "9000", "--worker-urls", "http://a:1", "http://b:2", "--x"]


def test_window_hit_rates_come_from_counter_deltas() -> None:
    sampler = CounterSampler(["a", "b"])
    sampler.samples = [
        (0.0, [(0.0, 0.0), (0.0, 0.0)]),
        (5.0, [(100.0, 50.0), (100.0, 50.0)]),
        (10.0, [(100.0, 50.0), (300.0, 250.0)]),  # "a" died: its counters froze
    ]
    assert sampler.window_hit_rates([0.0, 5.0, 10.0]) == [0.5, 1.0]
