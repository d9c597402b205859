"""Few-row linear layers over a model's whole decode weight set: oneDNN's prepacked GEMM against
the native panel GEMM (kernels/panel_gemm.cpp), alternating in one process.

    .venv/bin/python bench/gemv_rows.py --shape qwen2-0.5b-shape --dtype bfloat16
    .venv/bin/python bench/gemv_rows.py --shape llama-32m --dtype float32 --rows 1,2,4,8
    .venv/bin/python bench/gemv_rows.py --shape qwen2-0.5b-shape --dtype bfloat16 --layers-only \
        --rows 256,512,640,768,1024,1280,1536,2048 --repeats 3

A decode step of R sequences multiplies R rows by every linear weight of every layer (and the
lm_head): this runs exactly that, layer after layer with random weights of the model's shapes,
so the weights stream from memory as in the engine (the Qwen2-0.5B shape's 1 GB in bfloat16 does
not fit any cache). `onednn` is `torch.ops.mkldnn._linear_pointwise` on the weights reordered once
(the engine's `onednn` linear layers); `panel` (up to 128 rows; bfloat16 where the CPU has
AVX512_BF16) is kernels/panel_gemm.cpp on the weights packed in panels of 64 output columns (the
engine's batches of up to 128 rows where it has them) on AVX-512, and
`amx` the same kernel on AMX tiles (bfloat16, where the CPU has them: the engine's choice there).
Rows past the panel GEMM's (prefill steps) run oneDNN alone; `--layers-only` leaves the lm_head
out, as a prefill step does. The allocator keeps freed memory as the engine's does
(`keep_freed_memory`), so large outputs are not page-faulted in again on every call.
Each cell is the best
of `--repeats` passes over the whole weight set, the kernels taking turns, so a slow spell of the
machine hits all of them. Row counts a kernel does not take are skipped for it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import save_result, weight_bench_parser
from peers import SHAPES

from inferd.config import read_environment
from inferd.executor.device import keep_freed_memory
from inferd.models import kernels
from inferd.models.kernels.gemv import PanelWeight


def weight_shapes(shape_name: str, lm_head: bool = True) -> list[tuple[int, int]]:
    """(in, out) of every linear layer a decode step multiplies, in order: qkv, o, gate/up, down
    per layer, then the lm_head (unless `lm_head` is False)."""
    s = SHAPES[shape_name]
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    h, inter = s.hidden_size, s.intermediate_size
    layer = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    return layer * s.num_layers + ([(h, s.vocab_size)] if lm_head else [])


def format_row(rows: int, best: dict[str, float], flops: float) -> str:
    """One line of the table: each kernel's best ms, its speed-up over oneDNN, and GFLOP/s of
    the fastest."""
    cells = []
    for k, width in (("panel", 12), ("amx", 10)):
        t = best.get(k)
        cells.append(f"{t * 1e3:8.2f}" if t is not None else f"{'-':>8}")
        ratio = f"{best['onednn'] / t:.2f}x" if t is not None else "-"
        cells.append(f"{ratio:>{width}}")
    return (
        f"{rows:>4}  {best['onednn'] * 1e3:9.2f}  {'  '.join(cells)}"
        f"  {flops / min(best.values()) / 1e9:12.1f}"
    )


def kernels_for(rows: int, panel_rows: int, amx: bool) -> list[str]:
    """The kernels that take `rows` rows here."""
    kinds = ["onednn"]
    if rows <= panel_rows:
        kinds += ["panel", "amx"] if amx else ["panel"]
    return kinds


def main() -> None:
    p = weight_bench_parser(__doc__, "llama-32m", "bfloat16", "1,2,3,4,6,8,12,16,24")
    p.add_argument("--layers-only", action="store_true", help="leave the lm_head out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory(torch.device("cpu"))
    dtype = getattr(torch, args.dtype)
    gemv = kernels.load(read_environment().cache_dir).gemv
    shapes = weight_shapes(args.shape, lm_head=not args.layers_only)
    gen = torch.Generator().manual_seed(0)
    plain = [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for i, o in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]
    # The panel kernel's copies, when it runs here and takes every weight (else no column).
    panel_rows = gemv.panel_rows[dtype]
    packs = [PanelWeight.of(w, None) for w in plain] if panel_rows else []
    panels = [p for p in packs if p is not None] if None not in packs else []
    op = torch.ops.mkldnn._linear_pointwise.default
    weight_bytes = sum(w.numel() * w.element_size() for w in plain)

    def one_pass(kind: str, rows: int) -> float:
        xs = {i: torch.randn(rows, i, generator=gen).to(dtype) for i, _ in shapes}
        t0 = time.perf_counter()
        with torch.inference_mode():
            for n, ((i, _), pw) in enumerate(zip(shapes, packed, strict=True)):
                if kind in ("panel", "amx"):
                    gemv.panel(xs[i], panels[n])
                else:
                    op(xs[i], pw, None, "none", [], "")
        return time.perf_counter() - t0

    def timed(kind: str, rows: int) -> float:
        with gemv.amx_set(kind == "amx"):
            return one_pass(kind, rows)

    table: list[dict[str, Any]] = []
    print(f"{args.shape} {args.dtype}: {len(shapes)} weights, {weight_bytes / 1e9:.2f} GB a pass")
    header = (
        "rows",
        "onednn ms",
        "panel ms",
        "onednn/panel",
        "amx ms",
        "onednn/amx",
        "GFLOP/s best",
    )
    widths = (4, 9, 8, 12, 8, 10, 12)
    print("  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    amx = gemv.amx()
    for rows in (int(r) for r in args.rows.split(",")):
        kinds = kernels_for(rows, panel_rows if panels else 0, amx and dtype == torch.bfloat16)
        best = {k: float("inf") for k in kinds}
        for k in kinds:
            timed(k, rows)  # builds oneDNN's primitive for this row count
        for _ in range(args.repeats):
            for k in kinds:
                best[k] = min(best[k], timed(k, rows))
        flops = 2 * rows * weight_bytes / plain[0].element_size()
        row: dict[str, Any] = {"rows": rows, **{f"{k}_ms": v * 1e3 for k, v in best.items()}}
        print(format_row(rows, best, flops))
        table.append(row)
    fields = {"shape": args.shape, "dtype": args.dtype, "weight_bytes": weight_bytes}
    fields |= {"layers_only": args.layers_only}
    fields |= {"rows": table}
    save_result(args.out, "gemv_rows", f"{args.shape}-{args.dtype}", fields)


if __name__ == "__main__":
    main()
