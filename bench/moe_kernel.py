"""The native MoE call (`inferd_moe_layer`) of two source revisions, alternating in one process.

    .venv/bin/python bench/moe_kernel.py --base main                  # base vs the working tree
    .venv/bin/python bench/moe_kernel.py --base main --tokens 512 --threads 1 --repeat 20

Builds the kernel library from the sources at `--base` and from the working tree (as
bench/kernel_ab.py builds them), and times each build's MoE call on the same layer: bench/peers.py's
`qwen3-moe` shape (hidden 1,024, 32 experts of 256, top 8, renormalised routing weights), random
weights packed in panels as the engine packs them, each token's experts drawn at random, freed
memory kept mapped as the engine keeps it (executor/device.py's keep_freed_memory). Calls
alternate build by build, so a slow spell of a shared machine hits both alike. For each token
count and thread count it prints the median call's GFLOP/s by the process's CPU seconds (what the
cores did, which another job's load barely enters; with 2 threads it counts a waiting thread's
spinning too) and by wall time, the ratio of the medians, and whether the two builds' outputs are
bit-equal (their largest difference where not). FLOPs: 2 x (2I x H + H x I) per (token, expert).
Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import command_line, default_result_path, machine_info, write_result
from kernel_ab import build, sources_at

from inferd.executor.device import keep_freed_memory
from inferd.models.kernels.fused import FusedOps, MoEPanels
from inferd.models.kernels.gemv import PanelWeight

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 256, 32, 8


def layer(dtype: torch.dtype, seed: int) -> tuple[list[PanelWeight], list[PanelWeight]]:
    """Every expert's gate/up [2I, H] and down [H, I] weights, packed."""
    g = torch.Generator().manual_seed(seed)
    ups, downs = [], []
    for _ in range(EXPERTS):
        w13 = (torch.randn(2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5).to(dtype)
        w2 = (torch.randn(HIDDEN, INTER, generator=g) * INTER**-0.5).to(dtype)
        up, down = PanelWeight.of(w13, None), PanelWeight.of(w2, None)
        assert up is not None and down is not None
        ups.append(up)
        downs.append(down)
    return ups, downs


def batch(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(x [T, H], experts [T, k], weights [T, k]): top-k of random scores, renormalised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=g), dim=-1)
    w, e = torch.topk(probs, TOP_K, dim=-1)
    return x, e, (w / w.sum(dim=-1, keepdim=True)).to(dtype)


def measure(
    ops: dict[str, FusedOps], panels: MoEPanels, tokens: int, dtype: torch.dtype, repeat: int
) -> dict[str, Any]:
    x, experts, weights = batch(tokens, dtype, seed=tokens)
    flops = 2 * tokens * TOP_K * (2 * INTER * HIDDEN + HIDDEN * INTER)
    cpu: dict[str, list[float]] = {name: [] for name in ops}
    wall: dict[str, list[float]] = {name: [] for name in ops}
    outs: dict[str, torch.Tensor] = {}
    for i in range(repeat + 1):
        for name, op in ops.items():
            c0, t0 = time.process_time(), time.perf_counter()
            done = op.moe_layer(x, experts, weights, panels, INTER)
            t1, c1 = time.perf_counter(), time.process_time()
            assert done is not None
            outs[name] = done[0]
            if i:  # the first round warms up
                cpu[name].append(c1 - c0)
                wall[name].append(t1 - t0)
    row: dict[str, Any] = {"tokens": tokens, "gflop": flops / 1e9}
    for name in ops:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        row[name] = {
            "cpu_ms": c * 1e3,
            "wall_ms": w * 1e3,
            "gflops_cpu": flops / c / 1e9,
            "gflops_wall": flops / w / 1e9,
        }
    base, new = list(ops)
    row["speedup_wall"] = row[base]["wall_ms"] / row[new]["wall_ms"]
    row["speedup_cpu"] = row[base]["cpu_ms"] / row[new]["cpu_ms"]
    row["bit_equal"] = torch.equal(outs[base], outs[new])
    row["max_abs_diff"] = (outs[base].float() - outs[new].float()).abs().max().item()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision of the baseline kernel sources")
    p.add_argument("--tokens", default="16,128,512", help="comma-separated token counts")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_freed_memory(torch.device("cpu"))  # as the engine runs: the scratch is not re-faulted
    ups, downs = layer(dtype, seed=0)
    panels = MoEPanels(
        [w.packed.data_ptr() for w in ups], [w.packed.data_ptr() for w in downs], 1 << 30
    )
    rows = []
    with tempfile.TemporaryDirectory() as d:
        libs = {
            args.base: build(sources_at(args.base), Path(d) / "base.so"),
            "working tree": build(sources_at(None), Path(d) / "new.so"),
        }
        ops = {name: FusedOps(ctypes.CDLL(str(path))) for name, path in libs.items()}
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for tokens in (int(t) for t in args.tokens.split(",")):
                row = measure(ops, panels, tokens, dtype, args.repeat)
                row["threads"] = threads
                rows.append(row)
                cells = "  ".join(
                    f"{r['gflops_cpu']:6.1f} cpu {r['gflops_wall']:6.1f} wall"
                    for r in (row[n] for n in ops)
                )
                print(
                    f"threads {threads} tokens {tokens:4d}  GFLOP/s {cells}"
                    f"  speedup wall {row['speedup_wall']:.3f}x cpu {row['speedup_cpu']:.3f}x"
                    f"  bit-equal {row['bit_equal']}"
                    + ("" if row["bit_equal"] else f" (max diff {row['max_abs_diff']:.1e})"),
                    flush=True,
                )
    path = default_result_path("moe_kernel", args.dtype)
    write_result(
        path,
        {
            "command": command_line(),
            "machine": machine_info(),
            "base": args.base,
            "dtype": args.dtype,
            "builds": list(libs),
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
