"""The classic-lane peers of bench/classic_peers.py: the example repository's `minilm`
(all-MiniLM-L6-v2 embeddings) or `image` (the shapes CNN) served by LitServe, mosec, Ray Serve
and Triton (PyTriton), each the way its documentation batches.

    PEERS/bin/python bench/classic_peer_servers.py litserve --model-dir DIR --port 8200
    PEERS/bin/python bench/classic_peer_servers.py mosec|ray|pytriton --model image \
        --model-dir DIR --port P

Runs in the peers' own environment (never inferd's: none of them is a dependency of inferd), so
it imports only the standard library at the top and each framework inside its function. Every
server runs the same model code behind its framework's dynamic batching (batches of up to
`--max-batch-size`, `--max-wait-ms` at most), ONNX Runtime with `--threads` intra-op threads:
- `minilm`, `Embedder`: the ONNX file and tokenizer, a batch padded to its longest text, mean
  pool + L2. `POST /embed {"input": text}` -> `{"embedding": [...]}`;
- `image`, `ImageClassifier`: PNG/JPEG bytes decoded by Pillow, RGB, resized to 32x32
  (bilinear), x / 255, (x - 0.5) / 0.5, NCHW, softmax: inferd's `image` and `softmax` steps as
  the example's config.yaml sets them. `POST /embed {"image": base64}` -> `{"probabilities": [4]}`.
Triton answers the Open Inference Protocol's `POST /v2/models/{model}/infer`, as inferd does
(input `text` or `image`, BYTES [1, 1]; the image in the binary tensor extension).
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def onnx_session(model_dir: Path, threads: int) -> Any:
    """The version folder's model.onnx on ONNX Runtime's CPU provider, `threads` intra-op."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(
        str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"]
    )


class Embedder:
    """Texts -> L2-normalized mean-pooled embeddings [n, 384], one ONNX Runtime call a batch."""

    def __init__(self, model_dir: Path, threads: int, max_length: int = 256) -> None:
        from tokenizers import Tokenizer

        self.session = onnx_session(model_dir, threads)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()  # its tokenizer.json pads to 128; a batch pads to its longest
        self.tokenizer.enable_truncation(max_length)

    def __call__(self, texts: list[str]) -> Any:
        import numpy as np

        encoded = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encoded)
        ids = np.zeros((len(texts), width), np.int64)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, : len(e.ids)], mask[i, : len(e.ids)] = e.ids, 1
        (tokens,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})[:1]
        m = mask[..., None].astype(np.float32)
        pooled = (tokens * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
        return pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)


class ImageClassifier:
    """Encoded images -> class probabilities [n, 4], one ONNX Runtime call a batch."""

    def __init__(self, model_dir: Path, threads: int, size: int = 32) -> None:
        self.session = onnx_session(model_dir, threads)
        self.size = size

    def pixels(self, blob: bytes) -> Any:
        """One image: float32 [3, H, W], normalized as the example's `image` step does."""
        import io

        import numpy as np
        from PIL import Image

        image = Image.open(io.BytesIO(blob), formats=("JPEG", "PNG")).convert("RGB")
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        x = np.asarray(image, dtype=np.float32) * np.float32(1 / 255)
        return ((x - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)

    def __call__(self, blobs: list[bytes]) -> Any:
        import numpy as np

        batch = np.ascontiguousarray(np.stack([self.pixels(b) for b in blobs]))
        (logits,) = self.session.run(None, {"input": batch})
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True)
class Task:
    """What one model needs of a peer: its runner, the request's field, the answer's key."""

    model: str
    runner: type[Embedder] | type[ImageClassifier]
    field: str  # the JSON request's field (an image goes base64-encoded)
    key: str  # the JSON answer's, and Triton's output name
    triton_input: str

    def decode(self, request: dict[str, Any]) -> Any:
        value = request[self.field]
        return base64.b64decode(value) if self.field == "image" else str(value)


TASKS = {
    "minilm": Task("minilm", Embedder, "input", "embedding", "text"),
    "image": Task("image", ImageClassifier, "image", "probabilities", "image"),
}

# LitServe and mosec start their workers with multiprocessing's spawn, which pickles the worker
# class: it must live at module level, imported only in that peer's own run (a spawned child
# inherits CLASSIC_PEER, set by main()).
_PEER = os.environ.get("CLASSIC_PEER") or (sys.argv[1] if len(sys.argv) > 1 else "")

