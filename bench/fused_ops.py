"""The native CPU kernels on and off, in one engine, alternating (offline, no server).

    .venv/bin/python bench/fused_ops.py --shape llama-32m --rounds 3
    .venv/bin/python bench/fused_ops.py --shape qwen2-0.5b-shape --rounds 1
    .venv/bin/python bench/fused_ops.py --dtypes float32 --quantization int8   # the int8 GEMV

One `LLM` (random weights, prefix caching off so every round computes every prompt) runs the same
workload in four variants, in turn:

    native    the engine's default: the fused elementwise kernels, the small-batch GEMV, and
              decode steps of up to 128 rows with panel copies (without: 1-16; int8: 1-8)
              through every layer in one native call (decode_step.cpp)
    layers    the same kernels called layer by layer from Python
    no_gemv   the fused kernels; every linear layer on oneDNN's prepacked GEMM (with
              `--quantization int8`: on fbgemm's int8 GEMM)
    eager     neither: eager PyTorch elementwise ops, oneDNN for every linear layer

The native attention kernel runs in all four. Alternating inside one process makes a slow spell
on a shared machine hit every variant alike; the best round of each is reported, with the
process's CPU seconds per output token. Workloads: `mixed` (all requests at once, prompts 16-256,
outputs 16-128; 96 requests on llama-32m, 32 on the Qwen2-0.5B shape) and `single` (one stream,
32-token prompt, 256 tokens), as bench/peers.py sends them to servers, and `streamsN` (`--streams`,
default 4, 8 and 16: N such streams at once, the batches the native decode step takes past one row).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import (
    DEFAULT_CACHE_DIR,
    ModelShape,
    WorkloadSpec,
    command_line,
    default_result_path,
    ensure_model_folder,
    machine_info,
    make_workload,
    write_result,
)
from peers import MIXED_REQUESTS, SHAPES  # the shapes and request counts bench/peers.py serves

SHAPE_CHOICES: dict[str, ModelShape] = {k: SHAPES[k] for k in ("llama-32m", "qwen2-0.5b-shape")}


def workload(shape: ModelShape, kind: str, seed: int) -> WorkloadSpec:
    """`mixed`, `single`, or `streamsN`: N streams like the single one, at once."""
    if kind == "mixed":
        return WorkloadSpec(MIXED_REQUESTS[shape.name], shape.vocab_size, seed, 16, 256, 16, 128)
    streams = 1 if kind == "single" else int(kind.removeprefix("streams"))
    return WorkloadSpec(streams, shape.vocab_size, seed, 32, 32, 256, 256)


def measure(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    import torch

    from inferd import LLM, SamplingParams
    from inferd.config import read_environment
    from inferd.engine.llm_engine import TokensPrompt
    from inferd.models import kernels
    from inferd.models.kernels.decode import DecodeLayers
    from inferd.models.kernels.fused import FusedOps
    from inferd.models.kernels.gemv import Gemv
    from inferd.models.linear import Linear

    shape = SHAPE_CHOICES[args.shape]
    folder = ensure_model_folder(shape, DEFAULT_CACHE_DIR)
    llm = LLM(
        model=str(folder),
        dtype=dtype,
        native_linear="on",
        quantization=args.quantization,
        load_format="dummy",
        num_threads=args.threads,
        seed=args.seed,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.runner
    if runner.attn_kernel is None:
        raise SystemExit("the native kernels are not loaded here: nothing to compare")
    native = kernels.load(read_environment().cache_dir)
    model = runner.model
    assert isinstance(model, torch.nn.Module)
    # native_linear "on" keeps oneDNN's (fbgemm's) copy: the plans' last route runs on it.
    plans = {m: m.plan for m in model.modules() if isinstance(m, Linear)}
    variants: dict[str, tuple[FusedOps | None, Gemv | None, DecodeLayers | None]] = {
        "native": (native.ops, native.gemv, native.decode),
        "layers": (native.ops, native.gemv, None),
        "no_gemv": (native.ops, None, None),
        "eager": (None, None, None),
    }
    results: dict[str, Any] = {}
    for kind in ("mixed", "single", *(f"streams{n}" for n in args.streams)):
        reqs = make_workload(workload(shape, kind, args.seed))
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
        ]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for name, (ops, gemv, decode) in variants.items():
                for m, plan in plans.items():  # without the GEMV: the plan's oneDNN/fbgemm route
                    m.plan = plan if gemv is not None else plan[-1:]
                model.use_fused_ops(ops, decode)
                c0, t0 = time.process_time(), time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                tok_s, cpu_ms = n / wall, cpu / n * 1e3
                old = best.get(name, (0.0, float("inf")))
                best[name] = (max(old[0], tok_s), min(old[1], cpu_ms))
        for m, plan in plans.items():
            m.plan = plan
        model.use_fused_ops(native.ops, native.decode)
        results[kind] = {name: {"tok_s": t, "cpu_ms_per_token": c} for name, (t, c) in best.items()}
        a, y, f, e = best["native"], best["layers"], best["no_gemv"], best["eager"]
        label = f"{dtype}+{args.quantization}" if args.quantization else dtype
        print(
            f"{args.shape} {label} {kind:9s} native {a[0]:8.1f} tok/s ({a[1]:.2f} CPU ms/tok)"
            f"   layers {y[0]:8.1f} ({y[1]:.2f})   no_gemv {f[0]:8.1f} ({f[1]:.2f})"
            f"   eager {e[0]:8.1f} ({e[1]:.2f})   decode step {a[0] / y[0]:.2f}x"
            f"  gemv {y[0] / f[0]:.2f}x  fused {f[0] / e[0]:.2f}x"
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPE_CHOICES), default="llama-32m")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated model dtypes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["int8"], default=None, help="weight quantization")
    p.add_argument(
        "--streams",
        type=lambda s: [int(n) for n in s.split(",") if n],
        default=[4, 8, 16],
        help="also N streams at once (comma-separated N; the decode step takes up to 128 rows)",
    )
    args = p.parse_args()
    out = {dtype: measure(args, dtype) for dtype in args.dtypes.split(",")}
    path = default_result_path("fused_ops", args.shape)
    write_result(path, {"command": command_line(), "machine": machine_info(), "results": out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
