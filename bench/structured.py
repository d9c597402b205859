"""Structured outputs' cost: throughput with every request JSON-constrained; first-token latency.

    .venv/bin/python bench/structured.py                  # full run (a few minutes on 2 cores)
    .venv/bin/python bench/structured.py --quick          # quick check: 24 requests, 1 round
    .venv/bin/python bench/structured.py --shape qwen2-0.5b-shape --dtype bfloat16 --rounds 1

One `LLM` (random weights, `load_format="dummy"`, prefix caching off so every run computes every
prompt), offline, no server. Two measurements (issue 36's "Done when"):

1. Throughput: bench/peers.py's mixed workload (96 requests on llama-32m, 32 on the Qwen2-0.5B
   shape; prompts 16-256, outputs 16-128, greedy, `ignore_eos`), all requests at once through
   `LLM.generate`, `plain` (unconstrained) and `json` (every request constrained by one JSON
   schema, compact: `disable_any_whitespace=True`) taking turns for `--rounds` (plain first in
   even rounds, json first in odd ones), so a slow spell of a shared machine hits both alike.
   The schema is an object holding an array of strings with no maxItems: a random-weights model
   never closes it, so both runs generate exactly each request's output length; the script
   checks the per-request token counts are equal and counts grammar refusals (the runner logs
   one if a sampled token breaks the grammar). Both variants are warmed up first (the schema is
   compiled then: the runs measure masking, not compiling). Reported: output tok/s of each, json
   / plain per round and the median (issue target >= 0.85 on CPU), the same ratio by the
   process's CPU ms per output token (less swayed than wall time by other work's load), and the
   engine's step split per run: forward (with the lm_head: a constrained batch runs the whole
   lm_head, an unconstrained greedy one the greedy screen), grammar (mask fill + apply + matcher
   advance), sample.
2. First-token latency: one request at a time on the idle engine (`add_request`, then `step()`
   until its token, `time.perf_counter`), greedy, max_tokens=1, a 32-token prompt: unconstrained,
   a schema the compiler has never seen (a unique property name each repeat), and the same
   schema again (cached); for the small schema above and a typical tool-argument schema (nested
   object, enum, bounded integer, pattern, bounded array). Medians over `--repeats`; the extra
   first-token ms of a cached schema (issue target < 5 ms) and of a new one over unconstrained
   (the median of each repeat's difference), and the compile wait the engine recorded.

Prints tables and writes JSON (command, machine, every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import (
    DEFAULT_CACHE_DIR,
    BenchRequest,
    WorkloadSpec,
    ensure_model_folder,
    make_workload,
    save_result,
    workload_stats,
)
from peers import MIXED_REQUESTS, SHAPES, mixed_workload

if TYPE_CHECKING:
    from inferd import LLM
    from inferd.engine.llm_engine import LLMEngine
    from inferd.sampling.params import SamplingParams
    from inferd.sampling.structured import StructuredOutputsParams

SHAPE_NAMES = ("llama-32m", "qwen2-0.5b-shape")
VARIANTS = ("plain", "json")
# The step stages shown; the rest of the step (schedule, prepare_inputs, detokenize) is "other".
SPLIT = ("forward", "grammar", "sample")
QUICK_REQUESTS = 24


# -- schemas ------------------------------------------------------------------------------------


def items_schema(key: str = "items") -> dict[str, Any]:
    """`{"<key>": ["...", ...]}`: no maxItems, so a random model writes until max_tokens."""
    array = {"type": "array", "items": {"type": "string"}}
    return {"type": "object", "properties": {key: array}, "required": [key]}


def typical_schema(key: str = "query") -> dict[str, Any]:
    """A tool's arguments as agent frameworks send them; `key` names the first property."""
    props: dict[str, Any] = {
        key: {"type": "string", "maxLength": 64},
        "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "detailed": {"type": "boolean"},
    }
    return {"type": "object", "properties": props, "required": [key, "unit", "location"]}


SCHEMAS = {"small": items_schema, "typical": typical_schema}


def constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    from inferd.sampling.structured import StructuredOutputsParams

    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# -- throughput ---------------------------------------------------------------------------------


class RefusalCounter(logging.Handler):
    """Counts the runner's "grammar refused sampled token" errors (a masking bug if any)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "grammar refused" in record.getMessage():
            self.count += 1


def workload_params(
    reqs: list[BenchRequest], structured: StructuredOutputsParams | None
) -> list[SamplingParams]:
    from inferd import SamplingParams

    return [
        SamplingParams(
            max_tokens=r.output_len,
            ignore_eos=True,
            temperature=0.0,
            structured_outputs=structured,
        )
        for r in reqs
    ]


def run_once(llm: LLM, reqs: list[BenchRequest], variant: str) -> tuple[dict[str, Any], list[int]]:
    """One pass of the workload: its numbers, and each request's output token count."""
    from inferd.engine.llm_engine import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in reqs]
    params = workload_params(reqs, constraint(items_schema()) if variant == "json" else None)
    stats = llm.llm_engine.step_stats
    stats.clear()
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    n = sum(lengths)
    result: dict[str, Any] = {"tokens": n, "wall_s": wall, "tok_s": n / wall}
    result["cpu_ms_per_token"] = cpu / n * 1e3
    result |= step_split(stats.summary())
    result["sample_text"] = outs[0].outputs[0].text[:80]
    return result, lengths


