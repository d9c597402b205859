"""Speculative decoding (n-gram drafts), one stream: acceptance, k, speed-up and the ideal.

    .venv/bin/python bench/spec.py             # llama-32m, 4 prompts x 128 tokens, 3 rounds
    .venv/bin/python bench/spec.py --quick     # 2 prompts x 96 tokens, 1 round
    .venv/bin/python bench/spec.py --mixed     # the 96-request mixed workload, adaptive vs off

One engine (llama-32m shape, float32, random weights, `load_format="dummy"`), offline, one
request at a time, greedy. Random weights answer nothing, let alone quote, so the model is made
to repeat itself: its token embeddings are scaled x`--embed-scale` after load (30 by default).
The residual stream is then mostly the current token's embedding, the model is close to a fixed
map from one token to the next, and its output falls into a cycle (of ~100 tokens over an
8,192-token vocabulary). Each prompt is a random start followed by the model's own first
`--lead` tokens from it, so the answer continues text the prompt holds and quotes it, as an edit
of a file or an extraction does. The acceptance rate is measured, not assumed, and the ideal
below is computed from it.

Variants, taking turns in each round (the order rotates, so a slow spell of a shared machine hits
all alike): `off` (no drafter), fixed k = 1, 2, 4 (`adaptive: false`), and `adaptive` (k_max 4).
Per variant: output tokens/s, the speed-up over `off` of the same round, the acceptance a
(accepted / verified draft tokens), the mean drafts verified per step, c (the proposer's seconds
per step over the mean step of `off`: the draft cost relative to the target step), and the ideal
speed-up (1 - a^(k+1)) / ((1 - a)(k c + 1)) for the variant's k, and achieved / ideal. Those
count the prompts' prefill, which speculation does not shorten; the decode phase alone: `step`
(the median decode step over off's), tokens per decode step, and their ratio, the decode
speed-up, with its share of the ideal (medians: a shared machine's slow spells count little).

`--mixed`: instead, bench/peers.py's mixed workload (96 requests on llama-32m, prompts 16-256,
outputs 16-128, greedy, all at once) with speculation `off` and `adaptive` taking turns for
`--rounds`: output tokens/s of each and adaptive / off per round (issue target >= 0.97: a batch
must not pay for speculation), also by the process's CPU seconds per token.

`--general`: each variant with drafts also runs with its verify steps on the layer-by-layer
path (`<variant>/gen`: `DecodePlan.multi_row` off, as before the one-call step took several rows
per sequence), in the same rounds.

Prints a table and writes JSON (command, machine, every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common import DEFAULT_CACHE_DIR, ensure_model_folder, save_result
from peers import MIXED_REQUESTS, SHAPES, mixed_workload

if TYPE_CHECKING:
    from inferd.engine.llm_engine import LLMEngine

VARIANTS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "k=1": {"num_speculative_tokens": 1, "adaptive": False},
    "k=2": {"num_speculative_tokens": 2, "adaptive": False},
    "k=4": {"num_speculative_tokens": 4, "adaptive": False},
    "adaptive": {"num_speculative_tokens": 4, "adaptive": True},
}
# A variant's suffix for its verify steps on the layer-by-layer path (`--general`).
GENERAL = "/gen"
NGRAM: dict[str, Any] = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@dataclass
class Run:
    variant: str
    seconds: float
    tokens: int
    steps: int
    draft_steps: int  # steps that verified drafts
    draft_tokens: int
    accepted_tokens: int
    propose_s: float
    step_s: float  # the median decode step (no prompt tokens in it)
    decode_steps: int
    requests: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def build_engine(args: argparse.Namespace) -> LLMEngine:
    from inferd import LLM

    folder = ensure_model_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        load_format="dummy",
        num_threads=args.threads,
        seed=args.seed,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    engine.model.model.embed_tokens.weight.data.mul_(args.embed_scale)
    return engine


def set_variant(engine: LLMEngine, spec: dict[str, Any] | None) -> None:
    from inferd.config import SpeculativeConfig
    from inferd.spec_decode.drafter import Drafter

    if spec is None:
        engine.drafter = None
        return
    engine.drafter = Drafter(SpeculativeConfig.model_validate({**NGRAM, **spec}))


def run_variant(engine: LLMEngine, name: str, prompts: list[list[int]], max_tokens: int) -> Run:
    from inferd import SamplingParams

    set_variant(engine, VARIANTS[name.removesuffix(GENERAL)])
    plan = engine.model.model.decode
    if plan is not None:
        plan.multi_row = not name.endswith(GENERAL)
    drafter = engine.drafter
    propose_s = [0.0]
    if drafter is not None:
        real = drafter.propose

        def timed_propose(running: Any) -> None:
            t0 = time.perf_counter()
            real(running)
            propose_s[0] += time.perf_counter() - t0

        drafter.propose = timed_propose  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.step_stats.clear()
    t0 = time.perf_counter()
    tokens = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    stats = engine.step_stats.steps
    # Decode steps: a token (and its drafts) per request, no prompt tokens.
    steps = [s for s in stats if s.num_batched_tokens == s.num_running + s.num_draft_tokens]
    counters = drafter.counters if drafter is not None else None
    return Run(
        variant=name,
        seconds=seconds,
        tokens=tokens,
        steps=len(stats),
        draft_steps=sum(1 for s in stats if s.num_draft_tokens),
        draft_tokens=counters.num_draft_tokens if counters else 0,
        accepted_tokens=counters.num_accepted_tokens if counters else 0,
        propose_s=propose_s[0],
        step_s=statistics.median(s.total for s in steps),
        decode_steps=len(steps),
        requests=len(prompts),
    )


def leads(engine: LLMEngine, starts: list[list[int]], n: int) -> list[list[int]]:
    """The model's own greedy continuation (`n` tokens) of each start, without drafts."""
    from inferd import SamplingParams

    set_variant(engine, None)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, start in enumerate(starts):
        engine.add_request(f"lead-{i}", {"prompt_token_ids": start}, params)
    outs = {o.request_id: o for o in engine.run_to_completion() if o.finished}
    return [outs[f"lead-{i}"].outputs[0].token_ids for i in range(len(starts))]


