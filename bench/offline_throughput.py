"""Offline throughput: inferd's continuous batching against Hugging Face static batching.

    .venv/bin/python bench/offline_throughput.py --model tiny
    .venv/bin/python bench/offline_throughput.py --model all --num-requests 16 --skip-hf
    python bench/offline_throughput.py --model qwen2-0.5b-shape --device cuda --dtype bfloat16

Both systems get the same seeded requests (random prompt ids, prompt lengths uniform in [16, 512],
output lengths uniform in [16, 256], every request generating exactly its output length) on the
same architecture with random weights (float32 unless --dtype), on the same device (the CPU, with
the same thread count, unless --device cuda). inferd takes them all at once (`LLM.generate`);
transformers runs them in arrival order in static batches, each batch generating until its
longest request is done. Only a request's own output length counts as
useful tokens. See docs/benchmarks.md for what each printed number means.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_CACHE_DIR,
    SHAPES,
    BenchRequest,
    MatmulTiming,
    ModelShape,
    WorkloadSpec,
    command_line,
    default_result_path,
    ensure_model_folder,
    machine_info,
    make_workload,
    measure_matmul_peak,
    synchronize,
    tokenizer_info,
    workload_stats,
    write_result,
)
from tqdm.auto import tqdm

STAGES = ("schedule", "prepare_inputs", "forward", "sample", "detokenize")
TARGET_RATIO = {"tiny": 4.0, "qwen2-0.5b-shape": 2.0}
TARGET_OUTSIDE_FORWARD = 0.10
WARMUP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Settings:
    """Everything about a run except the model and the workload."""

    threads: int
    temperature: float
    seed: int
    hf_batch_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_memory_gib: float | None
    busy_threshold: int
    # "cpu" or "cuda": both systems run there, in `dtype`.
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class SystemResult:
    """One system's run over the whole workload (warm-up excluded)."""

    system: str
    num_requests: int
    # Tokens the requests asked for and got: sum of each request's own output length.
    output_tokens: int
    wall_seconds: float
    # Model construction (random init) and warm-up, outside the timed region.
    setup_seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"output_tokens_per_second": self.tokens_per_second}


# -- inferd -----------------------------------------------------------------------------------


def run_inferd(
    folder: Path, requests: list[BenchRequest], s: Settings, vocab_size: int
) -> SystemResult:
    from inferd import LLM

    t0 = time.perf_counter()
    llm = LLM(model=str(folder), **_inferd_kwargs(s))
    llm.generate(*_inferd_inputs(_warmup_requests(vocab_size, s.seed), s), use_tqdm=False)
    setup = time.perf_counter() - t0
    stats = llm.llm_engine.step_stats
    stats.clear()
    prompts, params = _inferd_inputs(requests, s)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    details = {
        "engine_info": asdict(llm.llm_engine.info),
        "lengths_match": lengths == [r.output_len for r in requests],
        "steps_all": stats.summary(),
        "steps_busy": stats.summary(min_running=s.busy_threshold),
    }
    del llm, outs
    gc.collect()
    return SystemResult("inferd", len(requests), sum(lengths), wall, setup, details)


def _inferd_kwargs(s: Settings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": s.dtype,
        "device": s.device,
        "load_format": "dummy",
        "seed": s.seed,
        "num_threads": s.threads,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "block_size": s.block_size,
    }
    if s.kv_cache_memory_gib is not None:
        kwargs["kv_cache_memory"] = int(s.kv_cache_memory_gib * 2**30)
    return kwargs


def _inferd_inputs(requests: list[BenchRequest], s: Settings) -> tuple[list[Any], list[Any]]:
    from inferd import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=s.temperature)
        for r in requests
    ]
    return prompts, params


def _warmup_requests(vocab_size: int, seed: int) -> list[BenchRequest]:
    """Two short requests that run every code path once (prefill, decode, sample).

    Drawn apart from the workload: a warm-up prompt that repeated the start of a real one would
    leave its blocks in inferd's prefix cache and hand the timed run free prefill.
    """
    spec = WorkloadSpec(
        num_requests=2,
        vocab_size=vocab_size,
        seed=seed + WARMUP_SEED_OFFSET,
        min_prompt_len=16,
        max_prompt_len=16,
        min_output_len=4,
        max_output_len=4,
    )
    return make_workload(spec)


