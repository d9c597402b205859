"""Image serving under Poisson arrivals: step-level batching against the peers' two shapes.

    .venv/bin/python bench/diffusion.py                       # inferd-tiny-sd, 48 requests
    .venv/bin/python bench/diffusion.py --load 2.0 --num-requests 96
    .venv/bin/python bench/diffusion.py --rate 6 --servers inferd inferd   # a fixed rate, A/B

Workload (seeded): Poisson arrivals, steps uniform in [10, 50], two resolutions (the model's
native size and 1.5x it, half the requests each), guidance 7.5, one image a request. Four
servers, each on the same model in this process, taking turns (`--servers` picks some):

- `sequential`: one `StableDiffusionPipeline` call per request, FIFO, one at a time (the shape of
  diffusers' example server);
- `request-batching`: whole requests batched: the worker takes the oldest waiting request and
  every other waiting one with the same size and step count (up to `--max-batch`) into one
  pipeline call, each with its own seeded generator (the shape of Triton's and SGLang's dynamic
  batching: a batch must share its shape and schedule);
- `inferd`: the image engine (step-level batching, `--max-rows` rows a forward);
- `inferd-styles`: the same engine with `--styles` random LoRA styles (rank `--style-rank`,
  inferd/diffusion/random_style.py) and every request naming one, in turn: the same
  arrivals, so its images/s over `inferd`'s, run beside it, is what serving many styles in one
  batch costs (issue 38's target: >= 0.8). `--styles 0` leaves it out.

The three run in-process (no HTTP: the transport costs the same for each, and this isolates
the scheduling). The arrival rate is `--load` times what `sequential` can serve, calibrated
first from solo requests, so at the default 1.5 the sequential server saturates. Reported:
images/s (finished images over the span from the first arrival to the last completion) and
latency (arrival to images) p50/p99. JSON (command, machine, workload, every number) goes to
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import DEFAULT_CACHE_DIR, save_result, torch_threads

from inferd.config import ImageEngineConfig, LoRAConfig, LoRAModule
from inferd.diffusion.client import AsyncImageEngine
from inferd.diffusion.loader import resolve_image_model
from inferd.diffusion.random_style import write_random_style
from inferd.diffusion.request import ImageParams, ImageRequest, ImagesDone


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start
    params: ImageParams


def workload(num: int, rate: float, native: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    big = (native * 3 // 2) // 8 * 8
    t, out = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        size = native if i % 2 == 0 else big
        steps = rng.randint(10, 50)
        params = ImageParams(
            f"prompt {i}", num_inference_steps=steps, width=size, height=size, seed=i
        )
        out.append(Arrival(t, params))
    return out


# -- the two peer shapes: a worker thread over one diffusers pipeline ----------------------------


class PipelineServer:
    """Requests go into a FIFO; one worker thread runs pipeline calls of up to `max_batch`
    requests that share size and steps (max_batch=1: the sequential server)."""

    def __init__(self, pipe: Any, max_batch: int) -> None:
        self.pipe = pipe
        self.max_batch = max_batch
        self.waiting: list[tuple[ImageParams, Callable[[], None]]] = []
        self.cv = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    async def submit(self, params: ImageParams) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def finish() -> None:
            loop.call_soon_threadsafe(done.set_result, None)

        with self.cv:
            self.waiting.append((params, finish))
            self.cv.notify()
        await done

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join()

    def _take(self) -> list[tuple[ImageParams, Callable[[], None]]] | None:
        with self.cv:
            while not self.waiting and not self.stopped:
                self.cv.wait()
            if self.stopped:
                return None
            head = self.waiting[0][0]
            key = (head.width, head.height, head.num_inference_steps)
            batch = [w for w in self.waiting if _key(w[0]) == key][: self.max_batch]
            self.waiting = [w for w in self.waiting if w not in batch]
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            head = batch[0][0]
            self.pipe(
                [p.prompt for p, _ in batch],
                num_inference_steps=head.num_inference_steps,
                guidance_scale=7.5,
                width=head.width,
                height=head.height,
                generator=[torch.Generator("cpu").manual_seed(p.seed or 0) for p, _ in batch],
                output_type="np",
            )
            for _, finish in batch:
                finish()


def _key(p: ImageParams) -> tuple[int, int, int]:
    return p.width, p.height, p.num_inference_steps


# -- running one server over the workload --------------------------------------------------------


async def drive(submit: Callable[[ImageParams], Any], arrivals: list[Arrival]) -> dict[str, Any]:
    start = time.monotonic()
    latencies: list[float] = []

    async def one(a: Arrival) -> None:
        await asyncio.sleep(max(0.0, start + a.at - time.monotonic()))
        t0 = time.monotonic()
        await submit(a.params)
        latencies.append(time.monotonic() - t0)

    await asyncio.gather(*(one(a) for a in arrivals))
    span = time.monotonic() - start - arrivals[0].at
    ordered = sorted(latencies)
    return {
        "images_per_s": len(arrivals) / span,
        "p50_s": statistics.median(ordered),
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "span_s": span,
    }


async def run_inferd(cfg: ImageEngineConfig, cache: Path, arrivals: list[Arrival]) -> Any:
    engine = await AsyncImageEngine.start(cfg, cache)
    counter = iter(range(10**9))

    async def submit(params: ImageParams) -> None:
        async for event in engine.generate(ImageRequest(f"b{next(counter)}", params)):
            if isinstance(event, ImagesDone):
                return

    try:
        result = await drive(submit, arrivals)
        stats = engine.stats()
        result["rows_per_forward"] = stats.unet_rows_total / max(1, stats.unet_forwards_total)
        return result
    finally:
        await engine.shutdown()


async def run_pipeline(pipe: Any, max_batch: int, arrivals: list[Arrival]) -> Any:
    server = PipelineServer(pipe, max_batch)
    try:
        return await drive(server.submit, arrivals)
    finally:
        await asyncio.to_thread(server.stop)


def calibrate(pipe: Any, native: int) -> float:
    """Seconds the sequential server needs per request of the workload's mix (30 steps, both
    sizes), after one warm-up call."""
    big = (native * 3 // 2) // 8 * 8
    pipe("warm", num_inference_steps=2, width=native, height=native, output_type="np")
    times = []
    for size in (native, big):
        t0 = time.monotonic()
        pipe("x", num_inference_steps=30, width=size, height=size, output_type="np")
        times.append(time.monotonic() - t0)
    return statistics.mean(times)


SERVERS = ("sequential", "request-batching", "inferd", "inferd-styles")


def with_styles(
    cfg: ImageEngineConfig, folder: Path, root: Path, count: int, rank: int
) -> ImageEngineConfig:
    """`cfg` serving `count` random styles written under `root` (all in one forward's slots)."""
    modules = [
        LoRAModule(
            name=f"style-{i}",
            path=str(write_random_style(folder, root / f"s{i}", rank=rank, seed=i)),
        )
        for i in range(count)
    ]
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=tuple(modules),
        max_loras=max(1, count),
        max_lora_rank=max(16, rank),
    )
    return cfg.model_copy(update={"lora": lora})


