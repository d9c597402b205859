"""Shared pieces of the benchmarks: model shapes, seeded workloads, model folders, machine info.

A benchmark script does `from common import ...` (Python puts the script's folder, bench/, first on
sys.path). Nothing here imports the engine at module level, so a benchmark's Hugging Face half
keeps working while the engine cannot be imported.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from argparse import ArgumentParser, RawTextHelpFormatter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
# Outside the repository, so generated model folders never show up in `git status`.
DEFAULT_CACHE_DIR = Path("~/.cache/inferd/bench-models").expanduser()


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape, enough to write a Hugging Face config.json for it."""

    name: str
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    # Requests per run when the caller gives no --num-requests: big shapes get fewer.
    default_num_requests: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    # Qwen2 puts a bias on q/k/v; counted in the linear FLOPs so the rate stays honest.
    qkv_bias: bool = False
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` gated MLPs of
    # `moe_intermediate_size`, `experts_per_token` of them run per token (0: a dense MLP).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def linear_params_per_layer(self) -> int:
        """Weights of q, k, v, o and the gated MLP (gate, up, down) of one layer."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * (self.num_heads * self.head_dim) * 2 + h * kv * 2
        if self.num_experts:
            # The active experts only (what a token multiplies by), and the router.
            return (
                attn
                + self.experts_per_token * 3 * h * self.moe_intermediate_size
                + (h * self.num_experts)
            )
        return attn + 3 * h * self.intermediate_size

    def linear_params_per_token(self) -> int:
        """Linear weights every computed token multiplies by (lm_head excluded)."""
        return self.num_layers * self.linear_params_per_layer()

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    def hf_config(self, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
        """config.json in the Hugging Face format (what `AutoConfig.from_pretrained` reads)."""
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": 0.02,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
        }
        if self.model_type == "qwen2":
            cfg |= {"use_sliding_window": False, "sliding_window": None}
        elif self.model_type == "gpt_oss":
            # gpt-oss-20b's layout: window-128 and full layers alternating, YaRN, q/k/v/o bias;
            # its experts are `intermediate_size` wide.
            cfg |= {
                "head_dim": self.head_dim,
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.experts_per_token,
                "intermediate_size": self.moe_intermediate_size,
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * (self.num_layers // 2),
                "attention_bias": True,
            }
        elif self.num_experts:
            cfg |= {
                "head_dim": self.head_dim,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.experts_per_token,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "attention_bias": False,
            }
        else:
            cfg |= {"attention_bias": self.qkv_bias, "mlp_bias": False}
        return cfg


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        name="tiny",
        architecture="LlamaForCausalLM",
        model_type="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
        default_num_requests=256,
    ),
    # Qwen2-0.5B's shape (494M parameters) with a shorter context: the workload needs <= 768.
    "qwen2-0.5b-shape": ModelShape(
        name="qwen2-0.5b-shape",
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        default_num_requests=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        qkv_bias=True,
    ),
}


@dataclass(frozen=True)
class WorkloadSpec:
    """A seeded synthetic workload: lengths uniform in closed ranges, token ids uniform in vocab."""

    num_requests: int
    vocab_size: int
    seed: int = 0
    min_prompt_len: int = 16
    max_prompt_len: int = 512
    min_output_len: int = 16
    max_output_len: int = 256

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError("need 1 <= min_prompt_len <= max_prompt_len")
        if not 1 <= self.min_output_len <= self.max_output_len:
            raise ValueError("need 1 <= min_output_len <= max_output_len")

    @property
    def max_total_len(self) -> int:
        return self.max_prompt_len + self.max_output_len


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt and exactly how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The same requests, in the same (arrival) order, for every system and every run of a seed."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompt_lens = rng.integers(spec.min_prompt_len, spec.max_prompt_len, size=n, endpoint=True)
    output_lens = rng.integers(spec.min_output_len, spec.max_output_len, size=n, endpoint=True)
    ids = rng.integers(0, spec.vocab_size, size=int(prompt_lens.sum()))
    # One flat draw split at the cumulative lengths: prompt i is ids[ends[i-1]:ends[i]].
    prompts = np.split(ids, np.cumsum(prompt_lens)[:-1])
    return [
        BenchRequest(prompt_token_ids=p.tolist(), output_len=int(o))
        for p, o in zip(prompts, output_lens, strict=True)
    ]


def workload_stats(requests: list[BenchRequest]) -> dict[str, float | int]:
    prompt = [len(r.prompt_token_ids) for r in requests]
    output = [r.output_len for r in requests]
    return {
        "prompt_tokens": sum(prompt),
        "output_tokens": sum(output),
        "mean_prompt_len": float(np.mean(prompt)),
        "mean_output_len": float(np.mean(output)),
    }


# -- model folders ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None


def ensure_model_folder(
    shape: ModelShape, cache_dir: Path = DEFAULT_CACHE_DIR, with_tokenizer: bool = True
) -> Path:
    """A Hugging Face model folder (config.json + tokenizer, no weights) for `shape`.

    The tokenizer is trained once and kept; config.json is rewritten every time (cheap), so a
    change to the shape here always reaches the folder. Weights are never written: both systems
    initialise them randomly (inferd's `load_format="dummy"`, transformers' `from_config`).
    `with_tokenizer=False` skips training one (transformers alone needs none); a tokenizer
    already in the folder is still used for the bos/eos ids.
    """
    folder = cache_dir / shape.name
    folder.mkdir(parents=True, exist_ok=True)
    # build_tokenizer writes tokenizer_config.json last, so its presence marks a finished build.
    if with_tokenizer and not (folder / "tokenizer_config.json").exists():
        # The models package owns the tokenizer recipe; imported here only, so the rest of this
        # module works without the engine.
        from inferd.models.tiny import build_tokenizer

        build_tokenizer(shape.vocab_size, folder)
    tok = tokenizer_info(folder)
    bos = None if tok is None else tok.bos_token_id
    eos = None if tok is None else tok.eos_token_id
    _write_json(folder / "config.json", shape.hf_config(bos, eos))
    _write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    return folder


def tokenizer_info(folder: Path) -> TokenizerInfo | None:
    """Vocabulary size and bos/eos ids of the tokenizer saved in `folder`, if there is one."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    hf = Tokenizer.from_file(str(path))
    cfg = _read_json(folder / "tokenizer_config.json")
    return TokenizerInfo(
        vocab_size=hf.get_vocab_size(with_added_tokens=True),
        bos_token_id=_token_id(hf, cfg.get("bos_token")),
        eos_token_id=_token_id(hf, cfg.get("eos_token")),
    )


def _token_id(hf: Any, token: object) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tid = hf.token_to_id(token)
    return None if tid is None else int(tid)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


# -- machine, timing, results -----------------------------------------------------------------


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Runs the block with `num_threads` intra-op threads, restoring the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
        "mkl": torch.backends.mkl.is_available(),  # type: ignore[no-untyped-call]
        # Other work on the machine skews every number here; a load above the thread count means
        # the run shared its cores.
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def command_line() -> str:
    """The exact command that ran, quoted so it can be pasted back into a shell."""
    return shlex.join([sys.executable, *sys.argv])


def default_result_path(prefix: str, model: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{prefix}_{model}_{stamp}.json"


def weight_bench_parser(doc: str | None, shape: str, dtype: str, rows: str) -> ArgumentParser:
    """The options of the scripts that time kernels over a shape's weights (gemv_rows.py,
    greedy_head.py): --shape, --dtype, --rows, --repeats, --threads, --out."""
    p = ArgumentParser(description=doc, formatter_class=RawTextHelpFormatter)
    p.add_argument("--shape", choices=["llama-32m", "qwen2-0.5b-shape"], default=shape)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=dtype)
    p.add_argument("--rows", default=rows)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    return p


def save_result(out: Path | None, prefix: str, tag: str, fields: dict[str, Any]) -> Path:
    """Writes {command, machine, **fields} to `out` (default: a stamped file under
    bench/results/ named by `prefix` and `tag`), says where, and returns the path."""
    path = out or default_result_path(prefix, tag)
    write_result(path, {"command": command_line(), "machine": machine_info(), **fields})
    print(f"wrote {path}")
    return path


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_json_default) + "\n")


def _json_default(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[call-overload]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


# -- matmul peak ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulTiming:
    """Best-of-N time of one `[m x k] @ [k x n]` product and the GFLOP/s it implies."""

    m: int
    k: int
    n: int
    best_seconds: float
    repeats: int

    @property
    def gflops(self) -> float:
        return 2.0 * self.m * self.k * self.n / self.best_seconds / 1e9

    @property
    def label(self) -> str:
        return f"[{self.m}x{self.k}]@[{self.k}x{self.n}]"


def time_matmul(
    m: int,
    k: int,
    n: int,
    min_seconds: float = 0.5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MatmulTiming:
    """Times torch.mm (on CPU under the current thread count); the best repeat is the peak."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # first call pays for allocation and kernel selection
    synchronize(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while spent < min_seconds or repeats < 3:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        dt = time.perf_counter() - t0
        best, spent, repeats = min(best, dt), spent + dt, repeats + 1
    return MatmulTiming(m=m, k=k, n=n, best_seconds=best, repeats=repeats)


def synchronize(device: str) -> None:
    """Waits for the device's queued work (CUDA runs asynchronously; the CPU needs no wait)."""
    if device == "cuda":
        torch.cuda.synchronize()


def linear_shapes(shape: ModelShape, rows: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's big linears for a batch of `rows` tokens: up, down, o-proj."""
    h, i = shape.hidden_size, shape.intermediate_size
    return [(rows, h, i), (rows, i, h), (rows, h, h)]


def measure_matmul_peak(
    shape: ModelShape, rows: int = 256, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[MatmulTiming]:
    return [
        time_matmul(m, k, n, device=device, dtype=dtype) for m, k, n in linear_shapes(shape, rows)
    ]
