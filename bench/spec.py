"""Speculative decoding, one stream: acceptance, k, speed-up and the ideal.

    .venv/bin/python bench/spec.py             # llama-32m, 4 prompts x 128 tokens, 3 rounds
    .venv/bin/python bench/spec.py --quick     # 2 prompts x 96 tokens, 1 round
    .venv/bin/python bench/spec.py --mixed     # the 96-request mixed workload, adaptive vs off
    P=/tmp/peers L=$P/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python bench/spec.py --method draft_model --draft-layers 1 \\
        --llama-server $L/build/bin/llama-server --gguf-python $P/gguf-venv/bin/python \\
        --llama-src $L

One engine (llama-32m shape, float32, random weights, `load_format="dummy"`), offline, one
request at a time, greedy. Random weights answer nothing, let alone quote, so the model is made
to repeat itself: its token embeddings are scaled x`--embed-scale` after load (30 by default,
120 for `--method draft_model`).
The residual stream is then mostly the current token's embedding, the model is close to a fixed
map from one token to the next, and its output falls into a cycle (of ~100 tokens over an
8,192-token vocabulary). Each prompt is a random start followed by the model's own first
`--lead` tokens from it, so the answer continues text the prompt holds and quotes it, as an edit
of a file or an extraction does. The acceptance rate is measured, not assumed, and the ideal
below is computed from it.

`--method draft_model`: the drafts come from a draft model instead of n-gram lookup. Both models
are real folders: the target is bench/peers.py's random float32 checkpoint of the shape with its
embeddings scaled the same way (saved, not applied after load), the draft its first
`--draft-layers` decoder layers with its embeddings, final norm and lm_head
(`inferd.models.tiny.write_truncated_draft`), loaded by the engine's own loader. Its agreement
with the target is the measured acceptance. With `--llama-server` (and `--gguf-python`,
`--llama-src`, as bench/peers.py takes them; the peer is never a dependency), both folders are
converted to GGUF f32 and llama-server runs the same prompts, greedy, one stream, without and with
`-md DRAFT --draft-max K --draft-min 0`: its tok/s, its acceptance (`timings.draft_n_accepted`
over `draft_n`) and inferd's draft-model variant over it.

Variants, taking turns in each round (the order rotates, so a slow spell of a shared machine hits
all alike): `off` (no drafter), fixed k = 1, 2, 4 (`adaptive: false`), and `adaptive` (k_max 4).
Per variant: output tokens/s, the speed-up over `off` of the same round, the acceptance a
(accepted / verified draft tokens), the mean drafts verified per step, c (the proposer's seconds
per draft token over the mean step of `off`: the draft cost relative to the target step), and the
ideal speed-up (1 - a^(k+1)) / ((1 - a)(k c + 1)) for the variant's k, and achieved / ideal.
Those count the prompts' prefill, which speculation does not shorten; the decode phase alone:
`step` (the median decode step over off's), tokens per decode step, and their ratio, the decode
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
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import DEFAULT_CACHE_DIR, REPO_ROOT, ensure_model_folder, save_result
from peers import (
    MIXED_REQUESTS,
    SHAPES,
    System,
    gguf_file,
    launched,
    mixed_workload,
    weights_folder,
)

if TYPE_CHECKING:
    from inferd.engine.llm_engine import LLMEngine
    from inferd.spec_decode.drafter import Proposer

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
class Method:
    """How the variants draft: the config keys they share, and for `draft_model` the engine's
    proposer (the draft model and its KV pool, loaded once and shared by the variants)."""

    keys: dict[str, Any]
    proposer: Proposer | None = None


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


def build_engine(args: argparse.Namespace) -> tuple[LLMEngine, Method]:
    from inferd import LLM

    common_kwargs: dict[str, Any] = {
        "dtype": "float32",
        "num_threads": args.threads,
        "seed": args.seed,
        "enable_prefix_caching": False,
    }
    if args.method == "draft_model":
        target, draft = spec_folders(args)
        keys = {"method": "draft_model", "model": str(draft)}
        spec = {**keys, **VARIANTS["adaptive"]}  # type: ignore[dict-item]
        engine = LLM(model=str(target), speculative_config=spec, **common_kwargs).llm_engine
        assert engine.drafter is not None
        return engine, Method(keys, engine.drafter.proposer)
    folder = ensure_model_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    engine = LLM(model=str(folder), load_format="dummy", **common_kwargs).llm_engine
    engine.model.model.embed_tokens.weight.data.mul_(args.embed_scale)
    return engine, Method(NGRAM)


def spec_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The target (bench/peers.py's random checkpoint, embeddings scaled) and its truncated
    draft, written once under the bench cache."""
    from safetensors.torch import load_file, save_file

    from inferd.models.tiny import write_truncated_draft

    base = weights_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    target = DEFAULT_CACHE_DIR / f"{args.shape}-spec-x{args.embed_scale:g}"
    if not (target / "model.safetensors").exists():
        target.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                (target / f.name).write_bytes(f.read_bytes())
        state = load_file(base / "model.safetensors")
        state["model.embed_tokens.weight"] *= args.embed_scale
        save_file(state, str(target / "model.safetensors"), {"format": "pt"})
    draft = target.parent / f"{target.name}-draft{args.draft_layers}"
    if not (draft / "model.safetensors").exists():
        write_truncated_draft(target, draft, args.draft_layers)
    return target, draft


