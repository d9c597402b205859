"""The greedy screen (kernels/greedy.py) against the whole lm_head, alternating in one process.

    .venv/bin/python bench/greedy_head.py --shape qwen2-0.5b-shape --dtype float32
    .venv/bin/python bench/greedy_head.py --shape qwen2-0.5b-shape --dtype bfloat16 --rows 1,4,8,12

`full` is what a greedy step runs without the screen: the panel GEMM over the whole lm_head (its
logits in the model dtype), then the native argmax. `screen` is the int8 screen alone (quantize
the rows, VPDPBUSD over the int8 copy, the bounds, the candidates); `head` the whole greedy head:
the screen, then the candidates' exact logits from the row-major weight (the shape's lm_head is
tied to the embedding, as the Qwen2-0.5B shape's is; `--from-panels` reads them from the panel
copy instead, as an untied lm_head's are) and their argmax. Random weights at a trained lm_head's
scale (std 0.02, the shapes' initializer) and hidden rows of unit RMS, as the final RMSNorm gives.
Each cell is the best of `--repeats` calls; the tokens are checked equal every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from common import save_result, weight_bench_parser
from peers import SHAPES

from inferd.config import read_environment
from inferd.models import kernels
from inferd.models.kernels.gemv import PanelWeight
from inferd.models.kernels.greedy import GreedyHead


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = weight_bench_parser(__doc__, "qwen2-0.5b-shape", "float32", "1,8,16,24,48,96")
    p.add_argument("--from-panels", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    native = kernels.load(read_environment().cache_dir)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape.vocab_size, shape.hidden_size, generator=gen) * 0.02).to(dtype)
    panel = PanelWeight.of(w, None)
    assert panel is not None
    t0 = time.perf_counter()
    every_row = {torch.float32: 128, torch.bfloat16: 128}  # time rows the default would not take
    head = GreedyHead.of(
        native.screen,
        native.gemv,
        native.ops,
        panel,
        None if args.from_panels else w,
        min_columns=0,
        max_rows=every_row,
    )
    build_s = time.perf_counter() - t0
    assert head is not None, "the greedy screen does not run here"
    print(f"{args.shape} lm_head {tuple(w.shape)} {args.dtype}: screen built in {build_s:.2f} s")
    header = ("rows", "full ms", "head ms", "screen ms", "candidates", "speed-up")
    print("  ".join(f"{h:>{w}}" for h, w in zip(header, (4, 8, 8, 9, 10, 8), strict=True)))
    table: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, shape.hidden_size, generator=gen).to(dtype)

        def full(x: torch.Tensor = x) -> torch.Tensor:
            return native.ops.argmax(native.gemv.panel(x, panel))

        want, got = full(), head(x)
        cols = head.candidates(x)
        if got is None or cols is None:
            # More candidates than the head takes (an eighth of the columns): it declines and the
            # engine runs the whole lm_head, so there is nothing to time.
            print(f"{rows:>4}  more candidates than the screen takes: the whole lm_head runs")
            continue
        assert torch.equal(got, want), "the screen's tokens differ"
        t_full = best_ms(full, args.repeats)
        t_head = best_ms(lambda x=x: head(x), args.repeats)  # type: ignore[misc]
        t_screen = best_ms(lambda x=x: head.candidates(x), args.repeats)  # type: ignore[misc]
        print(
            f"{rows:>4}  {t_full:>8.2f}  {t_head:>8.2f}  {t_screen:>9.2f}  {len(cols):>10}  "
            f"{t_full / t_head:.2f}x"
        )
        table.append(
            {
                "rows": rows,
                "full_ms": t_full,
                "head_ms": t_head,
                "screen_ms": t_screen,
                "candidates": len(cols),
            }
        )
    fields = {"shape": args.shape, "dtype": args.dtype, "from_panels": args.from_panels}
    fields |= {"build_s": build_s, "rows": table}
    save_result(args.out, "greedy_head", f"{args.shape}-{args.dtype}", fields)


if __name__ == "__main__":
    main()
