"""The served single stream of two source revisions, both servers up, requests alternating.

    .venv/bin/python bench/served_ab.py --base 5cd197e
    .venv/bin/python bench/served_ab.py --base 5cd197e --shape qwen2-0.5b-shape --n 16 \\
        --server-args "--dtype bfloat16"

Exports `inferd/` at `--base` (git archive, as bench/engine_ab.py) and starts `inferd serve` from
it and from the working tree, both at once on loopback (a server with nothing to do sleeps: its
core waits in `poll`, its front in `epoll`). Then `--n` single streams (bench/peers.py's: a
32-token prompt, `--tokens` greedy tokens, ignore_eos, bench/serve.py's streaming client) go to
the two in the order base, tree, tree, base, ... so a slow spell of this shared machine, which
lasts tens of seconds here, hits both alike; running the servers one after the other (as
bench/peers.py does) could not resolve a 5 % difference. Prints each stream's output tok/s (as
bench/peers.py's single stream: tokens over the request's whole time), the means and medians,
and the working tree's over the base's; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import DEFAULT_CACHE_DIR, save_result
from engine_ab import export
from peers import SHAPES, System, launched, run_workload, single_workload, weights_folder


def stream_tok_s(url: str, pid: int, shape_name: str, tokens: int, seed: int) -> float:
    """One single stream (bench/peers.py's), its output tok/s as peers.py reports it."""
    summary = run_workload(url, single_workload(SHAPES[shape_name], tokens, seed), pid)
    if summary["failed"]:
        raise RuntimeError("the stream failed")
    return float(summary["output_throughput"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare the working tree with")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-32m")
    p.add_argument("--server-args", default="--dtype float32 --num-threads 2")
    p.add_argument("--n", type=int, default=40, help="streams in all, half to each server")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    folder = weights_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    server_args = shlex.split(args.server_args)
    rates: dict[str, list[float]] = {"base": [], "tree": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        trees = {
            "base": export(args.base, Path(tmp)),
            "tree": Path(__file__).resolve().parent.parent,
        }
        argv = [sys.executable, "-m", "inferd.cli", "serve", str(folder)]
        argv += ["--served-model-name", "m", "--disable-access-log", *server_args]
        servers = {
            name: stack.enter_context(
                launched(
                    System(name, argv, "/health/ready", {"PYTHONPATH": str(tree)}),
                    Path(tmp) / f"{name}.log",
                )
            )
            for name, tree in trees.items()
        }
        for srv in servers.values():
            stream_tok_s(srv.url, srv.pid, args.shape, 16, seed=99)  # warm-up
        order = ["base", "tree", "tree", "base"]
        for i in range(args.n):
            name = order[i % 4]
            srv = servers[name]
            rate = stream_tok_s(srv.url, srv.pid, args.shape, args.tokens, seed=i)
            rates[name].append(rate)
            print(f"{i:3d} {name:>4}: {rate:7.1f} tok/s", flush=True)
    base, tree = np.array(rates["base"]), np.array(rates["tree"])
    ratio = float(tree.mean() / base.mean())
    ratio_median = float(np.median(tree) / np.median(base))
    print(
        f"base {args.base}: mean {base.mean():.1f} median {np.median(base):.1f} tok/s; "
        f"tree: mean {tree.mean():.1f} median {np.median(tree):.1f}; "
        f"tree / base {ratio:.3f}x (medians {ratio_median:.3f}x)"
    )
    fields = {
        "base": args.base,
        "shape": args.shape,
        "server_args": server_args,
        "tokens": args.tokens,
        "tok_s": rates,
        "ratio_mean": ratio,
        "ratio_median": ratio_median,
    }
    save_result(args.out, "served_ab", args.shape, fields)


if __name__ == "__main__":
    main()
