"""The "simple API" baseline: one FastAPI endpoint that runs ONNX Runtime per request.

    .venv/bin/python bench/plain_embed_server.py --model-dir DIR --port 8100

What a team writes on day one, with no batching: tokenize the text with the model's Hugging Face
tokenizer, run the ONNX session, mean-pool and L2-normalize, return JSON. A sync `def` endpoint,
so FastAPI runs each request on its thread pool, and ONNX Runtime's session is shared (it is safe
to call from several threads). Same model file, tokenizer and thread count as inferd's `minilm`.
bench/batching.py launches it; nothing in inferd imports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer


class EmbedRequest(BaseModel):
    input: str


def create_app(model_dir: Path, threads: int, max_length: int) -> FastAPI:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"]
    )
    names = {i.name for i in session.get_inputs()}
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # MiniLM's tokenizer.json pads every text to 128 tokens; inferd does not pad a lone text,
    # so neither does the baseline (same compute per request on both sides).
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    app = FastAPI()

    @app.post("/embed")
    def embed(req: EmbedRequest) -> dict[str, object]:
        enc = tokenizer.encode(req.input)
        ids = np.array([enc.ids], dtype=np.int64)
        mask = np.array([enc.attention_mask], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (tokens,) = session.run(None, feeds)[:1]
        m = mask[..., None].astype(np.float32)
        pooled = (tokens * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return {"embedding": pooled[0].tolist()}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", type=Path, required=True, help="holds model.onnx, tokenizer.json")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-length", type=int, default=256)
    args = p.parse_args()
    app = create_app(args.model_dir, args.threads, args.max_length)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