if _PEER == "litserve":
    import litserve as ls

    class LitModel(ls.LitAPI):  # type: ignore[misc]
        def __init__(self, task: Task, model_dir: Path, threads: int, **batching: Any) -> None:
            super().__init__(api_path="/embed", **batching)
            self.task, self.model_dir, self.threads = task, model_dir, threads

        def setup(self, device: str) -> None:
            self.model = self.task.runner(self.model_dir, self.threads)

        # Unannotated: LitServe builds its endpoint from these two signatures, and a string
        # annotation (this file's `from __future__ import annotations`) breaks it.
        def decode_request(self, request):  # type: ignore[no-untyped-def]
            return self.task.decode(request)

        def predict(self, items: list[Any]) -> Any:
            return self.model(items)

        def unbatch(self, output: Any) -> list[Any]:
            return list(output)

        def encode_response(self, output):  # type: ignore[no-untyped-def]
            return {self.task.key: output.tolist()}


if _PEER == "mosec":
    from mosec import Worker

    class MosecModel(Worker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.task = TASKS[os.environ["PEER_MODEL"]]
            model_dir, threads = Path(os.environ["PEER_MODEL_DIR"]), int(os.environ["PEER_THREADS"])
            self.model = self.task.runner(model_dir, threads)

        def forward(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = self.model([self.task.decode(d) for d in data])
            return [{self.task.key: row.tolist()} for row in out]


def litserve(args: argparse.Namespace) -> None:
    api = LitModel(
        TASKS[args.model],
        args.model_dir,
        args.threads,
        max_batch_size=args.max_batch_size,
        batch_timeout=args.max_wait_ms / 1e3,
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    # No access log (inferd and the others run without one).
    server.run(port=args.port, generate_client_file=False, log_level="warning", access_log=False)


def mosec(args: argparse.Namespace) -> None:
    from mosec import Server

    os.environ["PEER_MODEL"] = args.model
    os.environ["PEER_MODEL_DIR"], os.environ["PEER_THREADS"] = (
        str(args.model_dir),
        str(args.threads),
    )
    # mosec reads its own flags from sys.argv.
    sys.argv = [
        sys.argv[0],
        "--port",
        str(args.port),
        "--address",
        "127.0.0.1",
        "--log-level",
        "warning",
    ]
    server = Server()
    server.append_worker(
        MosecModel, num=1, max_batch_size=args.max_batch_size, max_wait_time=int(args.max_wait_ms)
    )
    server.run()


def ray(args: argparse.Namespace) -> None:
    import threading

    import ray as ray_core
    from ray import serve
    from starlette.requests import Request

    task = TASKS[args.model]

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
    class Model:
        def __init__(self) -> None:
            self.model = task.runner(args.model_dir, args.threads)

        @serve.batch(
            max_batch_size=args.max_batch_size, batch_wait_timeout_s=args.max_wait_ms / 1e3
        )
        async def batch(self, items: list[Any]) -> list[list[float]]:
            return [row.tolist() for row in self.model(items)]

        async def __call__(self, request: Request) -> dict[str, Any]:
            return {task.key: await self.batch(task.decode(await request.json()))}

    ray_core.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Model.bind(), route_prefix="/embed")  # type: ignore[attr-defined]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # type: ignore[no-untyped-call]
    ray_core.shutdown()


def pytriton(args: argparse.Namespace) -> None:
    import numpy as np
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    # Triton's Python stub loads libpython by its soname. Unless told where this interpreter's is,
    # it finds the system's (here /usr/lib's libpython3.11, an older patch release than pyenv's
    # 3.11.7) and runs this stdlib on it: multiprocessing's resource tracker then fails on
    # `RLock._recursion_count` and the model never loads.
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    task = TASKS[args.model]
    model = task.runner(args.model_dir, args.threads)

    @batch  # type: ignore[untyped-decorator]
    def infer(**inputs: Any) -> dict[str, Any]:
        items = [row[0] for row in inputs[task.triton_input]]
        if task.model == "minilm":
            items = [item.decode() for item in items]
        return {task.key: model(items).astype(np.float32)}

    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.port, grpc_port=args.port + 1,
        metrics_port=args.port + 2,
    )  # fmt: skip
    with Triton(config=config) as triton:
        triton.bind(
            model_name=task.model,
            infer_func=infer,
            inputs=[Tensor(name=task.triton_input, dtype=bytes, shape=(1,))],
            outputs=[Tensor(name=task.key, dtype=np.float32, shape=(-1,))],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.max_wait_ms * 1e3)),
            ),
        )
        triton.serve()


SERVERS = {"litserve": litserve, "mosec": mosec, "ray": ray, "pytriton": pytriton}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("server", choices=sorted(SERVERS))
    p.add_argument("--model", choices=sorted(TASKS), default="minilm")
    p.add_argument("--model-dir", type=Path, required=True, help="model.onnx (+ tokenizer.json)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=3.0)
    args = p.parse_args()
    os.environ["CLASSIC_PEER"] = args.server
    SERVERS[args.server](args)


if __name__ == "__main__":
    main()
