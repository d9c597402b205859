"""CUDA only: inferd's attention choices A/B, alternating in one engine.

    python bench/cuda_attention.py --compare varlen --shape qwen2-0.5b-shape --dtype bfloat16
    python bench/cuda_attention.py --compare sdpa --shape qwen2-0.5b-shape --dtype bfloat16

`--compare varlen`: every row of an eager step (prefill chunks and their decode rows) in one
varlen FlashAttention call per layer, and CUDA-graph decode steps by the same kernel over padded
block spans (half precision), against the previous path: one SDPA call per prefill chunk and
per decode length group, and SDPA with a padding mask in the graphs.

`--compare sdpa` (on the SDPA path, varlen off): SDPA without cuDNN (inferd's
`attention.sdpa.CUDA_SDPA_BACKENDS`) against PyTorch's own backend choice. On Hopper PyTorch prefers
cuDNN's attention for bfloat16, which builds an execution plan per new shape, and every prefill
chunk is a new length.

Prefix caching is off and each run has fresh prompts, so no variant gains from the one before.
Prints tok/s and the mean step time of steps with and without a prefill; the results and their
commands are in docs/benchmarks.md ("On a GPU").
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
    p.add_argument("--compare", choices=["varlen", "sdpa"], default="varlen")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b-shape")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import torch

    from inferd import LLM, SamplingParams
    from inferd.models.attention import sdpa

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark compares CUDA attention paths")
    shape = SHAPES[args.shape]
    llm = LLM(
        model=str(ensure_model_folder(shape)),
        load_format="dummy",
        dtype=args.dtype,
        device="cuda",
        max_num_seqs=256,
        kv_cache_memory=16 << 30,
        enable_prefix_caching=False,
        seed=0,
    )
    engine = llm.llm_engine
    runner = engine.runner
    inferd_backends = sdpa.CUDA_SDPA_BACKENDS
    varlen_builder, varlen_graphs = runner.attention, runner.decode_graphs
    sdpa_builder = sdpa.SdpaBuilder(runner.block_size, engine.arch.kv_window, runner.device)
    # A second set of decode graphs for the SDPA path (graphs capture their attention).
    runner.enable_decode_graphs(engine.max_model_len, 256, capture=True)
    sdpa_graphs = runner.decode_graphs
    assert sdpa_graphs is not None
    sdpa_graphs.varlen = False
    labels = ["varlen", "sdpa"] if args.compare == "varlen" else ["no_cudnn", "torch_default"]

    def use(label: str) -> None:
        on = label == "varlen"
        runner.attention = varlen_builder if on else sdpa_builder
        runner.decode_graphs = varlen_graphs if on else sdpa_graphs
        sdpa.CUDA_SDPA_BACKENDS = None if label == "torch_default" else inferd_backends

    def run(n: int, seed: int) -> dict[str, float]:
        reqs = make_workload(WorkloadSpec(n, shape.vocab_size, seed))
        prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
        ]
        stats = engine.step_stats
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

    for label in labels:  # warm-up: graph captures for every batch bucket, the allocator
        use(label)
        run(8, 99)
        run(args.num_requests, 98)
    results: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for i, label in enumerate(labels if r % 2 == 0 else labels[::-1]):
            use(label)
            res = run(args.num_requests, 10 + 2 * r + i)
            results[label].append(res)
            print(
                f"{label:<14}{res['tok_s']:9.0f} tok/s   prefill steps "
                f"{res['prefill_step_ms']:8.1f} ms   decode steps {res['decode_step_ms']:6.2f} ms",
                flush=True,
            )
    use(labels[0])
    sdpa.CUDA_SDPA_BACKENDS = inferd_backends
    best = {k: max(x["tok_s"] for x in v) for k, v in results.items()}
    a, b = labels
    print(f"{a} / {b}, best of {args.rounds}: {best[a] / best[b]:.2f}x")
    path = default_result_path(f"cuda_{args.compare}", args.shape)
    write_result(
        path,
        {"command": command_line(), "device": torch.cuda.get_device_name(0), "results": results},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
