"""Pre/postprocess steps built from config specs: tokenize, image, audio_mfcc, softmax,
l2_normalize, mean_pool, and the errors a bad spec or bad request data gives."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import wavfile

from inferd.errors import InvalidRequestError, ModelConfigError
from inferd.models.bert import minilm_dir
from inferd.steps.audio import mel_filterbank, mfcc
from inferd.steps.base import StageName, Step
from inferd.steps.registry import build_steps

MINILM = minilm_dir()


def step(spec: dict[str, Any], stage: StageName = "preprocess", model_dir: Path = MINILM) -> Step:
    (built,) = build_steps([spec], stage=stage, model_dir=model_dir, version_dir=model_dir / "1")
    return built


def texts(*items: str | bytes, column: bool = True) -> np.ndarray:
    data = [t.encode() if isinstance(t, str) else t for t in items]
    array = np.empty(len(data), dtype=object)  # BYTES: an object array of bytes
    array[:] = data
    return array.reshape(-1, 1) if column else array


# -- tokenize ------------------------------------------------------------------------------------


def test_tokenize_pads_to_the_requests_longest_row_only() -> None:
    # MiniLM's tokenizer.json pads to a fixed 128; the step must not.
    tok = step({"type": "tokenize", "max_length": 256})
    out = tok({"text": texts("hello world", "a b c d e f"), "other": np.zeros(2)})
    assert set(out) == {"input_ids", "attention_mask", "__num_tokens__", "other"}
    assert out["input_ids"].shape == (2, 8) and out["input_ids"].dtype == np.int64
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1] * 8]
    assert out["input_ids"][0].tolist() == [101, 7592, 2088, 102, 0, 0, 0, 0]  # [CLS] .. [SEP]
    assert out["__num_tokens__"].tolist() == [4, 8]


def test_tokenize_truncates_to_max_length_keeping_sep() -> None:
    tok = step({"type": "tokenize", "max_length": 16})
    out = tok({"text": texts("word " * 100, "short", column=False)})
    assert out["input_ids"].shape == (2, 16)
    assert out["input_ids"][0, -1] == 102  # [SEP] survives truncation
    assert out["__num_tokens__"].tolist() == [16, 3]


def test_tokenize_token_type_ids_only_when_configured_and_renamed_outputs() -> None:
    plain = step({"type": "tokenize"})({"text": texts("hi")})
    assert "token_type_ids" not in plain
    renamed = step(
        {
            "type": "tokenize",
            "input": "q",
            "outputs": {"input_ids": "ids", "attention_mask": "mask", "token_type_ids": "tt"},
        }
    )({"q": texts("hi", "there you")})
    assert set(renamed) == {"ids", "mask", "tt", "__num_tokens__"}
    assert renamed["tt"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_tokenize_rejects_bad_text() -> None:
    tok = step({"type": "tokenize"})
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        tok({"text": texts(b"\xff\xfe")})
    with pytest.raises(InvalidRequestError, match="shape"):
        tok({"text": np.array([[b"a", b"b"]], dtype=object)})
    with pytest.raises(InvalidRequestError, match="needs tensor 'text'"):
        tok({"prompt": texts("a")})


# -- image ---------------------------------------------------------------------------------------


def encode(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def images(*blobs: bytes) -> np.ndarray:
    array = np.empty((len(blobs), 1), dtype=object)
    for i, b in enumerate(blobs):
        array[i, 0] = b
    return array


RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, (6, 8, 3), dtype=np.uint8)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def test_image_normalizes_and_lays_out_as_computed_by_hand() -> None:
    spec = {"type": "image", "output": "x", "size": [6, 8], "mean": MEAN, "std": STD}
    nchw = step(spec)({"image": images(encode(PIXELS), encode(PIXELS[::-1].copy()))})["x"]
    expected = (PIXELS / 255.0 - np.array(MEAN)) / np.array(STD)  # same size: no resampling
    assert nchw.shape == (2, 3, 6, 8) and nchw.dtype == np.float32
    np.testing.assert_allclose(nchw[0], expected.transpose(2, 0, 1), atol=1e-5)
    np.testing.assert_allclose(nchw[1], expected[::-1].transpose(2, 0, 1), atol=1e-5)
    nhwc = step({**spec, "layout": "NHWC"})({"image": images(encode(PIXELS))})["x"]
    np.testing.assert_allclose(nhwc[0], expected, atol=1e-5)


def test_image_resize_and_center_crop_match_pillow() -> None:
    big = RNG.integers(0, 256, (40, 30, 3), dtype=np.uint8)
    spec = {"type": "image", "size": [20, 16], "center_crop": [10, 8], "resample": "bicubic"}
    out = step(spec)({"image": images(encode(big))})["pixel_values"][0]
    resized = np.asarray(Image.fromarray(big).resize((16, 20), Image.Resampling.BICUBIC))
    expected = resized[5:15, 4:12] / 255.0
    np.testing.assert_allclose(out, expected.transpose(2, 0, 1), atol=1e-6)


def test_image_decodes_jpeg_and_grayscale() -> None:
    gray = step({"type": "image", "size": [6, 8], "color": "L"})
    out = gray({"image": images(encode(PIXELS, "JPEG"))})["pixel_values"]
    assert out.shape == (1, 1, 6, 8)
    luminance = PIXELS @ np.array([0.299, 0.587, 0.114]) / 255.0
    assert np.abs(out[0, 0] - luminance).mean() < 0.05  # JPEG is lossy


@pytest.mark.parametrize(
    "blob",
    [b"not an image", encode(PIXELS)[:60], encode(PIXELS, "GIF"), b""],
    ids=["garbage", "truncated-png", "gif", "empty"],
)
def test_bad_image_bytes_are_a_400(blob: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="image"):
        step({"type": "image", "size": [4, 4]})({"image": images(blob)})


def test_image_over_max_pixels_is_refused_before_decoding() -> None:
    with pytest.raises(InvalidRequestError, match="pixel limit"):
        step({"type": "image", "size": [4, 4], "max_pixels": 40})({"image": images(encode(PIXELS))})


# -- audio ---------------------------------------------------------------------------------------


def wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    wavfile.write(buf, rate, samples)
    return buf.getvalue()


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    noise = np.random.default_rng(1).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


def test_audio_mfcc_shapes_and_padding_within_the_request() -> None:
    mfcc_step = step({"type": "audio_mfcc"})
    short, long = tone(16000, 0.5), tone(16000, 1.0)
    pcm16 = (long * 32767).astype(np.int16)
    out = mfcc_step({"audio": images(wav(short, 16000), wav(pcm16, 16000))})["mfcc"]
    assert out.shape == (2, 13, 1 + 16000 // 160) and out.dtype == np.float32
    assert not out[0, :, 1 + 8000 // 160 :].any()  # the shorter clip is zero-padded
    # int16 PCM is scaled to [-1, 1]: the same features as the float clip it came from.
    float_out = mfcc_step({"audio": images(wav(long, 16000))})["mfcc"][0]
    np.testing.assert_allclose(out[1], float_out, atol=0.05)
    fixed = step({"type": "audio_mfcc", "frames": 20})({"audio": images(wav(long, 16000))})
    assert fixed["mfcc"].shape == (1, 13, 20)


def test_mfcc_matches_librosa() -> None:
    librosa = pytest.importorskip("librosa")
    signal = tone(16000, 0.7, hz=300.0)
    for n_fft, hop, n_mels, n_mfcc in [(512, 160, 40, 13), (2048, 512, 128, 20)]:
        ours = mfcc(signal, mel_filterbank(16000, n_fft, n_mels), n_mfcc, n_fft, hop)
        ref = librosa.feature.mfcc(
            y=signal, sr=16000, n_mfcc=n_mfcc, n_fft=n_fft, hop_length=hop, n_mels=n_mels
        )
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=1e-3 * np.abs(ref).max())


def test_audio_resamples_or_refuses_other_rates_and_mixes_stereo() -> None:
    at_8k = wav(tone(8000, 1.0), 8000)
    out = step({"type": "audio_mfcc"})({"audio": images(at_8k)})["mfcc"]
    assert out.shape == (1, 13, 101)  # resampled to 16 kHz: as many frames as a 16 kHz second
    with pytest.raises(InvalidRequestError, match="8000 Hz"):
        step({"type": "audio_mfcc", "resample": False})({"audio": images(at_8k)})
    mono = tone(16000, 0.3)
    stereo = np.stack([mono, mono], axis=1)
    mfcc_step = step({"type": "audio_mfcc"})
    np.testing.assert_allclose(
        mfcc_step({"audio": images(wav(stereo, 16000))})["mfcc"],
        mfcc_step({"audio": images(wav(mono, 16000))})["mfcc"],
        atol=1e-4,
    )


def test_bad_audio_is_a_400() -> None:
    mfcc_step = step({"type": "audio_mfcc", "max_seconds": 0.5})
    with pytest.raises(InvalidRequestError, match="WAV"):
        mfcc_step({"audio": images(b"RIFF....WAVEfmt garbage")})
    with pytest.raises(InvalidRequestError, match="limit"):
        mfcc_step({"audio": images(wav(tone(16000, 1.0), 16000))})


# -- softmax, l2_normalize, mean_pool ------------------------------------------------------------


def post(spec: dict[str, Any]) -> Step:
    return step(spec, stage="postprocess")


def test_softmax_is_stable_and_matches_the_formula() -> None:
    logits = np.array([[1.0, 2.0, 3.0], [1000.0, 1001.0, 1002.0]], dtype=np.float32)
    out = post({"type": "softmax"})({"logits": logits, "keep": np.ones(1)})
    assert set(out) == {"probabilities", "keep"}
    expected = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(out["probabilities"], [expected, expected], rtol=1e-6)
    across = post({"type": "softmax", "axis": 0, "output": "p"})({"logits": logits})["p"]
    np.testing.assert_allclose(across.sum(axis=0), 1.0, rtol=1e-6)


def test_l2_normalize_matches_torch() -> None:
    x = np.random.default_rng(2).normal(size=(4, 7)).astype(np.float32)
    x[1] = 0.0  # a zero vector stays zero (eps), no NaN
    out = post({"type": "l2_normalize"})({"embedding": x})["embedding"]
    ref = torch.nn.functional.normalize(torch.from_numpy(x), p=2, dim=-1).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-7)


def st_mean_pool(emb: torch.Tensor, mask: torch.Tensor, normalize: bool) -> torch.Tensor:
    # sentence-transformers' Pooling(mean) + Normalize arithmetic.
    expanded = mask.unsqueeze(-1).expand(emb.size()).to(emb.dtype)
    pooled = torch.sum(emb * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled


@pytest.mark.parametrize("normalize", [False, True])
def test_mean_pool_matches_sentence_transformers(normalize: bool) -> None:
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(3, 6, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]], dtype=np.int64)
    spec = {"type": "mean_pool", "normalize": normalize}
    out = post(spec)({"token_embeddings": emb, "attention_mask": mask})
    ref = st_mean_pool(torch.from_numpy(emb), torch.from_numpy(mask), normalize).numpy()
    np.testing.assert_allclose(out["embedding"], ref, atol=1e-6)
    assert "token_embeddings" not in out
    # The batch may be padded past this request's own mask: the extra positions count as 0.
    own = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=np.int64)
    padded = np.pad(own, ((0, 0), (0, 3)))
    short = post(spec)({"token_embeddings": emb, "attention_mask": own})
    ref = st_mean_pool(torch.from_numpy(emb), torch.from_numpy(padded), normalize).numpy()
    np.testing.assert_allclose(short["embedding"], ref, atol=1e-6)


# -- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "stage", "message"),
    [
        ({"type": "image"}, "preprocess", r"preprocess\[0\]\.size: Field required"),
        ({"type": "image", "size": [4]}, "preprocess", r"preprocess\[0\]\.size"),
        ({"type": "image", "size": [4, 4], "mean": [0.5]}, "preprocess", r"mean: needs 3"),
        ({"type": "image", "size": [4, 4], "layout": "CHW"}, "preprocess", r"\.layout"),
        ({"type": "tokenize", "max_len": 5}, "preprocess", r"preprocess\[0\]\.max_len: Extra"),
        ({"type": "tokenize", "tokenizer": "nope.json"}, "preprocess", r"\.tokenizer: no file"),
        ({"type": "tokenize", "outputs": ["ids"]}, "preprocess", r"\.outputs: .*unknown roles"),
        ({"type": "resize"}, "preprocess", r"preprocess\[0\]\.type: 'resize' is not"),
        ({"size": [4, 4]}, "preprocess", r"preprocess\[0\]\.type: None"),
        ({"type": "softmax"}, "preprocess", r"'softmax' is a postprocess step"),
        ({"type": "tokenize"}, "postprocess", r"'tokenize' is a preprocess step"),
        ({"type": "nms", "iou_threshold": 2}, "postprocess", r"postprocess\[0\]\.iou_threshold"),
        ({"type": "audio_mfcc", "n_mfcc": 50}, "preprocess", r"n_mfcc \(50\) must be <= n_mels"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], stage: StageName, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        step(spec, stage=stage)


def test_step_index_and_stage_in_built_steps(tmp_path: Path) -> None:
    specs = [{"type": "softmax"}, {"type": "mean_pool", "normalize": "yes please"}]
    with pytest.raises(ModelConfigError, match=r"postprocess\[1\]\.normalize"):
        build_steps(specs, stage="postprocess", model_dir=tmp_path, version_dir=tmp_path / "1")
    built = build_steps(specs[:1], stage="postprocess", model_dir=tmp_path, version_dir=tmp_path)
    assert built[0].stage == "postprocess"


def test_files_resolve_in_the_version_folder_first(tmp_path: Path) -> None:
    version = tmp_path / "1"
    version.mkdir()
    (tmp_path / "tok.json").write_bytes((MINILM / "tokenizer.json").read_bytes())
    from_model_dir = step({"type": "tokenize", "tokenizer": "tok.json"}, model_dir=tmp_path)
    assert from_model_dir({"text": texts("hi")})["input_ids"].shape == (1, 3)
    (version / "tok.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelConfigError, match=r"preprocess\[0\]\.tokenizer: cannot load .*1/"):
        step({"type": "tokenize", "tokenizer": "tok.json"}, model_dir=tmp_path)
