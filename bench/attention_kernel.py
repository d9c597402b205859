"""Per-layer paged attention: the native CPU kernel against today's PyTorch path (gather + SDPA).

    .venv/bin/python bench/attention_kernel.py [--threads 2] [--repeat 20]

Both paths run through `PagedAttention.forward` with the metadata the model runner builds (decode
groups and masks for PyTorch; a `PagedBatch` for the kernel), K/V write included, on a pool whose
block tables are shuffled. Rows: decode batches 1/16/64/96 x contexts 128/512/1024 and a 256-token
prefill chunk with a 512-token cached prefix (plus the same chunk without a prefix: SDPA over
the chunk's own K/V against the kernel, which the engine uses for it too), for the tiny shape's
heads (8 q / 4 kv, head_dim 64) and Qwen2-0.5B's (14 / 2, head_dim 64). Columns: milliseconds
per layer call, PyTorch fp32 cache, kernel fp32 cache, kernel bf16 / fp8 / int8 cache (the write
in these calls is PyTorch's: for int8 its quantize costs ~55 us a call, which the engine's fused
RoPE + KV-write kernel does in its own pass instead). The table shows the
fastest of `--repeat` calls (on a shared machine the median mostly measures the neighbours);
the JSON has the median too. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import command_line, default_result_path, machine_info, torch_threads, write_result

from inferd.config import read_environment
from inferd.models import kernels, kv_int8
from inferd.models.attention import PagedAttention
from inferd.models.attention.native import NativeMetadata
from inferd.models.attention.sdpa import PrefillSpan, SdpaMetadata

HEADS = {"tiny": (8, 4), "qwen2-0.5b-shape": (14, 2)}
HEAD_DIM = 64
BLOCK_SIZE = 16
DECODE = [(b, n) for b in (1, 16, 64, 96) for n in (128, 512, 1024)]
PREFILL = (256, 512)  # chunk length, cached prefix


def _times_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(fastest, median) of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000, statistics.median(times) * 1000


class Case:
    """One batch: B sequences of `ctx` keys, the last `q_len` of them this step's queries."""

    def __init__(self, hq: int, hkv: int, b: int, ctx: int, q_len: int, prefix: bool) -> None:
        rng = np.random.default_rng(0)
        nb = -(-ctx // BLOCK_SIZE)
        self.num_blocks = b * nb + 1
        self.tables = rng.permutation(self.num_blocks - 1)[: b * nb].reshape(b, nb)
        self.b, self.ctx, self.q_len, self.prefix, self.hkv = b, ctx, q_len, prefix, hkv
        t = b * q_len
        self.q = torch.randn(t, hq, HEAD_DIM)
        self.k = torch.randn(t, hkv, HEAD_DIM)
        self.v = torch.randn(t, hkv, HEAD_DIM)
        pos = np.arange(ctx - q_len, ctx)
        slots = self.tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        self.slots = torch.from_numpy(slots.reshape(-1))

    def cache(self, dtype: torch.dtype) -> torch.Tensor:
        values = torch.randn(2, self.num_blocks, BLOCK_SIZE, self.hkv, HEAD_DIM)
        return kv_int8.quantize(values) if dtype == torch.int8 else values.to(dtype)

    def torch_meta(self) -> SdpaMetadata:
        """What the runner builds without the kernel (decode: one group, all lengths equal)."""
        meta = SdpaMetadata(slot_mapping=self.slots)
        if self.q_len == 1:
            keys = np.arange(self.tables.shape[1] * BLOCK_SIZE)
            mask = torch.from_numpy(keys < self.ctx).view(1, 1, 1, -1).expand(self.b, 1, 1, -1)
            meta.num_decode_tokens = self.b
            meta.decode_groups = [(torch.from_numpy(self.tables), mask)]
            return meta
        pos = np.arange(self.ctx)
        span = PrefillSpan(query_start=0, query_len=self.q_len, context_len=self.ctx)
        if self.prefix:
            span.context_slots = torch.from_numpy(
                self.tables[0, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            )
            q_pos = np.arange(self.ctx - self.q_len, self.ctx)
            span.mask = torch.from_numpy(pos[None, :] <= q_pos[:, None])
        meta.prefills = [span]
        return meta

    def kernel_meta(self) -> NativeMetadata:
        meta = NativeMetadata(slot_mapping=self.slots, num_decode_tokens=self.b)
        meta.paged = kernels.PagedBatch(
            block_tables=torch.from_numpy(self.tables.astype(np.int32)),
            q_start=torch.arange(self.b, dtype=torch.int32) * self.q_len,
            q_len=torch.full((self.b,), self.q_len, dtype=torch.int32),
            ctx_len=torch.full((self.b,), self.ctx, dtype=torch.int32),
        )
        return meta


def _run_case(
    case: Case, hq: int, kernel: kernels.PagedAttentionKernel, repeat: int
) -> dict[str, float]:
    attn = PagedAttention(hq, case.hkv, HEAD_DIM, HEAD_DIM**-0.5)
    out: dict[str, float] = {}
    variants = [("torch_fp32", torch.float32, None), ("kernel_fp32", torch.float32, kernel)]
    variants.append(("kernel_bf16kv", torch.bfloat16, kernel))
    variants.append(("kernel_fp8kv", torch.float8_e5m2, kernel))
    variants.append(("kernel_int8kv", torch.int8, kernel))
    for name, dtype, kern in variants:
        attn.kv_cache = case.cache(dtype)
        attn.kernel = kern
        meta = case.kernel_meta() if kern is not None else case.torch_meta()
        with torch.inference_mode():
            best, median = _times_ms(functools.partial(attn, case.q, case.k, case.v, meta), repeat)
        out[name], out[f"{name}_median"] = best, median
        attn.kv_cache = torch.empty(0)
    return out


def _rows(threads: int, repeat: int) -> list[dict[str, Any]]:
    kernel = kernels.load(read_environment().cache_dir).attention
    rows: list[dict[str, Any]] = []
    with torch_threads(threads):
        for shape, (hq, hkv) in HEADS.items():
            for b, ctx in DECODE:
                res = _run_case(Case(hq, hkv, b, ctx, 1, True), hq, kernel, repeat)
                rows.append({"shape": shape, "kind": "decode", "batch": b, "context": ctx, **res})
            chunk, prefix = PREFILL
            for kind, pre in (("prefill+prefix", prefix), ("prefill plain", 0)):
                case = Case(hq, hkv, 1, chunk + pre, chunk, pre > 0)
                res = _run_case(case, hq, kernel, repeat)
                rows.append(
                    {"shape": shape, "kind": kind, "batch": 1, "context": chunk + pre, **res}
                )
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    head = f"{'shape':17s} {'kind':15s} {'B':>3s} {'ctx':>5s}"
    print(
        f"{head} {'torch ms':>9s} {'kernel ms':>9s} {'speedup':>7s} {'bf16-KV ms':>10s}"
        f" {'fp8-KV ms':>9s} {'int8-KV ms':>10s}"
    )
    for r in rows:
        torch_ms, kernel_ms, bf16_ms = r["torch_fp32"], r["kernel_fp32"], r["kernel_bf16kv"]
        print(
            f"{r['shape']:17s} {r['kind']:15s} {r['batch']:3d} {r['context']:5d} "
            f"{torch_ms:9.3f} {kernel_ms:9.3f} {torch_ms / kernel_ms:6.2f}x {bf16_ms:10.3f}"
            f" {r['kernel_fp8kv']:9.3f} {r['kernel_int8kv']:10.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    rows = _rows(args.threads, args.repeat)
    _print(rows)
    path = default_result_path("attention_kernel", "heads")
    write_result(path, {"command": command_line(), "machine": machine_info(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
