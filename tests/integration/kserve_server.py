"""A tiny model repository and a real uvicorn serving it on a loopback port, in a thread.

Models (all built here in milliseconds):
- `classifier` (ONNX Runtime): x FP32 [n, 4] -> probs FP32 [n, 3] = softmax(x @ W), with labels
- `echo` (python backend): text BYTES [n, 1] -> upper BYTES [n, 1], length INT32 [n, 1]
- `embedder` (python backend, `embedding:` section): text BYTES [n, 1] -> embedding FP32 [n, 8],
  the L2-normalized byte histogram (byte % 8) of the text; its preprocess counts whitespace
  words as tokens (`__num_tokens__`), so /v1/embeddings can report usage.
- `slow` (python backend): x FP32 [n, 1] -> y = 2x after SLOW_S seconds; its queue holds one
  request, so concurrent requests find it full (429) or time out in it (503).

Used by test_kserve_http.py and test_embeddings_api.py; `serve` also runs an LLM on a real
engine core (test_security.py, test_router_replicas.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import uvicorn
from onnx import TensorProto, helper, numpy_helper

from inferd.config import AdmissionConfig, EngineConfig, ServerConfig
from inferd.engine.async_client import AsyncLLM
from inferd.gateway import create_app, gateway_state
from inferd.gateway.connection import listening_port
from inferd.gateway.state import GatewayState
from inferd.repository.manager import ModelRepository
from inferd.serve import uvicorn_options

LABELS = ["cat", "dog", "bird"]
WEIGHTS = np.array(
    [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0], [-1.0, 0.5, 1.5], [0.0, -0.5, 0.25]], dtype=np.float32
)
EMBED_DIM = 8
SLOW_S = 0.3


def softmax_reference(x: np.ndarray) -> np.ndarray:
    logits = x.astype(np.float64) @ WEIGHTS.astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def embed_reference(text: str) -> np.ndarray:
    v = np.zeros(EMBED_DIM, dtype=np.float64)
    for b in text.encode():
        v[b % EMBED_DIM] += 1.0
    v[0] += 1.0  # never the zero vector
    return v / np.linalg.norm(v)


def _classifier(root: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    probs = helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 3])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        ],
        "classifier",
        [x],
        [probs],
        [numpy_helper.from_array(WEIGHTS, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (root / "classifier" / "1").mkdir(parents=True)
    onnx.save(model, str(root / "classifier" / "1" / "model.onnx"))
    (root / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (root / "classifier" / "config.yaml").write_text(
        textwrap.dedent(
            """\
            backend: onnxruntime
            max_batch_size: 8
            output:
              - {name: probs, data_type: TYPE_FP32, dims: [3], label_filename: labels.txt}
            dynamic_batching: {max_queue_delay_ms: 1}
            """
        )
    )


_ECHO = """\
import numpy as np


class Model:
    def predict(self, inputs):
        text = inputs["text"]
        upper = np.empty(text.shape, dtype=object)
        length = np.zeros(text.shape, dtype=np.int32)
        for idx, value in np.ndenumerate(text):
            upper[idx] = value.upper()
            length[idx] = len(value)
        return {"upper": upper, "length": length}
"""

_EMBEDDER = f"""\
import numpy as np

DIM = {EMBED_DIM}


class Model:
    def preprocess(self, inputs):
        words = [len(t.split()) for t in inputs["text"].reshape(-1)]
        return {{**inputs, "__num_tokens__": np.array(words, dtype=np.int64)}}

    def predict(self, inputs):
        rows = inputs["text"].reshape(-1)
        out = np.zeros((len(rows), DIM), dtype=np.float32)
        for i, text in enumerate(rows):
            for b in text:
                out[i, b % DIM] += 1.0
            out[i, 0] += 1.0
        return {{"embedding": out / np.linalg.norm(out, axis=1, keepdims=True)}}
"""


_SLOW = f"""\
import time


class Model:
    def predict(self, inputs):
        time.sleep({SLOW_S})
        return {{"y": inputs["x"] * 2}}
"""


def _python_model(root: Path, name: str, source: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.yaml").write_text(textwrap.dedent(config))


def write_repository(root: Path) -> Path:
    _classifier(root)
    _python_model(
        root,
        "echo",
        _ECHO,
        """\
        backend: python
        max_batch_size: 8
        input: [{name: text, data_type: TYPE_STRING, dims: [1]}]
        output:
          - {name: upper, data_type: TYPE_STRING, dims: [1]}
          - {name: length, data_type: TYPE_INT32, dims: [1]}
        """,
    )
    _python_model(
        root,
        "embedder",
        _EMBEDDER,
        f"""\
        backend: python
        max_batch_size: 4
        input: [{{name: text, data_type: TYPE_STRING, dims: [1]}}]
        output: [{{name: embedding, data_type: TYPE_FP32, dims: [{EMBED_DIM}]}}]
        embedding: {{dimensions: [4]}}
        dynamic_batching: {{max_queue_delay_ms: 1}}
        """,
    )
    _python_model(
        root,
        "slow",
        _SLOW,
        """\
        backend: python
        max_batch_size: 1
        input: [{name: x, data_type: TYPE_FP32, dims: [1]}]
        output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
        dynamic_batching: {default_queue_policy: {max_queue_size: 1}}
        """,
    )
    return root


@dataclass
class LiveServer:
    port: int
    state: GatewayState
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Runs a coroutine on the server's event loop (repository calls must)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@contextlib.contextmanager
def serve(
    root: Path | None, *, engine: EngineConfig | None = None, **server: Any
) -> Iterator[LiveServer]:
    """The app on a port the OS picks, with `root` as its model repository (None: none) and an
    LLM on a real engine core when `engine` is given."""
    config = ServerConfig(access_log=False, **server)
    app = create_app(None, config)
    state = gateway_state(app)
    state.serves_llm = engine is not None
    # The server's own uvicorn options (TLS, timeouts, connection bounds) on port 0.
    options = {**uvicorn_options(config), "host": "127.0.0.1", "port": 0}
    del options["log_config"]
    uv = uvicorn.Server(uvicorn.Config(app, **options, log_level="warning", lifespan="off"))
    loops: list[asyncio.AbstractEventLoop] = []
    failures: list[BaseException] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        if root is not None:
            state.repository = ModelRepository(root, observer=state.model_metrics)
            await state.repository.start()
        llm = None if engine is None else await AsyncLLM.start(engine, AdmissionConfig())
        state.llm = llm
        try:
            await uv.serve()
        finally:
            if state.repository is not None:
                await state.repository.shutdown(5.0)
            if llm is not None:
                await llm.shutdown()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced by the wait below
            failures.append(e)

    thread = threading.Thread(target=run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # an engine core loads its model first
    while not uv.started:
        if failures or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {failures}")
        time.sleep(0.02)
    try:
        yield LiveServer(listening_port(uv, 0), state, loops[0])
    finally:
        uv.should_exit = True
        thread.join(30)
