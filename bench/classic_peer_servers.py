"""The classic-lane peers of bench/classic_peers.py: all-MiniLM-L6-v2 embeddings served by
LitServe, mosec, Ray Serve and Triton (PyTriton), each the way its documentation batches.

    PEERS/bin/python bench/classic_peer_servers.py litserve --model-dir DIR --port 8200
    PEERS/bin/python bench/classic_peer_servers.py mosec|ray|pytriton --model-dir DIR --port P

Runs in the peers' own environment (never inferd's: none of them is a dependency of inferd), so
it imports only the standard library at the top and each framework inside its function. Every
server runs the same `Embedder` (the example repository's ONNX file and tokenizer, ONNX Runtime
with `--threads` intra-op threads, a batch padded to its longest text, mean pool + L2) behind its
framework's dynamic batching: batches of up to `--max-batch-size`, `--max-wait-ms` at most.
LitServe, mosec and Ray Serve answer `POST /embed {"input": text}` with `{"embedding": [...]}`;
Triton answers the Open Inference Protocol's `POST /v2/models/minilm/infer`, as inferd does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
from pathlib import Path
from typing import Any


class Embedder:
    """Texts -> L2-normalized mean-pooled embeddings [n, 384], one ONNX Runtime call a batch."""

    def __init__(self, model_dir: Path, threads: int, max_length: int = 256) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"]
        )
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


# LitServe and mosec start their workers with multiprocessing's spawn, which pickles the worker
# class: it must live at module level, imported only in that peer's own run (a spawned child
# inherits CLASSIC_PEER, set by main()).
_PEER = os.environ.get("CLASSIC_PEER") or (sys.argv[1] if len(sys.argv) > 1 else "")

if _PEER == "litserve":
    import litserve as ls

    class LitEmbed(ls.LitAPI):  # type: ignore[misc]
        def __init__(self, model_dir: Path, threads: int, **batching: Any) -> None:
            super().__init__(api_path="/embed", **batching)
            self.model_dir, self.threads = model_dir, threads

        def setup(self, device: str) -> None:
            self.embed = Embedder(self.model_dir, self.threads)

        # Unannotated: LitServe builds its endpoint from these two signatures, and a string
        # annotation (this file's `from __future__ import annotations`) breaks it.
        def decode_request(self, request):  # type: ignore[no-untyped-def]
            return str(request["input"])

        def predict(self, texts: list[str]) -> Any:
            return self.embed(texts)

        def unbatch(self, output: Any) -> list[Any]:
            return list(output)

        def encode_response(self, output):  # type: ignore[no-untyped-def]
            return {"embedding": output.tolist()}


if _PEER == "mosec":
    from mosec import Worker

    class MosecEmbed(Worker):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed = Embedder(
                Path(os.environ["PEER_MODEL_DIR"]), int(os.environ["PEER_THREADS"])
            )

        def forward(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = self.embed([str(d["input"]) for d in data])
            return [{"embedding": row.tolist()} for row in out]


def litserve(args: argparse.Namespace) -> None:
    api = LitEmbed(
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
        MosecEmbed, num=1, max_batch_size=args.max_batch_size, max_wait_time=int(args.max_wait_ms)
    )
    server.run()


def ray(args: argparse.Namespace) -> None:
    import threading

    import ray as ray_core
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
    class Embed:
        def __init__(self) -> None:
            self.embed = Embedder(args.model_dir, args.threads)

        @serve.batch(
            max_batch_size=args.max_batch_size, batch_wait_timeout_s=args.max_wait_ms / 1e3
        )
        async def batch(self, texts: list[str]) -> list[list[float]]:
            return [row.tolist() for row in self.embed(texts)]

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            return {"embedding": await self.batch(str(body["input"]))}

    ray_core.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Embed.bind(), route_prefix="/embed")  # type: ignore[attr-defined]
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
    embed = Embedder(args.model_dir, args.threads)

    @batch  # type: ignore[untyped-decorator]
    def infer(text: Any) -> dict[str, Any]:
        return {"embedding": embed([t[0].decode() for t in text]).astype(np.float32)}

    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.port, grpc_port=args.port + 1,
        metrics_port=args.port + 2,
    )  # fmt: skip
    with Triton(config=config) as triton:
        triton.bind(
            model_name="minilm",
            infer_func=infer,
            inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
            outputs=[Tensor(name="embedding", dtype=np.float32, shape=(-1,))],
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
    p.add_argument("--model-dir", type=Path, required=True, help="model.onnx + tokenizer.json")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=3.0)
    args = p.parse_args()
    os.environ["CLASSIC_PEER"] = args.server
    SERVERS[args.server](args)


if __name__ == "__main__":
    main()
