"""The whole engine of two source revisions on the peers' mixed workload, offline, alternating.

    .venv/bin/python bench/engine_ab.py --base 3e749d7 --shape llama-32m --dtype float32
    .venv/bin/python bench/engine_ab.py --base 7ec76ca --shape qwen2-0.5b-shape --dtype bfloat16 \\
        --seeds 0 --rounds 2

Exports `inferd/` at `--base` (git archive) beside the working tree's, then runs bench/peers.py's
mixed workload (its requests, its random weights: 96 requests for llama-32m, 32 for the Qwen2-0.5B
shape; prompts 16-256, outputs 16-128, greedy, ignore_eos) or, with `--workload single`, one
stream (a 32-token prompt, 256 output tokens), `--quantization int8` for the int8 path, through
`LLM.generate` in a fresh process per tree and round, the trees taking turns (base first in even
rounds, the working tree first in odd ones), so a slow spell of a shared machine hits both alike.
Each process warms up on two requests, then runs every `--seed`. Prints output tok/s and the
engine's decode and prefill steps' seconds (its own step timings) per run, and the working tree's
totals over the base's; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import DEFAULT_CACHE_DIR, REPO_ROOT, save_result
from peers import MIXED_REQUESTS, SHAPES, mixed_workload, single_workload, weights_folder

# A single stream's output tokens (bench/peers.py's `--single-tokens`).
SINGLE_TOKENS = 256


def child(
    shape_name: str, dtype: str, seeds: list[int], threads: int, workload: str, quantization: str
) -> None:
    """Runs in the tree on PYTHONPATH: one JSON line per seed."""
    from inferd import LLM, SamplingParams
    from inferd.engine.llm_engine import TokensPrompt

    shape = SHAPES[shape_name]
    folder = weights_folder(shape, DEFAULT_CACHE_DIR)
    q = quantization or None
    llm = LLM(model=str(folder), dtype=dtype, num_threads=threads, seed=0, quantization=q)
    stats = llm.llm_engine.step_stats

    def run(n: int, seed: int) -> dict[str, float]:
        if workload == "single" and n > 2:
            reqs = single_workload(shape, SINGLE_TOKENS, seed)
        else:
            reqs = mixed_workload(shape, n, seed)
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in reqs]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
        ]
        stats.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = list(stats.steps)
        decode = [s for s in steps if s.num_prefill_tokens == 0]
        return {
            "seed": seed,
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "decode_s": sum(s.total for s in decode),
            "prefill_s": sum(s.total for s in steps) - sum(s.total for s in decode),
        }

    run(2, 99)
    for seed in seeds:
        print(json.dumps(run(MIXED_REQUESTS[shape_name], seed)), flush=True)


def run_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--dtype", args.dtype]
    cmd += ["--seeds", args.seeds, "--threads", str(args.threads), "--workload", args.workload]
    cmd += ["--quantization", args.quantization]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def export(rev: str, into: Path) -> Path:
    """`inferd/` at `rev`, unpacked under `into`; returns the folder to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", rev, "inferd"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default=None, help="git revision to compare the working tree with")
    shapes = ["llama-32m", "qwen2-0.5b-shape", "qwen3-moe", "gpt-oss"]
    p.add_argument("--shape", choices=shapes, default="llama-32m")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seeds", default="1,2,3", help="workload seeds, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workload", choices=["mixed", "single"], default="mixed")
    p.add_argument("--quantization", choices=["", "int8"], default="")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.child:
        child(args.shape, args.dtype, seeds, args.threads, args.workload, args.quantization)
        return
    if args.base is None:
        p.error("--base is required")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": export(args.base, Path(tmp)), "tree": REPO_ROOT}
        runs: dict[str, list[dict[str, float]]] = {"base": [], "tree": []}
        for rnd in range(args.rounds):
            order = ["base", "tree"] if rnd % 2 == 0 else ["tree", "base"]
            for name in order:
                for r in run_tree(trees[name], args):
                    runs[name].append({"round": rnd, **r})
                    print(
                        f"round {rnd} {name:>4} seed {r['seed']:.0f}: {r['tok_s']:8.1f} tok/s  "
                        f"decode {r['decode_s']:6.3f} s  prefill {r['prefill_s']:6.3f} s",
                        flush=True,
                    )
    totals: dict[str, Any] = {}
    for key in ("tok_s", "decode_s", "prefill_s"):
        base = sum(r[key] for r in runs["base"])
        tree = sum(r[key] for r in runs["tree"])
        totals[key] = tree / base
    print(
        f"working tree / {args.base}: tok/s {totals['tok_s']:.3f}x  "
        f"decode s {totals['decode_s']:.3f}x  prefill s {totals['prefill_s']:.3f}x"
    )
    fields = {"base": args.base, "shape": args.shape, "dtype": args.dtype, "runs": runs}
    fields |= {"workload": args.workload, "quantization": args.quantization}
    tag = f"{args.shape}-{args.dtype}{'-' + args.quantization if args.quantization else ''}"
    save_result(args.out, "engine_ab", f"{tag}-{args.workload}", {**fields, "ratios": totals})


if __name__ == "__main__":
    main()
