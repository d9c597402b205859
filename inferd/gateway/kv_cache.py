"""The replica's block digest: which prompt prefixes its prefix cache holds now, for a router.

    GET /v1/kv_cache/blocks?limit=N&recent_s=S
    {"block_size": 16, "num_blocks": 341, "num_cached": 212, "prefix_caching": true,
     "hash_version": "inferd-block-hash-v1", "block_hashes": [...],   least recently used first
     "num_recent": 40}     the last 40 hashes: in use now or within the last S seconds

`block_hashes` are the stable chained hashes (kv_cache/block_hash.py) of the cached blocks, the
ones a router computes from a prompt's token ids and KV events carry: a replica holds a prompt's
first k blocks when it holds the prompt's first k hashes. At most `limit` (default 65,536), the
most recently used; `num_cached` says how many there are in all. The last `num_recent` were in
use within the last `recent_s` seconds (default 0: held by running requests now): traffic, where
the others may be a past workload's leftovers (a router counts only those in a replica's share
of the groups). The engine core lists them between two steps (O(cached blocks) in its loop:
~10 ms per 100k blocks on a 2-core VM, bench/router_digest.py), so the answer is the cache at
that instant.

`inferd router` reads it from every replica with each health check (router/health.py) and
resets its approximate index of that replica to it (router/index.py, `snapshot`): routers that
share no state then agree on where each prefix lives within one check interval, without KV
events. It is under /v1, so behind the API key when keys are set: the hashes say which prompts
were recently served (`inferd router --replica-api-key`).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.responses import Response

from inferd.gateway.contract import openai_errors
from inferd.gateway.errors import unavailable
from inferd.gateway.responses import json_response
from inferd.gateway.state import gateway
from inferd.kv_cache.block_hash import BLOCK_HASH_SEED

router = APIRouter()

DEFAULT_LIMIT = 65_536
MAX_LIMIT = 1 << 20
MAX_RECENT_S = 86_400.0


class KVCacheBlocks(BaseModel):
    block_size: int
    num_blocks: int
    num_cached: int
    prefix_caching: bool
    hash_version: str
    block_hashes: list[int]
    num_recent: int


@router.get("/v1/kv_cache/blocks", response_model=KVCacheBlocks, responses=openai_errors(400, 503))
async def kv_cache_blocks(
    request: Request,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    recent_s: float = Query(0.0, ge=0.0, le=MAX_RECENT_S),
) -> Response:
    try:
        digest = await gateway(request).engine().kv_blocks(limit, recent_s)
    except TimeoutError:
        raise unavailable("the engine core did not answer in time", "timeout") from None
    return json_response(
        {
            "block_size": digest.block_size,
            "num_blocks": digest.num_blocks,
            "num_cached": digest.num_cached,
            "prefix_caching": digest.prefix_caching,
            "hash_version": BLOCK_HASH_SEED.decode(),
            "block_hashes": digest.block_hashes,
            "num_recent": digest.num_recent,
        }
    )
