"""What a replica's block digest costs (no servers): the replica listing its cached blocks in the
engine loop (`BlockManager.held_hashes`), the JSON body both ways, and the router applying it to
its prefix index (`PrefixIndex.snapshot`, in its event loop). router/digest_pacer.py spaces out
the digests of replicas where the apply takes long.

    .venv/bin/python bench/router_digest.py --blocks 1000 10000 65536 100000

Each cache holds `--blocks` blocks of prompts of 100 blocks, half of the requests finished
(evictable blocks), half running; the router's index already holds half of them. Best of
`--repeat` (the machine is shared); ms per call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import orjson
from common import command_line, default_result_path, machine_info, write_result

from inferd.kv_cache.block_manager import BlockManager
from inferd.router.index import PrefixIndex

BLOCK_SIZE = 16
PROMPT_BLOCKS = 100


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def full_cache(num_blocks: int) -> BlockManager:
    bm = BlockManager(num_blocks, BLOCK_SIZE, block_hashes=True)
    for r in range(num_blocks // PROMPT_BLOCKS):
        tokens = [r * 7919 + i for i in range(PROMPT_BLOCKS * BLOCK_SIZE)]
        assert bm.allocate(f"r{r}", len(tokens))
        bm.cache_full_blocks(f"r{r}", tokens, len(tokens))
        if r % 2 == 0:
            bm.free(f"r{r}")
    return bm


def measure(num_blocks: int, repeat: int) -> dict[str, float]:
    bm = full_cache(num_blocks)
    digest = bm.held_hashes(num_blocks, recent_s=4.0)
    body = orjson.dumps({"block_hashes": digest.hashes, "num_recent": digest.num_recent})
    index = PrefixIndex(num_blocks)
    index.insert("r", digest.hashes[: len(digest.hashes) // 2])

    def apply() -> None:
        index.snapshot("r", digest.hashes, index.stamp, digest.num_recent)

    return {
        "blocks": len(digest.hashes),
        "replica_list_ms": best_ms(lambda: bm.held_hashes(num_blocks, recent_s=4.0), repeat),
        "json_bytes": len(body),
        "json_encode_ms": best_ms(lambda: orjson.dumps({"block_hashes": digest.hashes}), repeat),
        "json_parse_ms": best_ms(lambda: orjson.loads(body), repeat),
        "router_apply_ms": best_ms(apply, repeat),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[1000, 10000, 65536, 100000])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    print("blocks   replica lists   JSON bytes   encode   parse   router applies  (ms)")
    for n in args.blocks:
        r = measure(n, args.repeat)
        rows.append(r)
        print(
            f"{r['blocks']:>6}   {r['replica_list_ms']:13.2f}   {r['json_bytes']:>10}"
            f"   {r['json_encode_ms']:6.2f}   {r['json_parse_ms']:5.2f}"
            f"   {r['router_apply_ms']:14.2f}"
        )
    path = default_result_path("router_digest", "blocks")
    write_result(path, {"command": command_line(), "machine": machine_info(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