def ideal_speedup(a: float, k: float, c: float) -> float:
    """(1 - a^(k+1)) / ((1 - a)(k c + 1)): tokens per target step over its cost, in steps."""
    gain = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return gain / (k * c + 1)


def summarize(rounds: list[dict[str, Run]]) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        speedups = [r[name].tok_s / r["off"].tok_s for r in rounds]
        # Decode phase: tokens per decode step (the first token is the prefill's) over the median
        # decode step, against off's; medians, so a slow spell of a shared machine counts little.
        per_step = sum(x.tokens - x.requests for x in runs) / sum(x.decode_steps for x in runs)
        step = statistics.median(r[name].step_s / r["off"].step_s for r in rounds)
        off_step = statistics.median(r["off"].seconds / max(r["off"].steps, 1) for r in rounds)
        drafted = sum(x.draft_tokens for x in runs)
        a = sum(x.accepted_tokens for x in runs) / drafted if drafted else 0.0
        # Drafts verified per step that verified any (the proposer may find fewer than k).
        k = drafted / max(sum(x.draft_steps for x in runs), 1)
        c = sum(x.propose_s for x in runs) / max(sum(x.steps for x in runs), 1) / off_step
        ideal = ideal_speedup(a, k, c)
        speedup = statistics.median(speedups)
        rows.append(
            {
                "variant": name,
                "tok_s": statistics.median(x.tok_s for x in runs),
                "speedup": speedup,
                "acceptance": a,
                "mean_k": k,
                "c": c,
                "ideal": ideal,
                "of_ideal": speedup / ideal,
                "step": step,
                "tokens_per_step": per_step,
                "decode_speedup": per_step / step,
                "of_ideal_decode": per_step / step / ideal,
            }
        )
    return rows


