"""The native attention kernel of two source revisions, compared bit for bit on many batches.

    .venv/bin/python bench/kernel_bits.py --base main            # base vs the working tree
    .venv/bin/python bench/kernel_bits.py --base main --head-dims 64,128 --threads 1

For a change to the kernel meant to keep its output (a refactor, a new path for another CPU):
builds the library from the sources at `--base` and from the working tree (bench/kernel_ab.py's
build), runs both on the same batches and reports every case whose outputs differ in any bit.
Cases: every head_dim the kernel takes (or `--head-dims`) x the model dtype (float32, bfloat16) x
the KV-cache dtype (float32, bfloat16, float8_e5m2, int8) x batch shapes (decode rows with ragged
contexts, verify steps of 2-5 rows, prefill chunks with and without a cached prefix, single long
streams whose keys split, a mix) x query / KV heads (1, 2, 4 and 7 query heads per KV head) x
block size (16, 5) x sliding window (none, 33, 200). Pools are shuffled. Only what the CPU runs
is compared (no AMX here: no tiles). ~8,000 cases, ~6 min of CPU on 2 threads.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from kernel_ab import build, sources_at

from inferd.models import kv_int8
from inferd.models.kernels import PagedAttentionKernel, PagedBatch

Seqs = list[tuple[int, int]]  # (q_len, ctx_len) per sequence


def _randint(g: torch.Generator, lo: int, hi: int, n: int) -> list[int]:
    return [int(x) for x in torch.randint(lo, hi, (n,), generator=g)]


def _shapes(g: torch.Generator) -> dict[str, Callable[[], Seqs]]:
    def chunks(n: int, lo: int, hi: int, prefix: int) -> Seqs:
        return [
            (q, q + c)
            for q, c in zip(_randint(g, lo, hi, n), _randint(g, 0, prefix + 1, n), strict=True)
        ]

    return {
        "decode": lambda: [(1, c) for c in _randint(g, 1, 400, 13)],
        "decode-many": lambda: [(1, c) for c in _randint(g, 100, 300, 70)],
        "verify": lambda: chunks(9, 2, 6, 300),
        "prefix-chunk": lambda: chunks(4, 17, 200, 400),
        "prefill": lambda: [(q, q) for q in _randint(g, 16, 260, 5)],
        "long": lambda: [(1, 4097)],
        "long-chunk": lambda: [(40, 3000)],
        "mixed": lambda: [(1, 300), (5, 77), (120, 500), (1, 9), (33, 33)],
    }


DTYPES = [  # (model, KV cache)
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e5m2),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.int8),
    (torch.bfloat16, torch.float8_e5m2),
]
HEADS = [(8, 8), (8, 4), (14, 2), (28, 4), (16, 16)]  # (query heads, KV heads)


def _batch(
    seqs: Seqs,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
    act, kv_dtype = dtypes
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-ctx // bs) for _, ctx in seqs]
    num_blocks = sum(nbs) + 3
    kv = torch.randn(2, num_blocks, bs, hkv, d, generator=g) * 2
    kv = kv_int8.quantize(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seqs), max(nbs), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(nbs):
        tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    q_len = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    q_start = torch.cumsum(q_len, 0, dtype=torch.int32) - q_len
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    q = (torch.randn(int(q_len.sum()), hq, d, generator=g) * 2).to(act)
    return q, kv, PagedBatch(tables, q_start, q_len, ctx)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _skip(d: int, heads: tuple[int, int], bs: int, shape: str) -> bool:
    """Cases left out to keep the run short: wide heads with many of them, odd block sizes but
    for the usual heads."""
    if d in (16, 80, 256) and heads in ((28, 4), (16, 16)):
        return True
    return (d == 256 and shape == "decode-many") or (bs == 5 and heads not in ((8, 4), (14, 2)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision of the baseline kernel sources")
    p.add_argument("--head-dims", default="16,32,64,80,96,128,256")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    head_dims = [int(d) for d in args.head_dims.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        kerns = [
            PagedAttentionKernel(ctypes.CDLL(str(build(sources_at(rev), Path(tmp) / f"{i}.so"))))
            for i, rev in enumerate((args.base, None))
        ]
        shapes = _shapes(torch.Generator().manual_seed(1))
        n = differ = 0
        grid = itertools.product(DTYPES, shapes.items(), HEADS, (16, 5), (None, 33, 200))
        for d, (dtypes, (shape, make), (hq, hkv), bs, window) in itertools.product(
            head_dims, list(grid)
        ):
            if _skip(d, (hq, hkv), bs, shape):
                continue
            q, kv, batch = _batch(make(), hq, hkv, d, bs, dtypes, seed=n)
            outs = []
            for k in kerns:
                out = torch.full_like(q, float("nan"))
                k(out, q, kv, batch, d**-0.5, window)
                outs.append(out)
            n += 1
            if not torch.equal(_bits(outs[0]), _bits(outs[1])):
                differ += 1
                diff = (outs[0].float() - outs[1].float()).abs().max().item()
                print(
                    f"differ: d={d} {dtypes} {shape} heads {hq}/{hkv} block {bs} "
                    f"window {window}: max diff {diff:.2e}",
                    flush=True,
                )
    print(
        f"{n} cases, {differ} differ in some bit ({args.base} vs the working tree, "
        f"{args.threads} threads)"
    )


if __name__ == "__main__":
    main()
