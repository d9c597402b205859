"""CUDA only: inferd's SDPA backend choice (no cuDNN) against PyTorch's own, in one engine.

    python bench/cuda_sdpa.py --shape qwen2-0.5b-shape --dtype bfloat16 --rounds 2

On Hopper PyTorch prefers cuDNN's attention for bfloat16, which builds an execution plan per new
shape; every prefill chunk is a new length. One `LLM` runs the same kind of workload (fresh
prompts each run, so no prefix-cache hits) alternating `attention.CUDA_SDPA_BACKENDS` between
inferd's list and None (PyTorch's choice), and prints tok/s and the mean step time of steps with
and without a prefill. The result and its command are in docs/benchmarks.md ("On a GPU").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import (
    SHAPES,
    WorkloadSpec,
    command_line,
    default_result_path,
    ensure_model_folder,
    make_workload,
    write_result,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b-shape")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import torch

    from inferd import LLM, SamplingParams
    from inferd.models import attention

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark compares CUDA attention backends")
    shape = SHAPES[args.shape]
    llm = LLM(
        model=str(ensure_model_folder(shape)),
        load_format="dummy",
        dtype=args.dtype,
        device="cuda",
        kv_cache_memory=16 << 30,
        seed=0,
    )
    inferd_choice = attention.CUDA_SDPA_BACKENDS

    def run(n: int, seed: int) -> dict[str, float]:
        reqs = make_workload(WorkloadSpec(n, shape.vocab_size, seed))
        prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
        ]
        stats = llm.llm_engine.step_stats
        stats.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = list(stats.steps)
        prefill = [s.total for s in steps if s.num_prefill_tokens]
        decode = [s.total for s in steps if not s.num_prefill_tokens]
        return {
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "prefill_step_ms": 1e3 * sum(prefill) / max(len(prefill), 1),
            "decode_step_ms": 1e3 * sum(decode) / max(len(decode), 1),
        }

    run(4, 99)  # warm-up: captures, allocator
    results: dict[str, list[dict[str, float]]] = {"inferd": [], "torch_default": []}
    for r in range(args.rounds):
        order = ["inferd", "torch_default"] if r % 2 == 0 else ["torch_default", "inferd"]
        for i, label in enumerate(order):
            attention.CUDA_SDPA_BACKENDS = inferd_choice if label == "inferd" else None
            res = run(args.num_requests, 10 + 2 * r + i)
            results[label].append(res)
            print(
                f"{label:<14}{res['tok_s']:9.0f} tok/s   prefill steps "
                f"{res['prefill_step_ms']:8.1f} ms   decode steps {res['decode_step_ms']:6.2f} ms",
                flush=True,
            )
    attention.CUDA_SDPA_BACKENDS = inferd_choice
    best = {k: max(x["tok_s"] for x in v) for k, v in results.items()}
    print(
        f"inferd / torch default, best of {args.rounds}: "
        f"{best['inferd'] / best['torch_default']:.2f}x"
    )
    path = default_result_path("cuda_sdpa", args.shape)
    write_result(
        path,
        {"command": command_line(), "device": torch.cuda.get_device_name(0), "results": results},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
