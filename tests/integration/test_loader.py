"""Model folder resolution, config parsing, weight loading errors, dummy weights, inferd-tiny."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferd.config import Environment
from inferd.errors import ModelLoadError
from inferd.models.attention.sdpa import PrefillSpan, SdpaMetadata
from inferd.models.config import ArchConfig
from inferd.models.loader import DUMMY_RANGE, load_model, resolve_model_path
from inferd.models.registry import SUPPORTED_ARCHITECTURES
from inferd.models.tiny import TINY_FOLDER, ensure_tiny_model, random_checkpoint

CPU = torch.device("cpu")

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _folder(root: Path, config: dict[str, Any] | None = None, weights: bool = True) -> Path:
    cfg = CONFIG if config is None else config
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    if weights:
        save_file(random_checkpoint(cfg, seed=0), str(root / "model.safetensors"))
    return root


def _rewrite(folder: Path, edit: Any) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _load(folder: Path, fmt: Any = "auto", seed: int = 0) -> Any:
    return load_model(folder, torch.float32, CPU, fmt, seed)


def _env(tmp_path: Path, offline: bool = True) -> Environment:
    return Environment(cache_dir=tmp_path / "cache", hf_offline=offline)


def _forward(model: Any, n: int = 6) -> torch.Tensor:
    meta = SdpaMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n, n)])
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(n), torch.arange(n), meta))


# -- errors --------------------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config not found: .*config\.json"):
        _load(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {**CONFIG, "architectures": ["GPT2LMHeadModel"]}, weights=False)
    with pytest.raises(ModelLoadError) as err:
        _load(folder)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("hidden_size", None, "is missing"),
        ("hidden_size", "big", "must be an integer"),
        ("num_key_value_heads", 3, "must divide"),
        ("rms_norm_eps", -1, "positive number"),
        ("hidden_act", "gelu", "must be one of"),
        ("rope_scaling", {"rope_type": "mrope", "factor": 4.0}, "unsupported|supported"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "original_max_position"),
        ("rope_scaling", {"rope_type": "linear"}, "'factor'"),
    ],
)
def test_bad_config_field_names_field_and_file(
    tmp_path: Path, field: str, value: Any, problem: str
) -> None:
    folder = _folder(tmp_path, {**CONFIG, field: value}, weights=False)
    with pytest.raises(ModelLoadError, match=problem) as err:
        _load(folder)
    assert repr(field) in str(err.value)
    assert str(folder / "config.json") in str(err.value)


def test_missing_tensor(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.self_attn\.v_proj"):
        _load(folder)


def test_unexpected_tensor(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor .*mystery"):
        _load(folder)


def test_shape_mismatch_says_expected_and_found(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(63, 32)}))
    with pytest.raises(ModelLoadError) as err:
        _load(folder)
    msg = str(err.value)
    assert "model.safetensors" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "[63, 32]" in msg and "expected [64, 32]" in msg


def test_index_lists_missing_shard(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file(
        {n: tensors[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors")
    )
    weight_map = {
        n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"lists model-00002-of-00002\.safetensors.*missing"):
        _load(folder)


def test_no_weights_at_all(tmp_path: Path) -> None:
    folder = _folder(tmp_path, weights=False)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        _load(folder)


def test_corrupt_safetensors_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path, weights=False)
    (folder / "model.safetensors").write_bytes(b"\x00\x01 definitely not safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read"):
        _load(folder)


# -- successful loads ----------------------------------------------------------------------------


def test_loaded_weights_are_the_checkpoint(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    ckpt = load_file(str(folder / "model.safetensors"))
    model, _ = _load(folder)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])


def test_tied_checkpoint_with_redundant_lm_head_is_accepted(tmp_path: Path) -> None:
    config = {**CONFIG, "tie_word_embeddings": True}
    folder = _folder(tmp_path, config)
    _rewrite(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model, arch = _load(folder)
    assert arch.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_logs_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _folder(tmp_path)
    with caplog.at_level(logging.INFO, logger="inferd.models"):
        model, _ = _load(folder)
    n = sum(p.numel() for p in model.parameters())
    (record,) = [r for r in caplog.records if r.name == "inferd.models"]
    assert "LlamaForCausalLM" in record.message and "float32" in record.message
    assert f"{n / 1e6:.1f}M parameters" in record.message


def test_dummy_weights_from_config_only(tmp_path: Path) -> None:
    folder = _folder(tmp_path, weights=False)
    model, arch = _load(folder, "dummy", seed=3)
    for p in model.parameters():
        assert p.abs().max() <= DUMMY_RANGE
        assert p.std() > DUMMY_RANGE / 4  # filled, not left at zero
    again, _ = _load(folder, "dummy", seed=3)
    other, _ = _load(folder, "dummy", seed=4)
    pairs = list(zip(model.parameters(), again.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    logits = _forward(model)
    assert logits.shape == (6, arch.vocab_size) and torch.isfinite(logits).all()


# -- config parsing ------------------------------------------------------------------------------


def test_config_layouts_before_and_after_transformers_5_agree() -> None:
    v4 = {**CONFIG, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = {k: v for k, v in CONFIG.items() if k not in ("rope_theta", "torch_dtype")}
    v5 |= {
        "dtype": "float32",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    }
    a, b = ArchConfig.from_dict(v4), ArchConfig.from_dict(v5)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert a.torch_dtype == "float32"
    assert a.max_context_len == 2 * CONFIG["max_position_embeddings"]


def test_family_flags() -> None:
    bare = {k: v for k, v in CONFIG.items() if k != "architectures"}
    qwen2 = ArchConfig.from_dict(
        {**bare, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    )
    assert qwen2.architecture == "Qwen2ForCausalLM"
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert qwen2.sliding_window is None
    qwen3 = ArchConfig.from_dict({**bare, "model_type": "qwen3", "head_dim": 16})
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 16)
    mistral = ArchConfig.from_dict({**bare, "model_type": "mistral", "sliding_window": 32})
    # A sliding window limits what each layer attends to, not the context (issue 43).
    assert (
        mistral.sliding_window == 32
        and mistral.max_context_len == CONFIG["max_position_embeddings"]
    )
    assert mistral.layer_windows == (32,) * CONFIG["num_hidden_layers"]
    llama = ArchConfig.from_dict({**CONFIG, "attention_bias": True, "eos_token_id": [5, 7]})
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)
    assert llama.eos_token_ids == frozenset({5, 7})
    assert llama.head_dim == CONFIG["hidden_size"] // CONFIG["num_attention_heads"]


# -- resolution and inferd-tiny ------------------------------------------------------------------


def test_resolve_local_folder_as_is(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", weights=False)
    assert resolve_model_path(str(folder), None, _env(tmp_path)) == folder


def test_resolve_missing_local_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a folder"):
        resolve_model_path(str(tmp_path / "nope"), None, _env(tmp_path))


def test_resolve_unknown_repo_offline_says_what_was_tried(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path("inferd-test/does-not-exist", "v9", _env(tmp_path, offline=True))
    msg = str(err.value)
    assert "inferd-test/does-not-exist" in msg and "v9" in msg
    assert "not a local folder" in msg and "HF_HUB_OFFLINE" in msg


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_inferd_tiny_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = resolve_model_path("inferd-tiny", None, _env(tmp_path / "a"))
    b = ensure_tiny_model(tmp_path / "b" / "cache")
    assert a == tmp_path / "a" / "cache" / "models" / TINY_FOLDER
    assert _tree(a) == _tree(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_tree(a))
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "a" / "cache") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in a.parent.iterdir()] == [TINY_FOLDER]  # no temp folders left
    model, arch = _load(a)
    assert arch.architecture == "LlamaForCausalLM" and arch.vocab_size == 4096
    assert torch.isfinite(_forward(model)).all()


def test_inferd_tiny_concurrent_first_use(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(cache))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [cache / "models" / TINY_FOLDER] * 2
    assert [p.name for p in (cache / "models").iterdir()] == [TINY_FOLDER]
    ArchConfig.from_json(results[0] / "config.json")
