"""Many LoRA adapters in one batch: throughput against the base model alone, and a cold
adapter's first token.

    .venv/bin/python bench/lora.py                 # llama-32m float32, ranks 8 and 16, 2 rounds
    .venv/bin/python bench/lora.py --quick         # 24 requests, rank 16, 1 round

bench/peers.py's mixed workload (96 requests on llama-32m: prompts 16-256, outputs 16-128,
greedy, `ignore_eos`), all requests at once on one engine (random weights, `load_format="dummy"`,
prefix caching off so every run computes every prompt), offline. Cases, taking turns each round:

- `base`: an engine without LoRA (the baseline every ratio divides by);
- `lora-0`: the LoRA engine, every request on the base model (what turning LoRA on costs);
- `lora-1`, `lora-8`, `lora-64`: requests spread over 1, 8 or 64 adapters, uniform or Zipf
  (s = 1.1) popularity, at most `--max-loras` (8) adapters a step, so 64 adapters take turns.
  Adapters target all seven layers (q/k/v/o, gate/up/down; `--targets qv`: q and v, PEFT's
  default), random weights (inferd/lora/random_adapter.py), all loaded in host memory before the
  runs (the load is measured separately, below).

Each case runs right beside a `base` run (alternating which goes first). Reported: output tok/s
of each case, its ratio to that base run's, and the same ratio by the process's CPU seconds per
output token (steadier on a shared machine), medians over rounds (issue targets: 8 adapters
>= 0.8, 64 adapters >= 0.7).

Cold adapter: on an idle engine, one request (32-token prompt, max_tokens=1) naming an adapter
never loaded: its time to first token beside the adapter's load time the engine recorded
(`lora_load_s`) and the same request's on a warm adapter just before (target: first token <=
load + one step); five cold adapters, medians and how many met it.

Prints tables and writes JSON (command, machine, every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import DEFAULT_CACHE_DIR, BenchRequest, ensure_model_folder, save_result
from peers import MIXED_REQUESTS, SHAPES, mixed_workload

from inferd import LLM, SamplingParams
from inferd.engine.llm_engine import LLMEngine, TokensPrompt
from inferd.lora.random_adapter import write_random_adapter
from inferd.lora.request import LoRARequest

# "all": every layer a LoRA fine-tune may target; "qv": PEFT's default for Llama models.
TARGETS = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qv": ("q_proj", "v_proj"),
}
MAX_LORAS = 8
COLD_REPEATS = 5
ZIPF_S = 1.1


def adapters(
    folder: Path, root: Path, rank: int, n: int, targets: tuple[str, ...] = TARGETS["all"]
) -> list[LoRARequest]:
    out = []
    for i in range(n):
        path = write_random_adapter(folder, root / f"r{rank}-{i}", rank, targets, seed=i)
        out.append(LoRARequest(f"r{rank}-{i}", i + 1, str(path)))
    return out


def assign(n_req: int, loras: list[LoRARequest], zipf: bool, seed: int) -> list[LoRARequest]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** ZIPF_S for i in range(len(loras))] if zipf else None
    return rng.choices(loras, weights=weights, k=n_req)


def run(
    engine: LLMEngine, reqs: list[BenchRequest], loras: list[LoRARequest | None]
) -> tuple[float, float]:
    """Output tok/s of the workload, every request added at once, and the process's CPU seconds
    per output token (less swayed than wall time by other work on the machine)."""
    for i, (r, lora) in enumerate(zip(reqs, loras, strict=True)):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        prompt = TokensPrompt(prompt_token_ids=r.prompt_token_ids)
        engine.add_request(f"q{i}", prompt, params, lora_request=lora)
    c0, t0 = time.process_time(), time.perf_counter()
    outs = [o for o in engine.run_to_completion() if o.finished]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / wall, cpu / n


def cold_first_token(
    engine: LLMEngine, colds: list[LoRARequest], warm: LoRARequest
) -> dict[str, Any]:
    """Per cold adapter: a warm request's first token, then the cold one's (each alone on the
    idle engine); medians, and how many met first token <= load + the warm first token."""
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 42)))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    runs: list[dict[str, float]] = []
    for i, cold in enumerate(colds):
        run_ms: dict[str, float] = {}
        for label, req in (("warm", warm), ("cold", cold)):
            t0 = time.perf_counter()
            engine.add_request(f"{label}{i}", prompt, params, lora_request=req)
            out = next(o for o in engine.run_to_completion() if o.finished)
            run_ms[f"{label}_ttft_ms"] = (time.perf_counter() - t0) * 1e3
            run_ms[f"{label}_load_ms"] = out.metrics.lora_load_s * 1e3
        runs.append(run_ms)
    met = [r["cold_ttft_ms"] <= r["cold_load_ms"] + r["warm_ttft_ms"] for r in runs]
    keys = ("warm_ttft_ms", "cold_ttft_ms", "cold_load_ms")
    result: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    return result | {"met": sum(met), "of": len(met), "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-32m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--targets", default="all", choices=sorted(TARGETS))
    p.add_argument("--max-loras", type=int, default=MAX_LORAS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ranks = [16] if args.quick else [int(r) for r in args.ranks.split(",")]
    rounds = 1 if args.quick else args.rounds
    shape = SHAPES[args.shape]
    n_req = 24 if args.quick else MIXED_REQUESTS.get(args.shape, 32)
    folder = ensure_model_folder(shape, DEFAULT_CACHE_DIR)
    reqs = mixed_workload(shape, n_req, seed=0)
    common: dict[str, Any] = dict(
        model=str(folder), dtype=args.dtype, load_format="dummy", enable_prefix_caching=False
    )
    base = LLM(**common).llm_engine
    lora_engine = LLM(
        **common,
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=max(ranks),
        max_cpu_loras=130,
    ).llm_engine
    targets = TARGETS[args.targets]
    root = Path(tempfile.mkdtemp(prefix="inferd-lora-bench-"))
    cases: dict[str, tuple[LLMEngine, list[LoRARequest | None]]] = {
        "base": (base, [None] * n_req),
        "lora-0": (lora_engine, [None] * n_req),
    }
    for rank in ranks:
        pool = adapters(folder, root, rank, 64, targets)
        for lora in pool:
            lora_engine.add_lora(lora).result()
        cases[f"r{rank}-lora-1"] = (lora_engine, [pool[0]] * n_req)
        for n in (8, 64):
            for zipf in (False, True):
                name = f"r{rank}-lora-{n}-{'zipf' if zipf else 'uniform'}"
                cases[name] = (lora_engine, list(assign(n_req, pool[:n], zipf, seed=n)))
    run(base, reqs[:8], [None] * 8)  # warm-up
    run(lora_engine, reqs[:8], cases[f"r{ranks[0]}-lora-8-uniform"][1][:8])
    rows: list[dict[str, Any]] = []
    names = [n for n in cases if n != "base"]
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            # Each case beside its own base run, in alternating order: a slow spell of a shared
            # machine then hits both.
            pair = ("base", name) if rnd % 2 == 0 else (name, "base")
            got = {case: run(cases[case][0], reqs, cases[case][1]) for case in pair}
            (b, b_cpu), (t, t_cpu) = got["base"], got[name]
            row = {"round": rnd, "case": name, "tok_s": t, "base_tok_s": b}
            row |= {"ratio": t / b, "cpu_ratio": b_cpu / t_cpu}
            rows.append(row)
            print(f"round {rnd} {name:24s} {t:8.1f} tok/s (base {b:7.1f}): {t / b:.2f}", flush=True)
    medians = {
        n: {
            k: statistics.median(r[k] for r in rows if r["case"] == n)
            for k in ("ratio", "cpu_ratio")
        }
        for n in names
    }
    print("\ncase                      ratio to base, median: wall  CPU time")
    for case, m in medians.items():
        print(f"{case:24s}  {m['ratio']:.2f}  {m['cpu_ratio']:.2f}")
    top = max(ranks)
    colds = [
        LoRARequest(f"cold-{i}", 1000 + i, r.lora_path)
        for i, r in enumerate(adapters(folder, root / "cold", top, COLD_REPEATS, targets))
    ]
    warm = cases[f"r{top}-lora-1"][1][0]
    assert warm is not None
    cold = cold_first_token(lora_engine, colds, warm)
    print(f"\ncold adapter: {cold}")
    fields = {"shape": args.shape, "dtype": args.dtype, "targets": targets, "requests": n_req}
    fields |= {"max_loras": args.max_loras, "runs": rows, "median_ratio": medians, "cold": cold}
    tag = f"{args.shape}-{args.dtype}-{args.targets}-maxloras{args.max_loras}"
    save_result(args.out, "lora", tag, fields)


if __name__ == "__main__":
    main()
