"""Precisions side by side: speed and accuracy against float32, in one process, alternating.

    .venv/bin/python bench/precision.py --shape llama-32m --rounds 2
    .venv/bin/python bench/precision.py --variants "float32=" "kv-int8=kv_cache_dtype=int8"

Each variant is one `LLM` (NAME=KEY=VALUE,... of `LLM` keyword arguments, `model=PATH` for
another folder of the same model, e.g. an int8 checkpoint; the first is the reference). The
default set: float32; bfloat16 weights (`dtype=bfloat16`, its cache bfloat16 too); int8 weights
(`quantization=int8`, on a CPU with VNNI); and float32 weights with a bfloat16, fp8 or int8 KV
cache. The variants run the same workloads in turn, round after round, so a slow spell
on a shared machine hits every variant alike; the best round of each is reported, with the
process's CPU seconds per output token. The model is bench/peers.py's checkpoint (weights drawn
as transformers initializes them, normal at 0.02: attention is not flat, as it is with
`load_format="dummy"`'s tiny uniform weights), prefix caching off so every round computes every
prompt. Workloads are bench/fused_ops.py's: `mixed` (all requests at once, prompts 16-256,
outputs 16-128) and `single` (one stream, 32-token prompt, 256 tokens), plus `long` (one stream
after a 1,700-token prompt, where the KV cache's bytes weigh most on a single stream).

Accuracy against the reference, on the mixed workload's prompts (a fixed, seeded set): the first
token's top-1 agreement; the largest error of the reference top token's log-probability; the
largest log-probability error over the reference's top 20 tokens (a token missing from the
variant's top 20 counts at its 20th); and the share of greedy tokens equal to the reference's
over the whole workload (two runs part at their first near-tie and stay apart). Also each KV
cache's bytes per token. Prints tables and writes JSON to bench/results/.
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
VARIANTS = [
    "float32=",
    "bfloat16=dtype=bfloat16",
    "int8=quantization=int8",
    "kv-bfloat16=kv_cache_dtype=bfloat16",
    "kv-fp8=kv_cache_dtype=fp8",
    "kv-int8=kv_cache_dtype=int8",
]


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME=KEY=VALUE,KEY=VALUE` -> (NAME, {KEY: VALUE}); `NAME=` has no arguments."""
    name, _, rest = text.partition("=")
    kwargs = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, kwargs


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


def accuracy(ref: list[dict[int, float]], got: list[dict[int, float]]) -> dict[str, float | int]:
    """First-token agreement of `got` with `ref` (each prompt's top-TOP log-probabilities)."""
    top1 = top_err = all_err = 0.0
    for r, g in zip(ref, got, strict=True):
        best = max(r, key=r.__getitem__)
        top1 += max(g, key=g.__getitem__) == best
        floor = min(g.values())
        top_err = max(top_err, abs(g.get(best, floor) - r[best]))
        all_err = max(all_err, max(abs(g.get(t, floor) - lp) for t, lp in r.items()))
    return {
        "top1": int(top1),
        "prompts": len(ref),
        "top_logprob_error": top_err,
        "max_logprob_error": all_err,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPE_CHOICES), default="llama-32m")
    p.add_argument("--variants", nargs="+", default=VARIANTS, help="NAME=KEY=VALUE,...")
    p.add_argument("--workloads", default="mixed,single,long", help="comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from inferd import LLM, SamplingParams
    from inferd.engine.llm_engine import TokensPrompt

    folder = weights_folder(SHAPE_CHOICES[args.shape], DEFAULT_CACHE_DIR)
    variants = dict(parse_variant(v) for v in args.variants)
    engines = {
        name: LLM(
            **({"model": str(folder), "dtype": "float32"} | kwargs),
            num_threads=args.threads,
            seed=args.seed,
            enable_prefix_caching=False,
        )
        for name, kwargs in variants.items()
    }
    names = list(engines)
    result: dict[str, Any] = {"variants": variants, "kv_bytes_per_token": {}, "speed": {}}
    for name, llm in engines.items():
        runner = llm.llm_engine.runner
        slots = (runner.num_blocks + 1) * runner.block_size
        result["kv_bytes_per_token"][name] = runner.kv_cache_bytes // slots

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
            for name, llm in engines.items():
                c0, t0 = time.process_time(), time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                old = best.get(name, (0.0, float("inf")))
                best[name] = (max(old[0], n / wall), min(old[1], cpu / n * 1e3))
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        result["speed"][kind] = {
            name: {"tok_s": t, "cpu_ms_per_token": c} for name, (t, c) in best.items()
        }
        if kind == "mixed":
            result["accuracy"] = _accuracy(engines, names, prompts, tokens)

    _print(args, names, result)
    path = default_result_path("precision", args.shape)
    out = {"command": command_line(), "machine": machine_info(), "args": vars(args)} | result
    write_result(path, out)
    print(f"wrote {path}")


def _accuracy(
    engines: dict[str, Any],
    names: list[str],
    prompts: list[Any],
    tokens: dict[str, list[list[int]]],
) -> dict[str, dict[str, float | int]]:
    ref_tokens = tokens[names[0]]
    total = sum(len(t) for t in ref_tokens)
    ref = _first_logprobs(engines[names[0]], prompts)
    out: dict[str, dict[str, float | int]] = {}
    for name in names[1:]:
        same = sum(
            a == b
            for want, got in zip(ref_tokens, tokens[name], strict=True)
            for a, b in zip(want, got, strict=True)
        )
        out[name] = accuracy(ref, _first_logprobs(engines[name], prompts))
        out[name]["greedy_tokens_equal"] = same / total
    return out


def _print(args: argparse.Namespace, names: list[str], result: dict[str, Any]) -> None:
    kinds = list(result["speed"])
    print(f"{args.shape}: tok/s (x {names[0]}) and CPU ms/token, best of {args.rounds} rounds")
    print(f"{'variant':14s} {'KV B/tok':>8s} " + " ".join(f"{k:>22s}" for k in kinds))
    for name in names:
        cells = []
        for kind in kinds:
            tok_s = result["speed"][kind][name]["tok_s"]
            base = result["speed"][kind][names[0]]["tok_s"]
            cpu = result["speed"][kind][name]["cpu_ms_per_token"]
            cells.append(f"{tok_s:8.1f} ({tok_s / base:4.2f}x) {cpu:5.2f}")
        kv = result["kv_bytes_per_token"][name]
        print(f"{name:14s} {kv:8d} " + " ".join(f"{c:>22s}" for c in cells))
    for name, acc in result.get("accuracy", {}).items():
        print(
            f"against {names[0]}: {name:14s} first-token top-1 {acc['top1']}/{acc['prompts']},"
            f" top log-prob error {acc['top_logprob_error']:.4f}, max over top {TOP}"
            f" {acc['max_logprob_error']:.4f}, greedy tokens equal {acc['greedy_tokens_equal']:.1%}"
        )


if __name__ == "__main__":
    main()
