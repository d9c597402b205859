"""Stable chained hashes of token-id blocks: the key a router and every replica agree on.

A prompt is cut into full blocks of `block_size` token ids (a trailing partial block is never
cached, so it gets no hash). Block i's hash covers block i *and* every block before it:

    h[0] = H(seed   || tokens[0:B])
    h[i] = H(h[i-1] || tokens[i*B:(i+1)*B])

so two prompts share h[i] exactly when they share their first (i+1)*B tokens, and "how much of
this prompt does a replica hold" is "how many leading hashes it holds".

A LoRA adapter changes every K/V of a prompt, so a prompt run under an adapter chains from its
own seed, `seed || 0x00 || adapter name`: the same tokens under two adapters (or an adapter and
the base model) share no hash. The adapter's name, not a per-process id, so replicas agree.

Stable across processes, restarts and machines: BLAKE2b over the little-endian uint32 token ids,
never Python's `hash` (salted per process unless PYTHONHASHSEED is pinned, llm-d's pitfall). Hashes
are 64-bit ints: 8 bytes a block in an index, with a collision chance far below anything a router
would notice. Pure Python (hashlib), so the router imports it without torch.

    >>> block_hashes(list(range(40)), 16) == block_hashes(list(range(32)) + [7], 16)
    True
    >>> len(block_hashes(list(range(40)), 16))
    2
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Changing the seed or the byte layout changes every hash: bump the version with it.
BLOCK_HASH_SEED = b"inferd-block-hash-v1"
_DIGEST_BYTES = 8


def chain_seed(lora_name: str | None = None) -> bytes:
    """The bytes the first block's hash chains from: the base model's, or an adapter's own."""
    if lora_name is None:
        return BLOCK_HASH_SEED
    return BLOCK_HASH_SEED + b"\x00" + lora_name.encode()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    max_blocks: int | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """The chained hash of each full block of `token_ids`, at most `max_blocks` of them, as run
    under the adapter `lora_name` (None: the base model).

    Token ids must be in [0, 2**32); `block_size` must be the engine's (`--block-size`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    pack = struct.Struct(f"<{block_size}I").pack
    parent = chain_seed(lora_name)
    out: list[int] = []
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(pack(*token_ids[i * block_size : (i + 1) * block_size]))
        parent = h.digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def next_block_hash(
    parent_hash: int | None, block_tokens: Sequence[int], lora_name: str | None = None
) -> int:
    """One link of the chain: the hash of a full block whose predecessor hashed to `parent_hash`
    (None for a sequence's first block, which chains from `lora_name`'s seed). Equal to
    `block_hashes(...)[i]` when `parent_hash` is entry i-1 of it, so a block can be hashed where
    it is registered, from its parent's hash.

    >>> hs = block_hashes(list(range(32)), 16)
    >>> next_block_hash(hs[0], range(16, 32)) == hs[1]
    True
    """
    parent = chain_seed(lora_name)
    if parent_hash is not None:
        parent = parent_hash.to_bytes(_DIGEST_BYTES, "little")
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
    h.update(struct.pack(f"<{len(block_tokens)}I", *block_tokens))
    return int.from_bytes(h.digest(), "little")