def run_mixed(engine: LLMEngine, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The mixed workload, all requests at once, under variant `name`."""
    from inferd import SamplingParams

    set_variant(engine, VARIANTS[name])
    reqs = mixed_workload(SHAPES[args.shape], MIXED_REQUESTS.get(args.shape, 32), args.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, r in enumerate(reqs):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"{name}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in engine.run_to_completion() if o.finished)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    drafter = engine.drafter
    drafted = drafter.counters.num_draft_tokens if drafter else 0
    return {"tok_s": tokens / wall, "cpu_s_per_token": cpu / tokens, "draft_tokens": drafted}


def main_mixed(engine: LLMEngine, args: argparse.Namespace) -> None:
    rounds = []
    for i in range(args.rounds):
        order = ["off", "adaptive"] if i % 2 == 0 else ["adaptive", "off"]
        rounds.append({n: run_mixed(engine, n, args) for n in order})
    ratios = [r["adaptive"]["tok_s"] / r["off"]["tok_s"] for r in rounds]
    cpu = [r["off"]["cpu_s_per_token"] / r["adaptive"]["cpu_s_per_token"] for r in rounds]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.shape}, mixed workload")
    for r, ratio, c in zip(rounds, ratios, cpu, strict=True):
        off, ada = r["off"], r["adaptive"]
        print(
            f"off {off['tok_s']:7.1f} tok/s  adaptive {ada['tok_s']:7.1f} tok/s "
            f"({ada['draft_tokens']} drafts)  ratio {ratio:.3f}  by CPU time {c:.3f}"
        )
    print(f"median adaptive / off: {statistics.median(ratios):.3f}")
    fields = {"args": vars(args), "ratios": ratios, "cpu_ratios": cpu, "rounds": rounds}
    save_result(args.out, "spec-mixed", args.shape, fields)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-32m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32, help="random start of each prompt")
    p.add_argument("--lead", type=int, default=320, help="the model's own tokens after it")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--embed-scale", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 prompts x 96 tokens, 1 round")
    p.add_argument("--mixed", action="store_true", help="the 96-request mixed workload instead")
    p.add_argument(
        "--general", action="store_true", help="also each variant's verify steps layer by layer"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 2, 96, 1
    return args


def main() -> None:
    import random

    args = parse_args()
    engine = build_engine(args)
    if args.mixed:
        main_mixed(engine, args)
        return
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    starts = [
        [rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    lead = leads(engine, starts, args.lead)
    prompts = [start + tail for start, tail in zip(starts, lead, strict=True)]
    run_variant(engine, "k=4", prompts[:1], 32)  # warm-up: kernels, first verify shapes
    names = list(VARIANTS)
    if args.general:
        names += [f"{n}{GENERAL}" for n, spec in VARIANTS.items() if spec is not None]
    rounds = []
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        runs = {n: run_variant(engine, n, prompts, args.max_tokens) for n in order}
        rounds.append({n: runs[n] for n in names})
    rows = summarize(rounds)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.shape}, {args.prompts} prompts")
    print(
        f"{'variant':>12} {'tok/s':>7} {'x off':>6} {'accept':>7} {'k':>5} {'c':>6} {'step':>5} "
        f"{'ideal':>6} {'tok/step':>8} {'decode x off':>18}"
    )
    for r in rows:
        print(
            f"{r['variant']:>12} {r['tok_s']:7.1f} {r['speedup']:6.2f} {r['acceptance']:7.2f} "
            f"{r['mean_k']:5.2f} {r['c']:6.3f} {r['step']:5.2f} {r['ideal']:6.2f} "
            f"({r['of_ideal']:4.0%}) {r['tokens_per_step']:8.2f} {r['decode_speedup']:6.2f} "
            f"({r['of_ideal_decode']:4.0%})"
        )
    fields = {"args": vars(args), "summary": rows, "rounds": rounds}
    save_result(args.out, "spec", args.shape, fields)


if __name__ == "__main__":
    main()