def set_variant(engine: LLMEngine, spec: dict[str, Any] | None, method: Method) -> None:
    from inferd.config import SpeculativeConfig
    from inferd.spec_decode.drafter import Drafter

    if spec is None:
        engine.drafter = None
        return
    config = SpeculativeConfig.model_validate({**method.keys, **spec})
    engine.drafter = Drafter(config, method.proposer)


def run_variant(
    engine: LLMEngine, name: str, prompts: list[list[int]], max_tokens: int, method: Method
) -> Run:
    from inferd import SamplingParams

    set_variant(engine, VARIANTS[name.removesuffix(GENERAL)], method)
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


def leads(engine: LLMEngine, starts: list[list[int]], n: int, method: Method) -> list[list[int]]:
    """The model's own greedy continuation (`n` tokens) of each start, without drafts."""
    from inferd import SamplingParams

    set_variant(engine, None, method)
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
        # Per draft token verified: k c is then the drafting's cost per step, in target steps.
        c = sum(x.propose_s for x in runs) / max(drafted, 1) / off_step
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


def run_mixed(
    engine: LLMEngine, name: str, args: argparse.Namespace, method: Method
) -> dict[str, Any]:
    """The mixed workload, all requests at once, under variant `name`."""
    from inferd import SamplingParams

    set_variant(engine, VARIANTS[name], method)
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


def main_mixed(engine: LLMEngine, args: argparse.Namespace, method: Method) -> None:
    rounds = []
    for i in range(args.rounds):
        order = ["off", "adaptive"] if i % 2 == 0 else ["adaptive", "off"]
        rounds.append({n: run_mixed(engine, n, args, method) for n in order})
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
    save_result(args.out, f"spec-mixed-{args.method}", args.shape, fields)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-32m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32, help="random start of each prompt")
    p.add_argument("--lead", type=int, default=320, help="the model's own tokens after it")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--embed-scale", type=float, default=None, help="default 30 (ngram), 120 (draft_model)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 prompts x 96 tokens, 1 round")
    p.add_argument("--mixed", action="store_true", help="the 96-request mixed workload instead")
    p.add_argument(
        "--general", action="store_true", help="also each variant's verify steps layer by layer"
    )
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft-layers", type=int, default=1, help="draft_model: the target's first N")
    p.add_argument("--llama-server", type=Path, default=None, help="draft_model: beside llama.cpp")
    p.add_argument("--gguf-python", type=Path, default=None)
    p.add_argument("--llama-src", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.embed_scale is None:
        # x120: a one-layer draft agrees on ~2/3 of its drafts (measured: bench/NOTES.md).
        args.embed_scale = 120.0 if args.method == "draft_model" else 30.0
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 2, 96, 1
    return args


def main() -> None:
    import random

    args = parse_args()
    engine, method = build_engine(args)
    if args.mixed:
        main_mixed(engine, args, method)
        return
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    starts = [
        [rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    lead = leads(engine, starts, args.lead, method)
    prompts = [start + tail for start, tail in zip(starts, lead, strict=True)]
    run_variant(engine, "k=4", prompts[:1], 32, method)  # warm-up: kernels, first verify shapes
    names = list(VARIANTS)
    if args.general:
        names += [f"{n}{GENERAL}" for n, spec in VARIANTS.items() if spec is not None]
    rounds: list[dict[str, Run]] = []
    peer_rounds: list[dict[str, dict[str, float]]] = []
    peers = llama_servers(args)
    logs = REPO_ROOT / "bench" / "results" / "logs"  # git-ignored
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        runs = {n: run_variant(engine, n, prompts, args.max_tokens, method) for n in order}
        rounds.append({n: runs[n] for n in names})
        # Each server only while it is measured: an idle llama-server's threads still poll.
        peer_runs = {}
        for system in peers:
            with launched(system, logs / f"spec-{system.name}.log") as server:
                peer_runs[system.name] = run_llama(server.url, prompts, args.max_tokens)
        peer_rounds.append(peer_runs)
    rows = summarize(rounds)
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.shape}, {args.method}, "
        f"{args.prompts} prompts"
    )
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
    peer_rows = summarize_llama(rounds, peer_rounds)
    fields = {"args": vars(args), "summary": rows, "rounds": rounds, "llama_server": peer_rows}
    fields["llama_server_rounds"] = peer_rounds
    save_result(args.out, f"spec-{args.method}", args.shape, fields)


# -- llama.cpp's server beside it ---------------------------------------------------------------


def llama_servers(args: argparse.Namespace) -> list[System]:
    """llama-server without drafts and with the same draft model (k = 4, the variants' k_max);
    none without --llama-server."""
    if args.llama_server is None or args.method != "draft_model":
        return []
    target, draft = spec_folders(args)
    model, draft_gguf = gguf_file(target, "f32", args), gguf_file(draft, "f32", args)
    if model is None or draft_gguf is None:
        print("llama.cpp: skipped (no GGUF and no --gguf-python/--llama-src)")
        return []
    argv = [str(args.llama_server), "-m", str(model), "-t", str(args.threads), "-np", "1"]
    argv += ["-c", "2048", "--temp", "0"]
    k = str(VARIANTS["k=4"]["num_speculative_tokens"])  # type: ignore[index]
    spec = ["-md", str(draft_gguf), *_draft_flags(args.llama_server, k)]
    return [System("llama.cpp", argv, "/health"), System("llama.cpp-draft", argv + spec, "/health")]


def _draft_flags(server: Path, k: str) -> list[str]:
    """The draft-model flags by the names this llama-server's --help uses (newer ones also need
    `--spec-type draft-simple`, or the draft model is loaded and never asked)."""
    help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True).stdout
    if "--spec-draft-n-max" not in help_text:
        return ["--draft-max", k, "--draft-min", "0"]
    flags = ["--spec-draft-n-max", k, "--spec-draft-n-min", "0"]
    if "draft-simple" in help_text:
        flags += ["--spec-type", "draft-simple"]
    return flags