def styles_ratio(runs: list[dict[str, Any]], round_: int) -> None:
    """Prints (and records in the styled run) its images/s over the no-style run of the round."""
    by_server = {run["server"]: run for run in runs if run["round"] == round_}
    if "inferd" in by_server and "inferd-styles" in by_server:
        styled = by_server["inferd-styles"]
        styled["ratio_to_inferd"] = styled["images_per_s"] / by_server["inferd"]["images_per_s"]
        print(f"inferd-styles / inferd: {styled['ratio_to_inferd']:.2f}x images/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="inferd-tiny-sd")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--load", type=float, default=1.5, help="arrival rate / sequential capacity")
    p.add_argument("--rate", type=float, default=None, help="arrivals/s (instead of --load)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--styles", type=int, default=8, help="styles of the inferd-styles run")
    p.add_argument("--style-rank", type=int, default=8)
    p.add_argument(
        "--servers",
        nargs="+",
        default=list(SERVERS),
        choices=SERVERS,
        help="the servers to run (default: all)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import diffusers

    cache = DEFAULT_CACHE_DIR
    folder = resolve_image_model(args.model, cache)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        folder, use_safetensors=True, safety_checker=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    native = int(pipe.unet.config.sample_size) * pipe.vae_scale_factor
    cfg = ImageEngineConfig(image_model=args.model, max_image_rows_per_step=args.max_rows)
    styles_dir = tempfile.TemporaryDirectory(prefix="inferd-styles-")
    styled = with_styles(cfg, folder, Path(styles_dir.name), args.styles, args.style_rank)
    servers = [s for s in args.servers if s != "inferd-styles" or args.styles > 0]
    runs: list[dict[str, Any]] = []
    with torch_threads(args.threads), styles_dir:
        service_s = calibrate(pipe, native)
        rate = args.rate or args.load / service_s
        arrivals = workload(args.num_requests, rate, native, args.seed)
        print(f"sequential service {service_s:.3f} s/request; arrivals {rate:.2f}/s")
        for r in range(args.rounds):
            for name in servers:
                if name == "inferd":
                    result = asyncio.run(run_inferd(cfg, cache, arrivals))
                elif name == "inferd-styles":
                    names = [m.name for m in styled.lora.lora_modules]
                    mixed = [
                        dataclasses.replace(
                            a, params=dataclasses.replace(a.params, lora_name=names[i % len(names)])
                        )
                        for i, a in enumerate(arrivals)
                    ]
                    result = asyncio.run(run_inferd(styled, cache, mixed))
                else:
                    batch = 1 if name == "sequential" else args.max_batch
                    result = asyncio.run(run_pipeline(pipe, batch, arrivals))
                runs.append({"round": r, "server": name, **result})
                print(
                    f"{name:17s} {result['images_per_s']:6.2f} images/s  "
                    f"p50 {result['p50_s']:6.2f} s  p99 {result['p99_s']:6.2f} s"
                )
            styles_ratio(runs, r)
    save_result(
        args.out,
        "diffusion",
        args.model,
        {"service_s": service_s, "rate": rate, "args": vars(args), "runs": runs},
    )


if __name__ == "__main__":
    main()
