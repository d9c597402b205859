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
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import Any

import httpx
from common import DEFAULT_CACHE_DIR, save_result
from peers import SHAPES, single_workload, weights_folder
from safetensors import safe_open
from serve import completion_body, launched_server, proc_table

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


def measure(folder: Path, name: str, extra: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [str(folder), "--served-model-name", "m", "--num-threads", str(args.threads)]
    argv += ["--kv-cache-memory", args.kv_cache, *shlex.split(extra)]
    log = Path("bench/results") / f"memory-{name}.log"
    with launched_server(argv, log) as server:
        started = tree_rss_bytes(server.pid)
        four_requests(server.url, args.shape)
        after = tree_rss_bytes(server.pid)
    split = shlex.split(extra)
    dtype = split[split.index("--dtype") + 1] if "--dtype" in split else "float32"
    served = served_bytes(folder, dtype, "int8" in split)
    kv = _parse_bytes(args.kv_cache)
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


def _parse_bytes(text: str) -> int:
    units = {"GiB": GIB, "MiB": 2**20, "KiB": 2**10}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b-shape")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="name=serve args")
    p.add_argument("--kv-cache", default="256MiB", help="the KV budget (--kv-cache-memory)")
    p.add_argument("--threads", type=int, default=2)
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
    save_result(args.out, "memory", args.shape, {"rows": rows})


if __name__ == "__main__":
    main()
