"""Side by side: inferd, vLLM's CPU backend and llama.cpp's llama-server on the same workloads.

    P=/tmp/peers L=$P/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python bench/peers.py --vllm-python $P/vllm/venv/bin/python \\
        --llama-server $L/build/bin/llama-server --gguf-python $P/gguf-venv/bin/python \\
        --llama-src $L --shapes llama-32m --rounds 2

The peers are never dependencies: each is a path given on the command line (`../shared/peers/
setup.sh` installs both), and one that is absent is skipped with a note. Every system runs alone,
one after another, the order rotating each round. Per system and round: start the server on a free
loopback port (start-up = spawn to the first 200 on its health route), two warm-up requests, then

- mixed: every request of a seeded workload sent at once (prompts 16-256 tokens, outputs 16-128,
  `ignore_eos`), streaming `/v1/completions` with token-id prompts (bench/serve.py's client);
- single: one stream, a 32-token prompt, 256 output tokens (`--single-tokens`), twice.

Reported: output tok/s, TTFT / TPOT percentiles, server CPU seconds per output token (the server's
whole process tree, from /proc), start-up seconds; for single streams the memory-bandwidth bound
(weight bytes read per token / copy bandwidth measured in the same run). JSON + a plot in
bench/results/. Model folders hold random float32 weights written by transformers (`from_config`,
seed 0), converted to GGUF (f32, q8_0) with llama.cpp's converter for llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
from common import (
    DEFAULT_CACHE_DIR,
    REPO_ROOT,
    BenchRequest,
    ModelShape,
    WorkloadSpec,
    command_line,
    default_result_path,
    ensure_model_folder,
    machine_info,
    make_workload,
    write_result,
)
from serve import (
    completion_body,
    free_port,
    proc_table,
    run_load,
    stop_server,
    summarize,
    wait_ready,
)

# The model A: the tiny Llama with an 8k vocabulary (~32 M parameters).
SHAPES = common.SHAPES | {
    "llama-32m": dataclasses.replace(common.SHAPES["tiny"], name="llama-32m", vocab_size=8192),
    # Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 128 experts of 768, top 8, 32 / 4 heads,
    # untied 152k vocab) scaled to this machine: half the width, a third of the layers, a
    # quarter of the experts, the same top 8 and head ratio. 507 M parameters (2.0 GB float32,
    # so a peer's load-time peak fits beside the other jobs in 24 GiB), 172 M of them active per
    # token (0.69 GB: the single stream's bandwidth bound).
    "qwen3-moe": common.ModelShape(
        name="qwen3-moe",
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=16,
        num_heads=16,
        num_kv_heads=2,
        vocab_size=32000,
        tie_word_embeddings=False,
        default_num_requests=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        num_experts=32,
        experts_per_token=8,
        moe_intermediate_size=256,
    ),
    # gpt-oss-20b's shape (hidden 2880, 24 layers, 32 experts of 2880, top 4, 64 / 8 heads of 64)
    # scaled down the same way: 1,024 wide, 8 layers, 16 experts of 512, top 4, 16 / 2 heads of
    # 64, window-128 and full layers alternating, attention sinks.
    "gpt-oss": common.ModelShape(
        name="gpt-oss",
        architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        hidden_size=1024,
        intermediate_size=512,
        num_layers=8,
        num_heads=16,
        num_kv_heads=2,
        vocab_size=32000,
        tie_word_embeddings=False,
        default_num_requests=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_experts=16,
        experts_per_token=4,
        moe_intermediate_size=512,
    ),
}
MIXED_REQUESTS = {
    "llama-32m": 96,
    "tiny": 96,
    "qwen2-0.5b-shape": 32,
    "qwen3-moe": 32,
    "gpt-oss": 32,
}
READY_TIMEOUT_S = 600.0
TO_GGUF = REPO_ROOT.parent / "shared" / "peers" / "to_gguf.py"


@dataclass
class System:
    """One server to measure: how to start it and where it says it is ready."""

    name: str
    argv: list[str]
    health: str
    env: dict[str, str] = field(default_factory=dict)


# -- model folders ----------------------------------------------------------------------------


def weights_folder(shape: ModelShape, cache_dir: Path) -> Path:
    """config + tokenizer (bench/common.py) plus random float32 safetensors weights, once."""
    base = ensure_model_folder(shape, cache_dir)
    folder = cache_dir / f"{shape.name}-weights"
    if (folder / "model.safetensors").exists() or (
        folder / "model.safetensors.index.json"
    ).exists():
        return folder
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(base)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(folder, safe_serialization=True)
    for f in base.iterdir():
        if f.name != "config.json" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def gguf_file(folder: Path, outtype: str, args: argparse.Namespace) -> Path | None:
    out = folder.parent / f"{folder.name}-{outtype}.gguf"
    if out.exists():
        return out
    if not (args.gguf_python and args.llama_src and TO_GGUF.exists()):
        return None
    env = os.environ | {"LLAMA_SRC": str(args.llama_src)}
    cmd = [str(args.gguf_python), str(TO_GGUF), str(folder), str(out), "--outtype", outtype]
    print(f"converting: {shlex.join(cmd)}")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return out


# -- systems ----------------------------------------------------------------------------------


def systems(shape: ModelShape, folder: Path, args: argparse.Namespace) -> list[System]:
    out: list[System] = []
    inferd = str(Path(sys.executable).parent / "inferd")
    for variant in args.inferd:
        name, _, extra = variant.partition("=")
        argv = [inferd, "serve", str(folder), "--served-model-name", "m", "--num-threads", "2"]
        argv += ["--disable-access-log", *shlex.split(extra or "--dtype float32")]
        # The checkout this script lives in, not whatever the venv's editable install points at
        # (a git worktree shares the main checkout's venv).
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        out.append(System(name, argv, "/health/ready", {"PYTHONPATH": path}))
    if args.vllm_python and Path(args.vllm_python).exists():
        out.extend(_vllm(folder, args, dtype) for dtype in args.vllm_dtypes.split(","))
    else:
        print("vLLM: skipped (no --vllm-python)")
    if args.llama_server and Path(args.llama_server).exists():
        for outtype in args.gguf_types:
            gguf = gguf_file(folder, outtype, args)
            if gguf is None:
                print(f"llama.cpp {outtype}: skipped (no GGUF and no --gguf-python/--llama-src)")
                continue
            n = MIXED_REQUESTS.get(shape.name, 32)
            argv = [str(args.llama_server), "-m", str(gguf), "-np", str(n), "-c", str(n * 400)]
            argv += ["--cont-batching", "-t", "2"]
            out.append(System(f"llama.cpp-{outtype}", argv, "/health"))
    else:
        print("llama.cpp: skipped (no --llama-server)")
    return out


def _vllm(folder: Path, args: argparse.Namespace, dtype: str) -> System:
    venv = Path(args.vllm_python).parent.parent
    preload = [
        p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if Path(p).exists()
    ]
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    argv = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    argv += [str(folder), "--dtype", dtype, "--served-model-name", "m"]
    # The first dtype keeps the plain name, so runs with the default compare with older ones.
    name = "vllm-cpu" if dtype == args.vllm_dtypes.split(",")[0] else f"vllm-cpu-{dtype}"
    return System(name, argv, "/health", env)


@dataclass
class Running:
    url: str
    pid: int
    startup_s: float


@contextmanager
def launched(system: System, log_path: Path) -> Iterator[Running]:
    port = free_port()
    argv = [*system.argv, "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"launching {system.name}: {shlex.join(argv)}")
    with log_path.open("w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | system.env
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base + system.health, proc, READY_TIMEOUT_S)
            yield Running(base, proc.pid, time.perf_counter() - t0)
        finally:
            stop_server(proc)


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of `pid` and every descendant (vLLM's worker is a grandchild)."""
    table = proc_table()
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, (ppid, _) in table.items() if ppid == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(table[p][1] for p in tree if p in table)


