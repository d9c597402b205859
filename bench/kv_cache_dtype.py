"""KV cache element types side by side, in one process, alternating (offline, no server).

    .venv/bin/python bench/kv_cache_dtype.py --shape llama-32m --rounds 2
    .venv/bin/python bench/kv_cache_dtype.py --kv-dtypes auto,int8 --workloads mixed

One `LLM` per `--kv-cache-dtype` runs the same workloads in turn, round after round, so a slow
spell on a shared machine hits every variant alike; the best round of each is reported, with the
process's CPU seconds per output token. The model is bench/peers.py's checkpoint (weights drawn as
transformers initializes them, normal at 0.02: attention is not flat, as it is with
`load_format="dummy"`'s tiny uniform weights) in `--dtype`, prefix caching off so every round
computes every prompt. Workloads are bench/fused_ops.py's: `mixed` (all requests at once, prompts
16-256, outputs 16-128) and `single` (one stream, 32-token prompt, 256 tokens), plus `long` (one
stream after a 1,700-token prompt, where the cache's bytes weigh most on a single stream).

Accuracy against the `auto` cache (the model dtype), on the mixed workload's prompts:
the first token's top-1 agreement and the largest error of the reference top token's
log-probability (both engines' top 20 log-probabilities), and the share of greedy tokens equal
to the reference's over the whole workload (they part at the first near-tie). Also each cache's
bytes per token. Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import (
    DEFAULT_CACHE_DIR,
    WorkloadSpec,
    command_line,
    default_result_path,
    machine_info,
    make_workload,
    write_result,
)
from fused_ops import SHAPE_CHOICES, workload
from peers import weights_folder

TOP = 20


def _spec(args: argparse.Namespace, kind: str) -> WorkloadSpec:
    shape = SHAPE_CHOICES[args.shape]
    if kind == "long":
        return WorkloadSpec(1, shape.vocab_size, args.seed, 1700, 1700, 256, 256)
    return workload(shape, kind, args.seed)


def _first_logprobs(llm: Any, prompts: list[Any]) -> list[dict[int, float]]:
    from inferd import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPE_CHOICES), default="llama-32m")
    p.add_argument("--dtype", default="float32", help="the model dtype")
    p.add_argument("--kv-dtypes", default="auto,bfloat16,fp8,int8", help="comma-separated")
    p.add_argument("--workloads", default="mixed,single,long", help="comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from inferd import LLM, SamplingParams
    from inferd.engine.llm_engine import TokensPrompt

    folder = weights_folder(SHAPE_CHOICES[args.shape], DEFAULT_CACHE_DIR)
    kv_dtypes = args.kv_dtypes.split(",")
    engines = {
        kv: LLM(
            model=str(folder),
            dtype=args.dtype,
            kv_cache_dtype=kv,
            num_threads=args.threads,
            seed=args.seed,
            enable_prefix_caching=False,
        )
        for kv in kv_dtypes
    }
    result: dict[str, Any] = {"kv_bytes_per_token": {}, "speed": {}, "accuracy": {}}
    for kv, llm in engines.items():
        runner = llm.llm_engine.runner
        result["kv_bytes_per_token"][kv] = runner.kv_cache_bytes // (
            (runner.num_blocks + 1) * runner.block_size
        )

    for kind in args.workloads.split(","):
        reqs = make_workload(_spec(args, kind))
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
        ]
        for llm in engines.values():
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        best: dict[str, tuple[float, float]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for kv, llm in engines.items():
                c0, t0 = time.process_time(), time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                old = best.get(kv, (0.0, float("inf")))
                best[kv] = (max(old[0], n / wall), min(old[1], cpu / n * 1e3))
                tokens[kv] = [list(o.outputs[0].token_ids) for o in outs]
        result["speed"][kind] = {
            kv: {"tok_s": t, "cpu_ms_per_token": c} for kv, (t, c) in best.items()
        }
        base = best[kv_dtypes[0]][0]
        print(
            f"{args.shape} {args.dtype} {kind:6s} "
            + "   ".join(
                f"{kv} {t:7.1f} tok/s ({t / base:.2f}x, {c:.2f} CPU ms/tok)"
                for kv, (t, c) in best.items()
            )
        )
        if kind == "mixed":
            ref_tokens = tokens[kv_dtypes[0]]
            total = sum(len(t) for t in ref_tokens)
            for kv in kv_dtypes[1:]:
                same = sum(
                    a == b
                    for want, got in zip(ref_tokens, tokens[kv], strict=True)
                    for a, b in zip(want, got, strict=True)
                )
                result["accuracy"].setdefault(kv, {})["greedy_tokens_equal"] = same / total
            ref = _first_logprobs(engines[kv_dtypes[0]], prompts)
            top = [max(lps, key=lps.__getitem__) for lps in ref]
            for kv in kv_dtypes[1:]:
                got = _first_logprobs(engines[kv], prompts)
                agree = sum(max(g, key=g.__getitem__) == t for g, t in zip(got, top, strict=True))
                err = max(
                    abs(g.get(t, -99.0) - r[t]) for g, r, t in zip(got, ref, top, strict=True)
                )
                acc = result["accuracy"].setdefault(kv, {})
                acc.update({"top1": agree, "prompts": len(prompts), "max_top_logprob_error": err})

    print(f"KV bytes per token (all layers): {result['kv_bytes_per_token']}")
    for kv, acc in result["accuracy"].items():
        print(
            f"against {kv_dtypes[0]}: {kv:9s} first-token top-1 {acc['top1']}/{acc['prompts']}, "
            f"top log-prob error {acc['max_top_logprob_error']:.4f}, "
            f"greedy tokens equal {acc['greedy_tokens_equal']:.1%}"
        )
    path = default_result_path("kv_cache_dtype", args.shape)
    out = {"command": command_line(), "machine": machine_info(), "args": vars(args)} | result
    write_result(path, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
