"""The router with LoRA adapters: which `model` names are adapters (from the replicas' model
lists), prompts hashed under the adapter as the replicas' prefix caches key them, and adapter
affinity within the load bounds."""

from __future__ import annotations

import random

import orjson
import pytest

from inferd.kv_cache.block_hash import block_hashes
from inferd.router.adapters import AdapterCatalog, AdapterPlacement, served_models
from inferd.router.cluster import Cluster
from inferd.router.config import RouterConfig

BS = 16
URLS = ("http://a", "http://b", "http://c")


def models_body(*cards: dict[str, str]) -> bytes:
    return orjson.dumps({"object": "list", "data": list(cards)})


BASE = {"id": "base-7b", "object": "model", "root": "/models/base-7b"}
SQL = {"id": "sql", "object": "model", "parent": "base-7b", "root": "/adapters/sql"}


def cluster_with(adapters: tuple[str, ...] = ("sql", "chat")) -> Cluster:
    cluster = Cluster(RouterConfig(replicas=URLS, block_size=BS, seed=0), random.Random(0))
    cards = [BASE] + [{"id": n, "parent": "base-7b", "root": f"/adapters/{n}"} for n in adapters]
    served = served_models(models_body(*cards))
    assert served is not None
    for url in URLS:
        cluster.set_health(url, ready=True)
        cluster.adapters.update(url, served)
    return cluster


def prompt(seed: int, n: int = 64) -> list[int]:
    return [seed * 10_007 + i for i in range(n)]


def test_a_model_list_names_its_adapters_by_their_parent() -> None:
    served = served_models(models_body(BASE, SQL, {"id": "embedder", "object": "model"}))
    assert served is not None
    assert served.adapters == {"sql"} and served.others == {"base-7b", "embedder"}
    for body in (b"", b"[]", b'{"data": 1}', b"not json"):
        assert served_models(body) is None


def test_which_model_names_are_adapters() -> None:
    catalog = AdapterCatalog()
    assert catalog.lora_name("sql") is None  # no list read yet: the base model's
    served = served_models(models_body(BASE, SQL))
    assert served is not None
    catalog.update("http://a", served)
    assert catalog.lora_name("sql") == "sql"
    assert catalog.lora_name("base-7b") is None and catalog.lora_name(None) is None
    # Listed nowhere: loaded since the last check (or unknown: the replica answers 404).
    assert catalog.lora_name("new") == "new"
    catalog.forget("http://a")
    assert catalog.lora_name("sql") is None


def test_adapter_placement_is_a_bounded_lru() -> None:
    placement = AdapterPlacement(capacity=2)
    placement.ran("x", "http://a")
    placement.ran("y", "http://b")
    placement.ran("x", "http://c")  # x is the most recent now, on c
    placement.ran("z", "http://a")  # evicts y
    assert [placement.last(n) for n in ("x", "y", "z", None)] == [
        "http://c",
        None,
        "http://a",
        None,
    ]
    with pytest.raises(ValueError):
        AdapterPlacement(capacity=0)


def test_a_prompt_under_an_adapter_is_hashed_and_matched_under_it() -> None:
    cluster = cluster_with()
    ids = prompt(1)
    routed = cluster.route(ids, lora_name="sql")
    assert routed.hashes == tuple(block_hashes(ids, BS, lora_name="sql"))
    assert not set(routed.hashes) & set(block_hashes(ids, BS))
    url = routed.decision.replica
    cluster.dispatch(url, routed).finish()
    again = cluster.route(ids, lora_name="sql")
    assert again.decision.replica == url and again.decision.outcome == "cache_hit"
    # The same tokens under the base model or another adapter hold nothing there.
    for lora in (None, "chat"):
        assert cluster.cached_tokens(url, cluster.route(ids, lora_name=lora)) == 0


def test_the_index_matches_an_adapters_blocks_from_the_replicas_digest_and_kv_events() -> None:
    cluster = cluster_with()
    ids = prompt(2)
    adapter_hashes = block_hashes(ids, BS, lora_name="sql")
    # Approximate index: the replica's block digest lists the adapter's hashes.
    cluster.digest("http://b", adapter_hashes, cluster.digest_since("http://b"), 0)
    # Exact index: the replica's BlockStored events carry them.
    cluster.index.follow_events("http://c")
    cluster.index.stored("http://c", adapter_hashes)
    routed = cluster.route(ids, lora_name="sql")
    for url in ("http://b", "http://c"):
        assert cluster.cached_tokens(url, routed) == len(ids)
        assert cluster.cached_tokens(url, cluster.route(ids)) == 0


def test_an_adapters_new_prompts_follow_it_while_load_allows() -> None:
    cluster = cluster_with()
    first = cluster.route(prompt(100), lora_name="sql")
    home = first.decision.replica
    cluster.dispatch(home, first).finish()
    # Prompts no replica holds, which the hash alone would spread over the replicas.
    spread = {cluster.route(prompt(s)).decision.replica for s in range(101, 130)}
    assert len(spread) > 1
    for s in range(101, 130):
        routed = cluster.route(prompt(s), lora_name="sql")
        assert routed.decision.replica == home and routed.decision.outcome == "cold"
        cluster.dispatch(home, routed).finish()


def test_adapter_affinity_never_passes_the_load_bounds() -> None:
    cluster = cluster_with()
    routed = cluster.route(prompt(200, n=512), lora_name="sql")
    home = routed.decision.replica
    cluster.dispatch(home, routed)  # never finishes: its prompt is load on `home`
    cold_margin = cluster.config.cold_margin_tokens
    assert cluster.load_tokens(cluster.replicas[home]) > cold_margin
    routed = cluster.route(prompt(201), lora_name="sql")
    assert routed.decision.replica != home
    # The adapter ran there now: it follows to the replica with room.
    cluster.dispatch(routed.decision.replica, routed)
    assert cluster.placement.last("sql") == routed.decision.replica
