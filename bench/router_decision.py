"""How long `inferd router` takes to decide where a long prompt goes (no servers, no network).

    .venv/bin/python bench/router_decision.py --prompt-tokens 8192 --replicas 4 --decisions 1000

A decision is what the router's `inferd_router_decision_seconds` histogram times: validate the
body with the gateway's request model, tokenize it (chat template applied), hash its blocks,
match them against each replica's prefix index, and run the policy; then `dispatch` records the
choice (index insert, load). The index is warm: `--groups` prefix groups already placed, each
prompt sharing one group's first half and having its own second half, so every decision walks a
long match. Reported: p50, p99 and max over `--decisions` requests, for a chat body (tokenized at
the router), for the same prompt as token ids (validated, not tokenized), and for the routing
proper alone (block hashes, index match, policy, dispatch), against the issue's bound of 1 ms
p99 for an 8k-token prompt.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import command_line, default_result_path, machine_info, write_result

from inferd.router.cluster import Cluster
from inferd.router.config import RouterConfig
from inferd.router.tokenize import CHAT, COMPLETIONS, load_tokenizer, prompt_token_ids, validate


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    urls = [f"http://replica-{i}:8000" for i in range(args.replicas)]
    cluster = Cluster(RouterConfig(replicas=tuple(urls), max_match_blocks=args.prompt_tokens))
    for url in urls:
        cluster.set_health(url, True)
    tok = load_tokenizer("inferd-tiny", None, None)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n_words))

    # Calibrate words per token once, so prompts come out near --prompt-tokens.
    per_word = len(tok.encode(text(1000))) / 1000
    half = int(args.prompt_tokens / 2 / per_word)
    groups = [text(half) for _ in range(args.groups)]

    def body(i: int) -> dict[str, Any]:
        content = groups[i % args.groups] + " " + text(half)
        return {"model": "m", "messages": [{"role": "user", "content": content}]}

    def decide_chat(b: dict[str, Any]) -> int:
        ids = prompt_token_ids(tok, validate(CHAT, b))
        routed = cluster.route(ids)
        cluster.dispatch(routed.decision.replica, routed).finish()
        return len(ids)

    def decide_ids(ids: list[int]) -> int:
        b = validate(COMPLETIONS, {"model": "m", "prompt": ids})
        routed = cluster.route(prompt_token_ids(tok, b))
        cluster.dispatch(routed.decision.replica, routed).finish()
        return len(ids)

    def decide_route(ids: list[int]) -> int:
        routed = cluster.route(ids)
        cluster.dispatch(routed.decision.replica, routed).finish()
        return len(ids)

    bodies = [body(i) for i in range(args.decisions)]
    for b in bodies[: args.groups * 2]:  # warm the index: every group placed
        decide_chat(b)
    id_prompts = [prompt_token_ids(tok, validate(CHAT, b)) for b in bodies]
    out: dict[str, Any] = {"prompt_tokens_mean": float(np.mean([len(p) for p in id_prompts]))}
    cases: list[tuple[str, Callable[[Any], int], list[Any]]] = [
        ("chat (tokenized at the router)", decide_chat, bodies),
        ("token ids", decide_ids, id_prompts),
        ("hash + match + policy only", decide_route, id_prompts),
    ]
    for name, fn, inputs in cases:
        samples = []
        for x in inputs:
            t0 = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - t0)
        out[name] = percentiles(samples)
        p = out[name]
        print(
            f"{name:32s} p50 {p['p50_ms']:.3f} ms  p99 {p['p99_ms']:.3f} ms  max {p['max_ms']:.3f}"
        )
    print(
        f"prompt tokens (mean) {out['prompt_tokens_mean']:.0f}, {args.replicas} replicas, "
        f"{args.groups} groups in the index"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--decisions", type=int, default=1000)
    args = p.parse_args()
    result = run(args)
    path = default_result_path("router_decision", f"{args.prompt_tokens}tok")
    write_result(path, {"command": command_line(), "machine": machine_info(), "result": result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
