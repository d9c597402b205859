"""Many LoRA styles in one UNet forward: its time against the base UNet's.

    .venv/bin/python bench/diffusion_lora.py                   # small SD-layout UNet, CPU
    .venv/bin/python bench/diffusion_lora.py --shape sd15 --device cuda --dtype bfloat16

One UNet forward over `--items` batch items (a request's two guidance rows count as two), each
at its own timestep, 64x64 latents by default (a 512x512 image). Cases, taking turns each round:

- `base`: diffusers' UNet, no styles attached (the baseline every ratio divides by);
- `styles-0`: the same UNet with UNetStyles attached (inferd/diffusion/lora.py), no style rows
  (what turning LoRA on costs);
- `styles-1`: every item under one style;
- `styles-N`: items spread over N styles (`--styles`, default 8), in runs of equal length.

Styles are random rank-`--rank` factors on the attention and feed-forward layers
(to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2; inferd/diffusion/random_style.py). Reported: the
median forward time of each case and its ratio to the `base` forward run beside it, by wall
time and by the process's CPU seconds.
Prints a table and writes JSON (command, machine, every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import save_result, synchronize
from diffusers import UNet2DConditionModel

from inferd.config import LoRAConfig, LoRAModule
from inferd.diffusion.lora import UNetStyles
from inferd.diffusion.random_style import write_random_style

SHAPES: dict[str, dict[str, Any]] = {
    # The SD 1.x layout at 0.3x its widths, for CPUs.
    "small": {"block_out_channels": (96, 192, 384, 384), "cross_attention_dim": 192},
    # diffusers' defaults: Stable Diffusion 1.5's UNet (860M parameters).
    "sd15": {},
}


def unet(shape: str, dtype: torch.dtype, device: str) -> Any:
    torch.manual_seed(0)
    model: Any = UNet2DConditionModel(**SHAPES[shape])
    return model.to(device, dtype).eval()


def forward_s(model: Any, inputs: tuple[torch.Tensor, ...], device: str) -> tuple[float, float]:
    """Wall seconds of one forward, and the process's CPU seconds (steadier on a shared CPU)."""
    synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        model(*inputs)
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--latent", type=int, default=64, help="latent side (image side / 8)")
    parser.add_argument("--styles", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    base, styled = unet(args.shape, dtype, args.device), unet(args.shape, dtype, args.device)
    root = Path(tempfile.mkdtemp(prefix="inferd-styles-"))
    names = [f"s{i}" for i in range(args.styles)]
    for i, name in enumerate(names):
        write_random_style(styled, root / name, rank=args.rank, seed=i)
    modules = tuple(LoRAModule(name=n, path=str(root / n)) for n in names)
    config = LoRAConfig(
        enable_lora=True, lora_modules=modules, max_loras=args.styles, max_lora_rank=args.rank
    )
    styles = UNetStyles(styled, config)
    for name in names:
        styles.load(name).result()
    styles.take_loaded(names)

    n, side = args.items, args.latent
    g = torch.Generator().manual_seed(1)
    inputs = tuple(
        t.to(args.device, dtype) if t.is_floating_point() else t.to(args.device)
        for t in (
            torch.randn(n, 4, side, side, generator=g),
            torch.randint(0, 1000, (n,), generator=g),
            torch.randn(n, 77, styled.config.cross_attention_dim, generator=g),
        )
    )
    per = max(n // args.styles, 1)
    cases: dict[str, list[tuple[str | None, int]]] = {
        "styles-0": [(None, n)],
        "styles-1": [(names[0], n)],
        f"styles-{args.styles}": [(names[(i // per) % args.styles], 1) for i in range(n)],
    }
    forward_s(base, inputs, args.device)  # warm-up
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for case, rows in cases.items():
            styles.set_rows(rows)
            forward_s(styled, inputs, args.device)  # the slots filled, kernels warm
            took, cpu = forward_s(styled, inputs, args.device)
            base_s, base_cpu = forward_s(base, inputs, args.device)
            run = {"case": case, "s": took, "base_s": base_s, "cpu_s": cpu, "base_cpu_s": base_cpu}
            runs.append(run | {"round": round_})
    print(f"{args.shape} {args.dtype} {args.device}: {n} items, {side}x{side} latents")
    summary = {}
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        ratio = statistics.median(r["base_s"] / r["s"] for r in mine)
        cpu_ratio = statistics.median(r["base_cpu_s"] / r["cpu_s"] for r in mine)
        median_s = statistics.median(r["s"] for r in mine)
        summary[case] = {"forward_s": median_s, "vs_base": ratio, "vs_base_cpu": cpu_ratio}
        print(
            f"  {case:10s} {median_s * 1e3:9.1f} ms   {ratio:.3f}x base's speed "
            f"({cpu_ratio:.3f}x by CPU seconds)"
        )
    fields = {"args": vars(args) | {"out": None}, "runs": runs, "summary": summary}
    save_result(args.out, "diffusion_lora", args.shape, fields)


if __name__ == "__main__":
    main()