# -- Hugging Face transformers ----------------------------------------------------------------


def run_hf(folder: Path, requests: list[BenchRequest], s: Settings) -> SystemResult:
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    config = AutoConfig.from_pretrained(folder)
    dtype = getattr(torch, s.dtype)
    # Built on the device: random init of a 0.5B model in bfloat16 on the CPU took minutes.
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()  # type: ignore[no-untyped-call]
    _hf_generate(model, _warmup_requests(config.vocab_size, s.seed), s)
    setup = time.perf_counter() - t0
    torch.manual_seed(s.seed)
    batches = [requests[i : i + s.hf_batch_size] for i in range(0, len(requests), s.hf_batch_size)]
    computed, ok = 0, True
    t0 = time.perf_counter()
    with tqdm(total=len(requests), desc="HF generate", unit="req") as bar:
        for batch in batches:
            new_tokens = _hf_generate(model, batch, s)
            ok = ok and new_tokens == max(r.output_len for r in batch)
            computed += new_tokens * len(batch)
            bar.update(len(batch))
    synchronize(s.device)
    wall = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    details = {
        "batch_size": s.hf_batch_size,
        "num_batches": len(batches),
        "lengths_match": ok,
        # Every row of a batch decodes until the batch's longest request is done.
        "generated_tokens_incl_waste": computed,
        "useful_fraction": useful / computed,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    del model
    gc.collect()
    return SystemResult(
        f"hf (batch {s.hf_batch_size})", len(requests), useful, wall, setup, details
    )


@torch.inference_mode()
def _hf_generate(model: Any, batch: list[BenchRequest], s: Settings) -> int:
    """Generates one left-padded static batch; returns how many new tokens each row got."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        input_ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n :] = 1
    steps = max(r.output_len for r in batch)
    out = model.generate(
        input_ids=input_ids.to(s.device),
        attention_mask=mask.to(s.device),
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=0,
        **_hf_sampling(s),
    )
    return int(out.shape[1] - width)


def _hf_sampling(s: Settings) -> dict[str, Any]:
    if s.temperature == 0.0:
        return {"do_sample": False}
    # top_k=0 / top_p=1: no truncation, as in inferd's defaults (transformers' top_k is 50).
    return {"do_sample": True, "temperature": s.temperature, "top_k": 0, "top_p": 1.0}


# -- derived numbers --------------------------------------------------------------------------


def stage_shares(summary: dict[str, float]) -> dict[str, float]:
    """Each stage's share of step wall time; `other` is step time no stage timer covered."""
    total = summary["total"]
    if summary["steps"] == 0 or total <= 0:
        return {}
    shares = {st: summary[st] / total for st in STAGES}
    shares["other"] = 1.0 - sum(shares.values())
    shares["outside_forward"] = 1.0 - summary["forward"] / total
    return shares


def linear_gflops(shape: ModelShape, inferd: SystemResult) -> float:
    """Linear-layer GFLOP/s during inferd's forward passes.

    2 FLOPs per weight per token: every computed token runs q/k/v/o and the MLP of every layer;
    the lm_head runs only for rows that sample, about one per output token.
    """
    summary: dict[str, float] = inferd.details["steps_all"]
    flops = 2.0 * (
        summary["num_batched_tokens"] * shape.linear_params_per_token()
        + inferd.output_tokens * shape.lm_head_params
    )
    return flops / max(summary["forward"], 1e-9) / 1e9


# -- one model --------------------------------------------------------------------------------


def run_model(shape: ModelShape, args: argparse.Namespace, s: Settings) -> dict[str, Any]:
    folder = ensure_model_folder(shape, args.cache_dir, with_tokenizer=not args.skip_inferd)
    tok = tokenizer_info(folder)
    tok_vocab = None if tok is None else tok.vocab_size
    spec = _workload_spec(shape, args)
    requests = make_workload(spec)
    _print_header(shape, spec, requests, tok_vocab)
    peak = measure_matmul_peak(shape, device=s.device, dtype=getattr(torch, s.dtype))
    inferd = None if args.skip_inferd else run_inferd(folder, requests, s, shape.vocab_size)
    hf = None if args.skip_hf else run_hf(folder, requests, s)
    result = _model_result(shape, folder, spec, requests, s, peak, inferd, hf)
    result["tokenizer_vocab_size"] = tok_vocab
    print_model_report(result, inferd, hf)
    return result


def _workload_spec(shape: ModelShape, args: argparse.Namespace) -> WorkloadSpec:
    n = args.num_requests if args.num_requests is not None else shape.default_num_requests
    return WorkloadSpec(
        num_requests=n,
        vocab_size=shape.vocab_size,
        seed=args.seed,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
    )


def _model_result(
    shape: ModelShape,
    folder: Path,
    spec: WorkloadSpec,
    requests: list[BenchRequest],
    s: Settings,
    peak: list[MatmulTiming],
    inferd: SystemResult | None,
    hf: SystemResult | None,
) -> dict[str, Any]:
    best = max(peak, key=lambda t: t.gflops)
    result: dict[str, Any] = {
        "model": shape.name,
        "shape": asdict(shape),
        "model_folder": str(folder),
        "workload": asdict(spec) | workload_stats(requests),
        "settings": asdict(s),
        "matmul": [asdict(t) | {"gflops": t.gflops, "label": t.label} for t in peak],
        "matmul_peak_gflops": best.gflops,
        "inferd": None if inferd is None else inferd.to_json(),
        "hf": None if hf is None else hf.to_json(),
        "ratio_inferd_over_hf": None,
        "target_ratio": TARGET_RATIO.get(shape.name),
    }
    if inferd is not None and hf is not None:
        result["ratio_inferd_over_hf"] = inferd.tokens_per_second / hf.tokens_per_second
    if inferd is not None:
        rate = linear_gflops(shape, inferd)
        result["inferd_linear_gflops"] = rate
        result["inferd_fraction_of_peak"] = rate / best.gflops
        result["stage_shares_all"] = stage_shares(inferd.details["steps_all"])
        result["stage_shares_busy"] = stage_shares(inferd.details["steps_busy"])
        result["step_time_fraction_of_wall"] = (
            inferd.details["steps_all"]["total"] / inferd.wall_seconds
        )
    return result


# -- printing ---------------------------------------------------------------------------------


def _print_header(
    shape: ModelShape, spec: WorkloadSpec, requests: list[BenchRequest], tok_vocab: int | None
) -> None:
    w = workload_stats(requests)
    print(
        f"\n== {shape.name}: {shape.architecture}, {shape.num_layers} layers, hidden "
        f"{shape.hidden_size}, vocab {shape.vocab_size}; {spec.num_requests} requests "
        f"(seed {spec.seed}), {int(w['prompt_tokens'])} prompt + {int(w['output_tokens'])} "
        "output tokens"
    )
    if tok_vocab is not None and tok_vocab < shape.vocab_size:
        print(
            f"   note: the tokenizer has {tok_vocab} tokens; generated ids >= {tok_vocab} "
            "decode to nothing, so detokenization is cheaper than with a full vocabulary"
        )


def print_model_report(
    result: dict[str, Any], inferd: SystemResult | None, hf: SystemResult | None
) -> None:
    _print_throughput([r for r in (inferd, hf) if r is not None])
    ratio, target = result["ratio_inferd_over_hf"], result["target_ratio"]
    if ratio is not None:
        goal = f" (target >= {target:.0f}x)" if target is not None else ""
        print(f"inferd / HF output tokens/s: {ratio:.2f}x{goal}")
    if inferd is not None:
        _print_stages(result, inferd)
    _print_peak(result)


def _print_throughput(results: list[SystemResult]) -> None:
    print(
        f"{'system':<16}{'requests':>9}{'output tok':>12}{'wall s':>10}{'tok/s':>10}{'setup s':>9}"
    )
    for r in results:
        print(
            f"{r.system:<16}{r.num_requests:>9}{r.output_tokens:>12}{r.wall_seconds:>10.2f}"
            f"{r.tokens_per_second:>10.1f}{r.setup_seconds:>9.1f}"
        )
        if not r.details.get("lengths_match", True):
            print(f"   warning: {r.system} did not generate exactly the requested lengths")


def _print_stages(result: dict[str, Any], inferd: SystemResult) -> None:
    every, busy = inferd.details["steps_all"], inferd.details["steps_busy"]
    all_shares, busy_shares = result["stage_shares_all"], result["stage_shares_busy"]
    threshold = result["settings"]["busy_threshold"]
    print(f"{'inferd step time':<20}{'all steps':>12}{f'>= {threshold} running':>18}")
    for name in (*STAGES, "other", "outside_forward"):
        print(f"  {name:<18}{_pct(all_shares, name):>12}{_pct(busy_shares, name):>18}")
    print(f"  {'steps':<18}{int(every['steps']):>12}{int(busy['steps']):>18}")
    print(f"  {'step seconds':<18}{every['total']:>12.2f}{busy['total']:>18.2f}")
    verdict = busy_shares.get("outside_forward")
    if verdict is not None:
        ok = "met" if verdict <= TARGET_OUTSIDE_FORWARD else "missed"
        print(f"  outside forward on busy steps: target <= 10 % {ok}")
    print(f"  engine steps cover {100 * result['step_time_fraction_of_wall']:.1f} % of wall time")


def _pct(shares: dict[str, float], name: str) -> str:
    return f"{100 * shares[name]:.1f} %" if name in shares else "n/a"


def _print_peak(result: dict[str, Any]) -> None:
    best = max(result["matmul"], key=lambda t: t["gflops"])
    threads = result["settings"]["threads"]
    s = result["settings"]
    where = f"{threads} threads" if s["device"] == "cpu" else s["device"]
    line = f"matmul peak ({s['dtype']}, {where}): {best['gflops']:.1f} GFLOP/s on {best['label']}"

    if "inferd_linear_gflops" in result:
        line += (
            f"; inferd linear layers: {result['inferd_linear_gflops']:.1f} GFLOP/s = "
            f"{100 * result['inferd_fraction_of_peak']:.0f} % of peak"
        )
    print(line)


# -- entry point ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=[*SHAPES, "all"], default="tiny")
    p.add_argument(
        "--num-requests", type=int, default=None, help="default: 256 (tiny), 64 (qwen2-0.5b-shape)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) or e.g. 1.0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both systems run here")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None, help="default: inferd's")
    p.add_argument("--busy-threshold", type=int, default=64, help="running seqs for a busy step")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-inferd", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="model folders")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    return p.parse_args(argv)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        threads=args.threads,
        temperature=args.temperature,
        seed=args.seed,
        hf_batch_size=args.hf_batch_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        busy_threshold=args.busy_threshold,
        device=args.device,
        dtype=args.dtype,
    )


