"""Served-path overhead: AsyncLLM (engine core in its own process) vs offline LLM.generate.

Both run the same seeded workload (bench/common.py's make_workload) on the same model with the
same engine settings; the served side sends every request at once as concurrent streams and
reads every delta. Reports output tokens/s of each and the ratio served/offline (target >= 0.9).

    .venv/bin/python bench/async_engine.py --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from common import WorkloadSpec, make_workload, workload_stats

from inferd import LLM, SamplingParams
from inferd.config import AdmissionConfig, EngineConfig
from inferd.engine.async_client import AsyncLLM
from inferd.engine.generate_request import GenerateRequest


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "seed": args.seed,
        "num_threads": args.threads,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": args.kv_cache_mib << 20,
    }


def requests_and_params(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        vocab_size=4096,
        seed=args.seed,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
    )
    reqs = make_workload(spec)
    print("workload:", workload_stats(reqs))
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs
    ]
    return [r.prompt_token_ids for r in reqs], params


def run_offline(args: argparse.Namespace, prompts: list[list[int]], params: Any) -> float:
    llm = LLM(**engine_kwargs(args))
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall


async def run_served(args: argparse.Namespace, prompts: list[list[int]], params: Any) -> float:
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    llm = await AsyncLLM.start(config, AdmissionConfig())
    try:
        await _consume(llm, "warmup", [5, 6, 7, 8], SamplingParams(max_tokens=4))
        t0 = time.perf_counter()
        pairs = enumerate(zip(prompts, params, strict=True))
        counts = await asyncio.gather(*(_consume(llm, f"r{i}", p, sp) for i, (p, sp) in pairs))
        wall = time.perf_counter() - t0
    finally:
        await llm.shutdown()
    return sum(counts) / wall


async def _consume(llm: AsyncLLM, rid: str, ids: list[int], params: SamplingParams) -> int:
    n = 0
    async for out in llm.generate(GenerateRequest(rid, ids, params)):
        n += len(out.outputs[0].token_ids)
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=2, help="alternating runs of each; best kept")
    args = p.parse_args()
    prompts, params = requests_and_params(args)
    offline, served = [], []
    for _ in range(args.repeat):
        offline.append(run_offline(args, prompts, params))
        served.append(asyncio.run(run_served(args, prompts, params)))
        print(f"offline {offline[-1]:.1f} tok/s, served {served[-1]:.1f} tok/s")
    result = {
        "offline_tokens_per_s": max(offline),
        "served_tokens_per_s": max(served),
        "ratio": max(served) / max(offline),
        "runs": {"offline": offline, "served": served},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