def run_llama(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """The prompts one at a time on llama-server's /completion, greedy: wall time, tokens and
    its draft counts (its own `timings`)."""
    import httpx

    seconds = tokens = drafted = accepted = 0.0
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1}
            body |= {"ignore_eos": True, "cache_prompt": False}
            t0 = time.perf_counter()
            r = client.post(url + "/completion", json=body)
            seconds += time.perf_counter() - t0
            r.raise_for_status()
            timings = r.json()["timings"]
            tokens += timings["predicted_n"]
            drafted += timings.get("draft_n", 0)
            accepted += timings.get("draft_n_accepted", 0)
    return {"seconds": seconds, "tokens": tokens, "draft_n": drafted, "accepted": accepted}


def summarize_llama(
    rounds: list[dict[str, Run]], peer_rounds: list[dict[str, dict[str, float]]]
) -> list[dict[str, float | str]]:
    """llama-server's tok/s, speed-up and acceptance per system, and inferd's adaptive and k=4
    variants over its speculative one (the same round's, medians)."""
    rows: list[dict[str, float | str]] = []
    if not peer_rounds or not peer_rounds[0]:
        return rows
    print(f"{'llama.cpp':>15} {'tok/s':>7} {'x off':>6} {'accept':>7}   inferd adaptive, k=4 / it")
    for name in peer_rounds[0]:
        tok_s = [p[name]["tokens"] / p[name]["seconds"] for p in peer_rounds]
        speedup = [
            p[name]["tokens"]
            / p[name]["seconds"]
            * p["llama.cpp"]["seconds"]
            / p["llama.cpp"]["tokens"]
            for p in peer_rounds
        ]
        drafted = sum(p[name]["draft_n"] for p in peer_rounds)
        a = sum(p[name]["accepted"] for p in peer_rounds) / drafted if drafted else 0.0
        ours = {
            v: statistics.median(r[v].tok_s / t for r, t in zip(rounds, tok_s, strict=True))
            for v in ("adaptive", "k=4")
        }
        row: dict[str, float | str] = {
            "system": name,
            "tok_s": statistics.median(tok_s),
            "speedup": statistics.median(speedup),
            "acceptance": a,
            "inferd_adaptive_over": ours["adaptive"],
            "inferd_k4_over": ours["k=4"],
        }
        rows.append(row)
        print(
            f"{name:>15} {row['tok_s']:7.1f} {row['speedup']:6.2f} {a:7.2f}   "
            f"{ours['adaptive']:.2f}x, {ours['k=4']:.2f}x"
        )
    return rows


if __name__ == "__main__":
    main()