# -- workloads --------------------------------------------------------------------------------


def mixed_workload(shape: ModelShape, n: int, seed: int) -> list[BenchRequest]:
    spec = WorkloadSpec(
        num_requests=n,
        vocab_size=shape.vocab_size,
        seed=seed,
        min_prompt_len=16,
        max_prompt_len=256,
        min_output_len=16,
        max_output_len=128,
    )
    return make_workload(spec)


def single_workload(shape: ModelShape, tokens: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(0, shape.vocab_size, 32).tolist(), tokens)]


def run_workload(
    url: str, reqs: list[BenchRequest], pid: int, models: list[str] | None = None
) -> dict[str, Any]:
    """Streams every request at once; `models` names each request's `model` (a LoRA adapter,
    bench/lora_peers.py), default the served model `m`."""
    load_args = argparse.Namespace(
        max_concurrency=None,
        no_progress=True,
        request_rate=float("inf"),
        seed=0,
        request_timeout=3600.0,
    )
    names = models or ["m"] * len(reqs)
    bodies = [completion_body(r, m, 0.0) for r, m in zip(reqs, names, strict=True)]
    cpu0 = tree_cpu_seconds(pid)
    results, wall, _ = asyncio.run(run_load(f"{url}/v1/completions", bodies, load_args))
    cpu = tree_cpu_seconds(pid) - cpu0
    for r in results:
        # A server that sends no usage chunk: one token per chunk.
        if r.chunk_times and not r.output_tokens:
            r.output_tokens, r.success = len(r.chunk_times), True
    s = summarize(results, wall, {})
    s["server_cpu_s"] = cpu
    s["server_cpu_ms_per_token"] = 1000.0 * cpu / max(1, s["total_output_tokens"])
    return s


