"""Resident memory of the whole server after start-up and four requests, against its bound.

    .venv/bin/python bench/memory.py --shape qwen2-0.5b-shape
    .venv/bin/python bench/memory.py --variants "bfloat16=--dtype bfloat16" --kv-cache 256MiB

Per variant (default: float32, bfloat16, int8 over float32 activations): `inferd serve` on the
random float32 checkpoint of bench/peers.py, `--kv-cache-memory --kv-cache` (the KV budget),
four streaming completions (32-token prompts, 32 tokens each, two at once), then the resident set
(VmRSS from /proc) of the server and every process under it. The bound:

    1.25 x the checkpoint's bytes at the served precision + the KV budget + 0.6 GiB

where the served precision counts every parameter at the dtype's size, but, under int8, the
linear layers' weights at a byte each (the embeddings stay in the model dtype). Prints a table,
writes JSON to bench/results/.

With `--llama-server` (and `--gguf-python --llama-src` to convert, as bench/peers.py takes them),
llama.cpp's server is measured the same way for each of `--gguf-types` (default f32, bf16, q8_0):
one slot, its context sized so its float16 K/V take the same budget, the weights mapped from the
GGUF file (llama.cpp's default; the resident set counts the pages it touched).
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import Any

import httpx
from common import DEFAULT_CACHE_DIR, save_result
from peers import SHAPES, System, gguf_file, launched, single_workload, weights_folder
from safetensors import safe_open
from serve import completion_body, launched_server, proc_table

from inferd.engine_args import parse_bytes

GIB = 2**30
VARIANTS = (
    "float32=--dtype float32",
    "bfloat16=--dtype bfloat16",
    "int8=--dtype float32 --quantization int8",
)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def served_bytes(folder: Path, dtype: str, int8: bool) -> int:
    """The checkpoint's bytes at the served precision (the module docstring's rule): every
    tensor of its safetensors files at the dtype's size, under int8 the linear layers' weights
    (2-d `*_proj.weight`) at a byte each."""
    size = _DTYPE_BYTES[dtype]
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(name).get_shape()
                numel = math.prod(shape)
                linear = int8 and len(shape) == 2 and name.endswith("proj.weight")
                total += numel * (1 if linear else size)
    return total


def tree_rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and every process under it."""
    table = proc_table()
    tree, grew = {pid}, True
    while grew:
        more = {p for p, (ppid, _) in table.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def four_requests(url: str, shape_name: str) -> None:
    reqs = single_workload(SHAPES[shape_name], 32, 0)[:1] * 4
    for i in range(0, 4, 2):
        with httpx.Client(timeout=600) as client:
            for req in reqs[i : i + 2]:
                body = completion_body(req, "m", 0.0) | {"max_tokens": 32, "stream": False}
                body.pop("stream_options")
                client.post(f"{url}/v1/completions", json=body).raise_for_status()


def rss_around_requests(pid: int, url: str, shape_name: str) -> tuple[int, int]:
    """A server's resident set after start-up, then after four requests."""
    started = tree_rss_bytes(pid)
    four_requests(url, shape_name)
    return started, tree_rss_bytes(pid)


def measure(folder: Path, name: str, extra: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [str(folder), "--served-model-name", "m", "--num-threads", str(args.threads)]
    argv += ["--kv-cache-memory", args.kv_cache, *shlex.split(extra)]
    log = Path("bench/results") / f"memory-{name}.log"
    with launched_server(argv, log) as server:
        started, after = rss_around_requests(server.pid, server.url, args.shape)
    split = shlex.split(extra)
    dtype = split[split.index("--dtype") + 1] if "--dtype" in split else "float32"
    served = served_bytes(folder, dtype, "int8" in split)
    kv = parse_bytes(args.kv_cache)
    bound = 1.25 * served + kv + 0.6 * GIB
    return {
        "variant": name,
        "args": extra,
        "served_bytes": served,
        "kv_bytes": kv,
        "rss_started": started,
        "rss_after": after,
        "bound": bound,
        "ratio": after / bound,
        "log": [line for line in log.read_text().splitlines() if "linear layers" in line],
    }


def measure_llama(folder: Path, outtype: str, args: argparse.Namespace) -> dict[str, Any] | None:
    gguf = gguf_file(folder, outtype, args)
    if gguf is None:
        print(f"llama.cpp {outtype}: skipped (no GGUF and no --gguf-python/--llama-src)")
        return None
    cfg = SHAPES[args.shape]
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, float16
    ctx = parse_bytes(args.kv_cache) // kv_per_token
    argv = [str(args.llama_server), "-m", str(gguf), "-np", "1", "-c", str(ctx)]
    argv += ["-t", str(args.threads)]
    log = Path("bench/results") / f"memory-llama-{outtype}.log"
    with launched(System(f"llama.cpp-{outtype}", argv, "/health"), log) as server:
        started, after = rss_around_requests(server.pid, server.url, args.shape)
    return {
        "variant": f"llama.cpp-{outtype}",
        "args": shlex.join(argv[1:]),
        "gguf_bytes": gguf.stat().st_size,
        "kv_bytes": ctx * kv_per_token,
        "rss_started": started,
        "rss_after": after,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b-shape")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="name=serve args")
    p.add_argument("--kv-cache", default="256MiB", help="the KV budget (--kv-cache-memory)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", type=Path, default=None)
    p.add_argument("--gguf-python", type=Path, default=None)
    p.add_argument("--llama-src", type=Path, default=None)
    p.add_argument("--gguf-types", nargs="+", default=["f32", "bf16", "q8_0"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    folder = weights_folder(SHAPES[args.shape], DEFAULT_CACHE_DIR)
    rows = []
    for variant in args.variants:
        name, _, extra = variant.partition("=")
        rows.append(measure(folder, name, extra, args))
        r = rows[-1]
        print(
            f"{name:10s} RSS after start {r['rss_started'] / GIB:5.2f} GiB, after four requests"
            f" {r['rss_after'] / GIB:5.2f} GiB; bound {r['bound'] / GIB:5.2f} GiB"
            f" (served weights {r['served_bytes'] / GIB:.2f} GiB): {r['ratio']:.2f}x",
            flush=True,
        )
        for line in r["log"]:
            print("    " + line.split("] ", 1)[-1])
    for outtype in args.gguf_types if args.llama_server else []:
        row = measure_llama(folder, outtype, args)
        if row is not None:
            rows.append(row)
            print(
                f"llama.cpp {outtype:5s} RSS after start {row['rss_started'] / GIB:5.2f} GiB,"
                f" after four requests {row['rss_after'] / GIB:5.2f} GiB"
                f" (GGUF {row['gguf_bytes'] / GIB:.2f} GiB, K/V {row['kv_bytes'] / GIB:.2f} GiB)",
                flush=True,
            )
    save_result(args.out, "memory", args.shape, {"rows": rows})


if __name__ == "__main__":
    main()
