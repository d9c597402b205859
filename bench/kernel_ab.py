"""The native attention kernel of two source revisions, alternating in one process.

    .venv/bin/python bench/kernel_ab.py --base d21af70            # base vs the working tree
    .venv/bin/python bench/kernel_ab.py --base d21af70 --repeat 40 --cases decode-96

Builds the kernel library (inferd/models/kernels, the same compiler flags as the engine's build)
from the sources at `--base` (git show) and from the working tree, loads both, and times
`inferd_paged_attention` of each on the same batches, alternating call by call, so a slow spell
of a shared machine hits both alike. Before every call the caches are flushed (a 256 MiB write),
as the rest of a layer would evict them; pools are shuffled (each sequence's blocks scattered, as
after a server has run a while). Cases (the tiny shape's heads, 8 q / 4 kv, and Qwen2-0.5B's,
14 / 2; head_dim 64, block 16, contexts 150-380):

    decode-96     96 sequences, one query each      decode-32-qwen   32 sequences, Qwen heads
    decode-96-bf16  the first with a bfloat16 cache  decode-1        one sequence (a single stream)
    decode-96-int8  ... with an int8 cache
    prefill-16    16 prompts of 16-256 tokens, causal, no cached prefix
    prefill-16-bf16, decode-32-qwen-bf16   the same with a bfloat16 cache
    decode-96-bf16model, decode-32-qwen-bf16model, prefill-16-bf16model   bfloat16 queries too
    prefill-8-qwen, prefill-8-qwen-bf16model   8 prompts of 16-256 tokens, Qwen heads

Prints the median and fastest call of each build, K/V GB/s (bytes of K and V read / median), the
median ratio, and the largest difference between the two outputs; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, command_line, default_result_path, machine_info, write_result

from inferd.models import kernels, kv_int8
from inferd.models.kernels import PagedAttentionKernel, PagedBatch

BLOCK = 16
# name: (sequences, q heads, kv heads, query length (1: decode; else up to), KV dtype); the
# queries are float32 (a float32 model) unless the name ends in "-bf16model" (all bfloat16).
CASES: dict[str, tuple[int, int, int, int, torch.dtype]] = {
    "decode-96": (96, 8, 4, 1, torch.float32),
    "decode-96-bf16": (96, 8, 4, 1, torch.bfloat16),
    "decode-96-int8": (96, 8, 4, 1, torch.int8),
    "decode-32-qwen": (32, 14, 2, 1, torch.float32),
    "decode-1": (1, 8, 4, 1, torch.float32),
    "prefill-16": (16, 8, 4, 256, torch.float32),
    "prefill-16-bf16": (16, 8, 4, 256, torch.bfloat16),
    "decode-32-qwen-bf16": (32, 14, 2, 1, torch.bfloat16),
    "decode-96-bf16model": (96, 8, 4, 1, torch.bfloat16),
    "decode-32-qwen-bf16model": (32, 14, 2, 1, torch.bfloat16),
    "prefill-16-bf16model": (16, 8, 4, 256, torch.bfloat16),
    "prefill-8-qwen": (8, 14, 2, 256, torch.float32),
    "prefill-8-qwen-bf16model": (8, 14, 2, 256, torch.bfloat16),
}


def build(sources: dict[str, str], out: Path) -> Path:
    """Compiles the kernel sources (path under the kernels folder -> text) into `out` as the
    engine builds them."""
    cxx = kernels.compiler()
    assert cxx is not None, "no C++ compiler"
    with tempfile.TemporaryDirectory() as d:
        for name, text in sources.items():
            (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
        cpp = [Path(d) / n for n in sources if n.endswith(".cpp")]
        kernels.compile_library(cxx, cpp, out)
    return out


def sources_at(rev: str | None) -> dict[str, str]:
    """The kernel sources (.cpp and .h files, path under the kernels folder -> text) at a git
    revision, or (None) in the working tree."""
    here = Path(kernels.__file__).parent
    if rev is None:
        files = [f.relative_to(here).as_posix() for f in (*kernels.SOURCES, *kernels.HEADERS)]
        return {f: (here / f).read_text() for f in files}
    folder = here.relative_to(REPO_ROOT).as_posix()
    git = ["git", "-C", str(REPO_ROOT)]
    listed = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", rev, "--", folder],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        Path(f).relative_to(folder).as_posix(): subprocess.run(
            [*git, "show", f"{rev}:{f}"], capture_output=True, check=True
        ).stdout.decode()
        for f in listed
        if f.endswith((".cpp", ".h"))
    }


def batch(case: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, PagedBatch, int]:
    """(q, kv_cache, batch, K/V bytes read) of one case, seeded."""
    s, hq, hkv, qlen, kv_dtype = CASES[case]
    g = torch.Generator().manual_seed(seed)
    if qlen == 1:
        q_len = torch.ones(s, dtype=torch.int32)
        ctx = torch.randint(150, 380, (s,), generator=g, dtype=torch.int32)
    else:
        q_len = torch.randint(16, qlen, (s,), generator=g, dtype=torch.int32)
        ctx = q_len.clone()
    blocks = [-(-int(c) // BLOCK) for c in ctx]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=g).int()
    tables = torch.zeros(s, max(blocks), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
    kv = torch.randn(2, num_blocks, BLOCK, hkv, 64, generator=g)
    kv = kv_int8.quantize(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
    q = torch.randn(int(q_len.sum()), hq, 64, generator=g)
    if case.endswith("-bf16model"):
        q = q.to(torch.bfloat16)
    q_start = torch.cumsum(q_len, 0, dtype=torch.int32) - q_len
    kv_bytes = int(ctx.sum()) * hkv * kv.shape[-1] * kv.element_size() * 2
    return q, kv, PagedBatch(tables, q_start, q_len, ctx), kv_bytes


def measure(kerns: dict[str, PagedAttentionKernel], case: str, repeat: int) -> dict[str, Any]:
    q, kv, b, kv_bytes = batch(case, seed=0)
    outs = {name: torch.zeros_like(q) for name in kerns}
    flush = torch.empty(256 << 20, dtype=torch.uint8)
    times: dict[str, list[float]] = {name: [] for name in kerns}
    for i in range(repeat + 1):
        for name, k in kerns.items():
            flush.add_(1)
            t0 = time.perf_counter()
            k(outs[name], q, kv, b, 0.125)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    base, new = list(kerns)
    row: dict[str, Any] = {"case": case, "kv_mb": kv_bytes / 1e6}
    for name, ts in times.items():
        med = statistics.median(ts)
        row[name] = {
            "median_ms": med * 1e3,
            "min_ms": min(ts) * 1e3,
            "kv_gb_s": kv_bytes / med / 1e9,
        }
    row["speedup"] = row[base]["median_ms"] / row[new]["median_ms"]
    row["max_abs_diff"] = (outs[base] - outs[new]).abs().max().item()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision of the baseline kernel sources")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        libs = {
            args.base: build(sources_at(args.base), Path(d) / "base.so"),
            "working tree": build(sources_at(None), Path(d) / "new.so"),
        }
        kerns = {name: PagedAttentionKernel(ctypes.CDLL(str(path))) for name, path in libs.items()}
        rows = [measure(kerns, case, args.repeat) for case in args.cases.split(",")]
    print(
        f"{'case':16s} {'KV MB':>7s}  " + "  ".join(f"{n[:12]:>24s}" for n in kerns) + "  speedup"
    )
    for r in rows:
        cells = "  ".join(f"{r[n]['median_ms']:8.3f} ms {r[n]['kv_gb_s']:6.1f} GB/s" for n in kerns)
        print(
            f"{r['case']:16s} {r['kv_mb']:7.1f}  {cells}  {r['speedup']:6.2f}x"
            f"  (max diff {r['max_abs_diff']:.1e})"
        )
    path = default_result_path("kernel_ab", "attention")
    write_result(
        path,
        {
            "command": command_line(),
            "machine": machine_info(),
            "base": args.base,
            "threads": args.threads,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