def _versions() -> dict[str, str | None]:
    import transformers

    try:
        import inferd

        inferd_version: str | None = inferd.__version__
    except ImportError:
        inferd_version = None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "inferd": inferd_version,
    }


def _check_inferd_imports() -> str | None:
    """Why `from inferd import LLM` fails, or None: checked before any model is built."""
    try:
        from inferd import LLM, SamplingParams  # noqa: F401
    except Exception as e:  # any import-time failure means the same: no inferd run possible
        return f"{type(e).__name__}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = _settings(args)
    if not args.skip_inferd and (why := _check_inferd_imports()) is not None:
        print(f"cannot import inferd ({why}); run with --skip-inferd", file=sys.stderr)
        return 2
    torch.set_num_threads(settings.threads)
    names = list(SHAPES) if args.model == "all" else [args.model]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = machine_info()
    load = machine["load_average_1m"]
    if load is not None and load > settings.threads:
        print(
            f"warning: load average {load:.1f} > {settings.threads} threads: other work shares "
            "the cores, so every number below is low and noisy"
        )
    results = [run_model(SHAPES[name], args, settings) for name in names]
    out = args.out or default_result_path("offline", args.model)
    write_result(
        out,
        {
            "benchmark": "offline_throughput",
            "command": command_line(),
            "started_at": started,
            "machine": machine,
            "versions": _versions(),
            "results": results,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