def measure(
    system: System, shape: ModelShape, args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    with launched(system, log) as srv:
        out: dict[str, Any] = {"startup_s": srv.startup_s}
        run_workload(srv.url, mixed_workload(shape, 2, args.seed + 99), srv.pid)  # warm-up
        n = args.num_requests or MIXED_REQUESTS.get(shape.name, 32)
        out["mixed"] = run_workload(srv.url, mixed_workload(shape, n, args.seed), srv.pid)
        singles = [
            run_workload(
                srv.url, single_workload(shape, args.single_tokens, args.seed + i), srv.pid
            )
            for i in range(args.single_repeats)
        ]
        out["single"] = max(singles, key=lambda s: s["output_throughput"])
        out["single_all_tok_s"] = [s["output_throughput"] for s in singles]
        return out


# -- machine bounds ---------------------------------------------------------------------------


def copy_bandwidth_gbs(threads: int = 2) -> float:
    """Best of a few 512 MiB tensor copies (read + write bytes) / s: the roofline's bandwidth."""
    torch.set_num_threads(threads)
    src = torch.ones(128 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t))
    return best / 1e9


def weight_bytes_per_token(shape: ModelShape, bytes_per_weight: float) -> float:
    return (shape.linear_params_per_token() + shape.lm_head_params) * bytes_per_weight


# -- report -----------------------------------------------------------------------------------


