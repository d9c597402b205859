"""Decode attention over the paged KV cache: what the K/V gather costs next to SDPA itself.

    .venv/bin/python bench/attention_gather.py

64 sequences of 400 tokens, 4 KV heads of 64, block size 16, float32, 2 threads (the `tiny`
benchmark shape at 64 running sequences). Prints milliseconds per layer for K only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


def _ms(fn: Callable[[], object], n: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1000


def main() -> None:
    torch.set_num_threads(2)
    hkv, g, d, bs, num_blocks = 4, 2, 64, 16, 8192
    b, length = 64, 400
    nb = length // bs
    cache = torch.randn(num_blocks, bs, hkv, d)
    table = torch.from_numpy(np.random.default_rng(0).choice(num_blocks, b * nb, replace=False))
    q = torch.randn(b, hkv, g, d)
    k = cache[table].view(b, length, hkv, d).transpose(1, 2)
    kc = k.contiguous()
    rows = {
        "gather, advanced indexing": _ms(lambda: cache[table]),
        "gather, index_select": _ms(lambda: cache.index_select(0, table)),
        "sdpa on transposed view": _ms(lambda: F.scaled_dot_product_attention(q, k, k)),
        "sdpa on contiguous copy": _ms(lambda: F.scaled_dot_product_attention(q, kc, kc)),
        "contiguous() copy": _ms(lambda: k.contiguous()),
    }
    print(f"K bytes per layer: {k.numel() * 4 / 1e6:.1f} MB")
    for name, ms in rows.items():
        print(f"{name:28s} {ms:7.2f} ms")


if __name__ == "__main__":
    main()