def step_split(summary: dict[str, float]) -> dict[str, Any]:
    """Seconds per stage over the run's steps, "other" for the rest, grammar's share of all."""
    total = summary["total"]
    split = {k: summary[k] for k in SPLIT}
    split["other"] = total - sum(split.values())
    steps = int(summary["steps"])
    return {
        "steps": steps,
        "step_total_s": total,
        "split_s": split,
        "grammar_share": summary["grammar"] / total if total else 0.0,
        "grammar_ms_per_step": summary["grammar"] / steps * 1e3 if steps else 0.0,
    }


def throughput(llm: LLM, reqs: list[BenchRequest], rounds: int) -> dict[str, Any]:
    """plain and json alternating; per-round ratios json / plain, and the token-count check
    (every run's per-request counts against the first plain run's and the workload's)."""
    counter = RefusalCounter()
    logging.getLogger("inferd").addHandler(counter)
    for variant in VARIANTS:  # warm-up: kernels, xgrammar, the schema's compile
        run_once(llm, reqs[:8], variant)
    runs: list[dict[str, Any]] = []
    lengths: dict[str, list[list[int]]] = {v: [] for v in VARIANTS}
    for rnd in range(rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            result, counts = run_once(llm, reqs, variant)
            lengths[variant].append(counts)
            runs.append({"round": rnd, "variant": variant, **result})
            print_run(runs[-1])
    logging.getLogger("inferd").removeHandler(counter)
    ratios = [ratio(runs, r, "tok_s") for r in range(rounds)]
    cpu_ratios = [1 / ratio(runs, r, "cpu_ms_per_token") for r in range(rounds)]
    expected = [r.output_len for r in reqs]
    check = {
        "equal_per_request": all(c == lengths["plain"][0] for c in lengths["json"]),
        "expected_per_request": all(c == expected for c in lengths["plain"]),
        "plain_tokens": [sum(c) for c in lengths["plain"]],
        "json_tokens": [sum(c) for c in lengths["json"]],
        "grammar_refusals": counter.count,
    }
    medians = {"median_ratio": statistics.median(ratios)}
    medians["median_cpu_ratio"] = statistics.median(cpu_ratios)
    return {"runs": runs, "ratios": ratios, "cpu_ratios": cpu_ratios, **medians, **check}


def ratio(runs: list[dict[str, Any]], rnd: int, key: str) -> float:
    """json's `key` over plain's in round `rnd`."""
    json_run, plain = (
        next(r for r in runs if r["round"] == rnd and r["variant"] == v) for v in ("json", "plain")
    )
    return float(json_run[key] / plain[key])


def print_run(r: dict[str, Any]) -> None:
    s = r["split_s"]
    print(
        f"round {r['round']} {r['variant']:>5}: {r['tok_s']:8.1f} tok/s "
        f"({r['cpu_ms_per_token']:.2f} CPU ms/tok)  {r['tokens']} tokens  {r['steps']} steps  "
        f"forward {s['forward']:6.2f} s  grammar {s['grammar']:5.2f} s  "
        f"sample {s['sample']:5.2f} s  other {s['other']:5.2f} s  "
        f"grammar {r['grammar_share']:5.1%} ({r['grammar_ms_per_step']:.2f} ms/step)",
        flush=True,
    )


# -- first-token latency ------------------------------------------------------------------------


def first_token(
    engine: LLMEngine, rid: str, prompt: list[int], structured: StructuredOutputsParams | None
) -> tuple[float, float]:
    """(seconds from add_request to the first token, the grammar compile wait) of one request
    on an idle engine; steps on until the engine is idle again."""
    from inferd import SamplingParams
    from inferd.engine.llm_engine import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=structured)
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    while True:
        outs = [o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids]
        refused = engine.take_refused()
        if refused:
            raise refused[0][1]
        if outs:
            elapsed = time.perf_counter() - t0
            break
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed, outs[0].metrics.grammar_compile_s


def latency(llm: LLM, prompt: list[int], repeats: int) -> dict[str, Any]:
    """Per repeat: unconstrained, then per schema size a new schema and the same one cached."""
    engine = llm.llm_engine
    ids = (str(i) for i in itertools.count())
    first_token(engine, "warm-up", prompt, constraint(items_schema()))
    samples: dict[str, list[float]] = {}
    compile_s: dict[str, list[float]] = {}
    hits0, misses0 = engine.grammar_cache_counts
    stamp = time.time_ns()
    for i in range(repeats):
        cases: list[tuple[str, StructuredOutputsParams | None]] = [("plain", None)]
        for name, make in SCHEMAS.items():
            schema = constraint(make(f"k{stamp}_{i}"))
            cases += [(f"{name}_new", schema), (f"{name}_cached", schema)]
        for case, structured in cases:
            seconds, wait = first_token(engine, f"ft-{next(ids)}", prompt, structured)
            samples.setdefault(case, []).append(seconds)
            compile_s.setdefault(case, []).append(wait)
    hits, misses = engine.grammar_cache_counts
    return summarize_latency(samples, compile_s) | {
        "cache_hits": hits - hits0,
        "cache_misses": misses - misses0,
    }


