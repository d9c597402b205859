"""The greedy screen (kernels/greedy.py) against the whole lm_head, alternating in one process.

    .venv/bin/python bench/greedy_head.py --shape qwen2-0.5b-shape --dtype float32
    .venv/bin/python bench/greedy_head.py --shape qwen2-0.5b-shape --dtype bfloat16 --rows 1,4,8,12
    .venv/bin/python bench/greedy_head.py --dtype bfloat16 --rows 8,24,32 --base 073f63b

`full` is what a greedy step runs without the screen: the panel GEMM over the whole lm_head (its
logits in the model dtype), then the native argmax. `screen` is the int8 screen alone (quantize
the rows, VPDPBUSD over the int8 copy, the bounds, the candidates); `head` the whole greedy head:
the screen, then the candidates' exact logits from the row-major weight (the shape's lm_head is
tied to the embedding, as the Qwen2-0.5B shape's is; `--from-panels` reads them from the panel
copy instead, as an untied lm_head's are) and their argmax, all in one native call;
`torch-pack` the same head with the candidates' rows gathered and packed into panels by torch
ops, as it ran before the ninth session (always from the row-major weight). Random weights at a
trained lm_head's scale (std 0.02, the shapes' initializer) and hidden rows of unit RMS, as the
final RMSNorm gives.
Each cell is the best of `--repeats` calls; the tokens are checked equal every time.
`--base REV`: also the screen of the kernel sources at that git revision (built as
bench/kernel_ab.py builds them), timed alternately with this tree's on the same rows and checked
to find the same candidates; `base ms` and this tree's speed-up over it. Where the CPU has AMX
(kernels/x86/amx_panel.h), `avx512 ms` is the screen with AMX off, timed alternately with it.
"""

from __future__ import annotations

import ctypes
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import save_result, weight_bench_parser
from kernel_ab import build, sources_at
from peers import SHAPES

from inferd.config import read_environment
from inferd.models import kernels
from inferd.models.kernels.gemv import Gemv, PanelWeight
from inferd.models.kernels.greedy import GreedyHead, GreedyScreen


def best_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's best of `repeats` calls, in ms, the functions taking turns."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


def base_screen(rev: str, tmp: Path) -> GreedyScreen:
    """The greedy screen of the kernel sources at git revision `rev`."""
    return GreedyScreen(ctypes.CDLL(str(build(sources_at(rev), tmp / "base.so"))))


def avx512_screen(head: GreedyHead, gemv: Gemv, x: torch.Tensor) -> object:
    """The screen's candidates with the tiles off."""
    with gemv.amx_set(False):
        return head.candidates(x)


def format_row(rows: int, candidates: int, t: dict[str, float]) -> str:
    """One line of the table from the best ms of each function."""
    line = (
        f"{rows:>4}  {t['full']:>8.2f}  {t['head']:>8.2f}  {t['screen']:>9.2f}  "
        f"{candidates:>10}  {t['full'] / t['head']:7.2f}x  {t['torch_pack']:>13.2f}  "
        f"{t['torch_pack'] / t['head']:14.2f}x"
    )
    if "base" in t:
        line += f"  {t['base']:>8.2f}  {t['base'] / t['screen']:10.2f}x"
    if "avx512" in t:
        line += f"  {t['avx512']:>9.2f}  {t['avx512'] / t['screen']:12.2f}x"
    return line


def main() -> None:
    p = weight_bench_parser(__doc__, "qwen2-0.5b-shape", "float32", "1,8,16,24,48,96")
    p.add_argument("--from-panels", action="store_true")
    p.add_argument("--base", default=None, help="git revision whose screen to time alongside")
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
    plain = None if args.from_panels else w
    head = GreedyHead.of(native.screen, native.gemv.panel_rows, panel, plain, min_columns=0)
    build_s = time.perf_counter() - t0
    assert head is not None, "the greedy screen does not run here"
    print(f"{args.shape} lm_head {tuple(w.shape)} {args.dtype}: screen built in {build_s:.2f} s")

    tmp = tempfile.TemporaryDirectory()
    base = base_screen(args.base, Path(tmp.name)) if args.base else None
    cand = torch.empty(head.max_candidates, dtype=torch.int32)
    header: tuple[str, ...] = ("rows", "full ms", "head ms", "screen ms", "candidates", "speed-up")
    header += ("torch-pack ms", "head/torch-pack")
    widths: tuple[int, ...] = (4, 8, 8, 9, 10, 8, 13, 15)
    if base is not None:
        header, widths = (*header, "base ms", "screen/base"), (*widths, 8, 11)
    amx = native.gemv.amx()
    if amx:
        header, widths = (*header, "avx512 ms", "avx512/screen"), (*widths, 9, 13)
    print("  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
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

        def torch_pack(x: torch.Tensor = x) -> torch.Tensor:
            # The head before it was one native call (see the module docstring).
            c = head.candidates(x)
            assert c is not None
            exact = PanelWeight.of(w[c], None)
            assert exact is not None
            return c[native.ops.argmax(native.gemv.panel(x, exact))]

        assert torch.equal(torch_pack(), want)
        fns: dict[str, Callable[[], object]] = {
            "full": full,
            "head": lambda x=x: head(x),  # type: ignore[misc]
            "screen": lambda x=x: head.candidates(x),  # type: ignore[misc]
            "torch_pack": torch_pack,
        }
        if base is not None:
            n = base(x, head.weight, panel.out_features, cand)
            assert torch.equal(cand[:n].long(), cols), "the base screen's candidates differ"
            fns["base"] = lambda x=x: base(x, head.weight, panel.out_features, cand)  # type: ignore[misc]
        if amx:
            fns["avx512"] = lambda x=x: avx512_screen(head, native.gemv, x)  # type: ignore[misc]
        t = best_ms(fns, args.repeats)
        print(format_row(rows, len(cols), t))
        table.append(
            {"rows": rows, **{f"{k}_ms": v for k, v in t.items()}, "candidates": len(cols)}
        )
    tmp.cleanup()
    fields = {"shape": args.shape, "dtype": args.dtype, "from_panels": args.from_panels}
    fields |= {"base": args.base}
    fields |= {"build_s": build_s, "rows": table}
    save_result(args.out, "greedy_head", f"{args.shape}-{args.dtype}", fields)


if __name__ == "__main__":
    main()