def print_table(shape: ModelShape, rows: list[dict[str, Any]], bw: float) -> None:
    """One line per run. TTFT comes as p50 and mean: with every request sent at once, first tokens
    arrive in a few waves, one per prefill step (2,048 tokens: ~15 of the Qwen shape's 32
    prompts), so the median is the end of one step or of the next and can jump by a whole step
    between two runs of the same server; the mean moves with the steps' length."""
    print(f"\n== {shape.name} ==  (copy bandwidth {bw:.1f} GB/s)")
    head = f"{'system':<22}{'round':>6}{'mixed tok/s':>13}{'TTFT p50 s':>12}{'mean s':>8}"
    head += f"{'TPOT p50 ms':>13}{'CPU ms/tok':>12}{'single tok/s':>14}{'bound':>8}{'start s':>9}"
    print(head)
    for r in rows:
        m, s = r["mixed"], r["single"]
        print(
            f"{r['system']:<22}{r['round']:>6}{m['output_throughput']:>13.1f}"
            f"{m['ttft_ms']['p50'] / 1000:>12.2f}{m['ttft_ms']['mean'] / 1000:>8.2f}"
            f"{m['tpot_ms']['p50']:>13.1f}"
            f"{m['server_cpu_ms_per_token']:>12.2f}{s['output_throughput']:>14.1f}"
            f"{r['bandwidth_bound_tok_s']:>8.0f}{r['startup_s']:>9.1f}"
        )


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per system: mean mixed and single tok/s over rounds, and each as a ratio to vLLM's."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["system"], []).append(r)
    means = {
        name: {
            "mixed_tok_s": float(np.mean([r["mixed"]["output_throughput"] for r in rs])),
            "single_tok_s": float(np.mean([r["single"]["output_throughput"] for r in rs])),
            "ttft_p50_s": float(np.mean([r["mixed"]["ttft_ms"]["p50"] for r in rs])) / 1000,
            "ttft_mean_s": float(np.mean([r["mixed"]["ttft_ms"]["mean"] for r in rs])) / 1000,
            "cpu_ms_per_token": float(np.mean([r["mixed"]["server_cpu_ms_per_token"] for r in rs])),
            "startup_s": float(np.mean([r["startup_s"] for r in rs])),
        }
        for name, rs in by.items()
    }
    for ref in ("vllm-cpu", "llama.cpp-f32"):
        if ref in means:
            for m in means.values():
                m[f"mixed_vs_{ref}"] = m["mixed_tok_s"] / means[ref]["mixed_tok_s"]
                m[f"single_vs_{ref}"] = m["single_tok_s"] / means[ref]["single_tok_s"]
    return means


def write_plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["shapes"])
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.2 * len(shapes)), squeeze=False)
    for row, name in enumerate(shapes):
        means = results["shapes"][name]["summary"]
        systems_ = list(means)
        for col, key in enumerate(("mixed_tok_s", "single_tok_s")):
            ax = axes[row][col]
            ax.bar(systems_, [means[s][key] for s in systems_], color="tab:blue")
            ax.set_title(f"{name}: {'mixed batch' if col == 0 else 'single stream'} (tok/s)")
            ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="llama-32m", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--inferd",
        action="append",
        default=None,
        help="NAME=SERVE-FLAGS, repeatable (default: inferd=--dtype float32)",
    )
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument(
        "--vllm-dtypes", default="float32", help="comma-separated vLLM --dtype values to run"
    )
    p.add_argument("--llama-server", type=Path, default=None)
    p.add_argument("--gguf-python", type=Path, default=None)
    p.add_argument("--llama-src", type=Path, default=None)
    p.add_argument("--gguf-types", default="f32", help="comma-separated GGUF types: f32,q8_0")
    p.add_argument(
        "--num-requests", type=int, default=None, help="mixed requests (per shape default)"
    )
    p.add_argument("--single-tokens", type=int, default=256)
    p.add_argument("--single-repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.inferd = args.inferd or ["inferd=--dtype float32"]
    args.gguf_types = [t for t in args.gguf_types.split(",") if t]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"command": command_line(), "machine": machine_info(), "shapes": {}}
    bw = copy_bandwidth_gbs()
    results["copy_bandwidth_gbs"] = bw
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        folder = weights_folder(shape, args.cache_dir)
        syss = systems(shape, folder, args)
        rows: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            order = syss[rnd % len(syss) :] + syss[: rnd % len(syss)]
            for system in order:
                log = REPO_ROOT / "bench" / "results" / "logs" / f"peers_{stamp}_{system.name}.log"
                r = measure(system, shape, args, log)
                bpw = 1.0 if "q8_0" in system.name or "int8" in system.name else 4.0
                if "bf16" in system.name or "bfloat16" in " ".join(system.argv):
                    bpw = 2.0
                r |= {"system": system.name, "round": rnd, "argv": system.argv}
                r["bandwidth_bound_tok_s"] = bw * 1e9 / weight_bytes_per_token(shape, bpw)
                rows.append(r)
                print_table(shape, rows[-1:], bw)
        print_table(shape, rows, bw)
        summary = ratios(rows)
        print(json.dumps(summary, indent=1))
        results["shapes"][name] = {"rows": rows, "summary": summary, "shape": shape}
    out = args.out or default_result_path("peers", args.shapes.replace(",", "+"))
    write_result(out, results)
    write_plot(out.with_suffix(".png"), results)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