def summarize_latency(
    samples: dict[str, list[float]], compile_s: dict[str, list[float]]
) -> dict[str, Any]:
    """Medians in ms, and each constrained case's extra ms over unconstrained: the median of the
    repeats' differences (each repeat's cases ran back to back, so a slow spell hits both)."""
    all_ms = {k: [s * 1e3 for s in v] for k, v in samples.items()}
    plain = all_ms.pop("plain")
    extra_ms = {
        k: statistics.median(c - p for c, p in zip(v, plain, strict=True))
        for k, v in all_ms.items()
    }
    median_ms = {k: statistics.median(v) for k, v in {"plain": plain, **all_ms}.items()}
    wait_ms = {k: statistics.median(v) * 1e3 for k, v in compile_s.items() if k != "plain"}
    return {
        "median_ms": median_ms,
        "extra_ms": extra_ms,
        "compile_wait_ms": wait_ms,
        "ms": {"plain": plain, **all_ms},
    }


# -- report -------------------------------------------------------------------------------------


def print_throughput(t: dict[str, Any]) -> None:
    ratios = "  ".join(f"{r:.3f}" for r in t["ratios"])
    cpu = "  ".join(f"{r:.3f}" for r in t["cpu_ratios"])
    print(
        f"json / plain tok/s per round: {ratios}   median {t['median_ratio']:.3f} "
        f"(target >= 0.85)\nby CPU time per token (plain / json): {cpu}   "
        f"median {t['median_cpu_ratio']:.3f}\n"
        f"tokens: plain {t['plain_tokens']}, json {t['json_tokens']}, "
        f"equal per request: {t['equal_per_request']}, as the workload asks: "
        f"{t['expected_per_request']}; grammar refusals: {t['grammar_refusals']}"
    )
    if not t["equal_per_request"]:
        print("WARNING: the runs generated different token counts; the ratio is not comparable")


def print_latency(lat: dict[str, Any]) -> None:
    med, extra, wait = lat["median_ms"], lat["extra_ms"], lat["compile_wait_ms"]
    print(f"first token, median of {len(lat['ms']['plain'])}: plain {med['plain']:.2f} ms")
    for case in extra:
        target = "  (target < 5 ms)" if case.endswith("_cached") else ""
        print(
            f"  {case:>15}: {med[case]:7.2f} ms  extra {extra[case]:+7.2f} ms  "
            f"compile wait {wait[case]:6.2f} ms{target}"
        )
    print(f"grammar cache: {lat['cache_hits']} hits, {lat['cache_misses']} misses")


def build_llm(args: argparse.Namespace) -> LLM:
    from inferd import LLM

    folder = ensure_model_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    return LLM(
        model=str(folder),
        dtype=args.dtype,
        load_format="dummy",
        num_threads=args.threads,
        seed=args.seed,
        enable_prefix_caching=False,
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPE_NAMES, default="llama-32m")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=None, help="plain/json pairs (default 3)")
    p.add_argument("--num-requests", type=int, default=None, help="default: the mixed workload's")
    p.add_argument("--repeats", type=int, default=None, help="first-token repeats (default 20)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="24 requests, 1 round, 3 repeats")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    quick = args.quick
    args.rounds = args.rounds or (1 if quick else 3)
    args.repeats = args.repeats or (3 if quick else 20)
    args.num_requests = args.num_requests or (
        QUICK_REQUESTS if quick else MIXED_REQUESTS[args.shape]
    )
    return args


def main() -> None:
    args = parse_args()
    shape = SHAPES[args.shape]
    llm = build_llm(args)
    reqs = mixed_workload(shape, args.num_requests, args.seed)
    print(f"{args.shape} {args.dtype}: {len(reqs)} requests, {workload_stats(reqs)}")
    tput = throughput(llm, reqs, args.rounds)
    print_throughput(tput)
    prompt = make_workload(WorkloadSpec(1, shape.vocab_size, args.seed, 32, 32, 1, 1))[0]
    lat = latency(llm, prompt.prompt_token_ids, args.repeats)
    print_latency(lat)
    fields = {
        "shape": args.shape,
        "dtype": args.dtype,
        "workload": {"num_requests": len(reqs), **workload_stats(reqs)},
        "schema": items_schema(),
        "typical_schema": typical_schema(),
        "throughput": tput,
        "first_token": lat,
    }
    save_result(args.out, "structured", f"{args.shape}-{args.dtype}", fields)


if __name__ == "__main__":
    main()
