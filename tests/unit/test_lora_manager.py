"""LoRA adapters' bookkeeping (inferd/lora/manager.py) and PEFT folder checks (adapter.py), on
two tiny linear layers and hand-written PEFT folders: host-memory LRU with pinning, unregistering
while in use, a failed load and its retry, slots reused least recently used first, and every
refusal's reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferd.config import LoRAConfig
from inferd.errors import InvalidRequestError
from inferd.lora.layer import LoRABatch
from inferd.lora.manager import LoRAManager
from inferd.lora.request import LoRARequest
from inferd.models.linear import Linear

pytestmark = pytest.mark.unit

PREFIX = "base_model.model.model.layers.0"
QKV = [("q_proj", 8), ("k_proj", 4), ("v_proj", 4)]


def _linears() -> list[tuple[str, Linear]]:
    return [
        ("model.layers.0.self_attn.qkv_proj", Linear(8, QKV, False, torch.float32)),
        ("model.layers.0.self_attn.o_proj", Linear(8, [("o_proj", 8)], False, torch.float32)),
    ]


def _manager(**config: object) -> tuple[LoRAManager, list[tuple[str, Linear]]]:
    linears = _linears()

    def attach(batch: LoRABatch) -> list[tuple[str, Linear]]:
        return linears

    cfg = LoRAConfig(enable_lora=True, **config)  # type: ignore[arg-type]
    return LoRAManager(cfg, attach, torch.float32, torch.device("cpu")), linears


def _write(
    folder: Path,
    targets: dict[str, tuple[int, int]],
    rank: int = 2,
    tensors: dict[str, torch.Tensor] | None = None,
    config: dict[str, object] | None = None,
) -> Path:
    """A PEFT folder with `targets` {module: (in, out)} of `rank`, or the given tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {}
        for module, (n_in, n_out) in targets.items():
            block = "self_attn"
            tensors[f"{PREFIX}.{block}.{module}.lora_A.weight"] = torch.randn(rank, n_in)
            tensors[f"{PREFIX}.{block}.{module}.lora_B.weight"] = torch.randn(n_out, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def _request(name: str, folder: Path, i: int = 1) -> LoRARequest:
    return LoRARequest(name, i, str(folder))


def _load(m: LoRAManager, name: str, in_use: tuple[str, ...] = ()) -> None:
    m.load(name).result()
    m.take_loaded(in_use)


def test_packs_shards_with_scaling_and_spans(tmp_path: Path) -> None:
    m, _ = _manager()
    folder = _write(tmp_path / "a", {"q_proj": (8, 8), "v_proj": (8, 4)}, rank=2)
    m.register(_request("a", folder))
    adapter = m.load("a").result()
    f = adapter.layers["model.layers.0.self_attn.qkv_proj"]
    assert f.at.shape == (8, 4)
    q, v = f.blocks
    assert (q.r0, q.r1, q.c0, q.c1, q.bt.shape) == (0, 2, 0, 8, (2, 8))
    assert (v.r0, v.r1, v.c0, v.c1, v.bt.shape) == (2, 4, 12, 16, (2, 4))
    # B transposed, times lora_alpha / r = 2; A transposed, stacked q then v.
    saved = load_file(str(folder / "adapter_model.safetensors"))
    q_b = saved[f"{PREFIX}.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(q.bt, q_b.t() * 2)
    v_a = saved[f"{PREFIX}.self_attn.v_proj.lora_A.weight"]
    torch.testing.assert_close(f.at[:, 2:4], v_a.t())
    assert "model.layers.0.self_attn.o_proj" not in adapter.layers


def test_host_memory_is_lru_and_never_evicts_an_adapter_in_use(tmp_path: Path) -> None:
    m, _ = _manager(max_loras=1, max_cpu_loras=2)
    for i, name in enumerate("abc"):
        m.register(_request(name, _write(tmp_path / name, {"q_proj": (8, 8)}), i + 1))
    _load(m, "a")
    _load(m, "b")
    _load(m, "c", in_use=("a",))  # over capacity: b goes, a is pinned
    assert [m.is_loaded(n) for n in "abc"] == [True, False, True]
    m.collect(in_use=())  # still at most two
    assert sum(m.is_loaded(n) for n in "abc") == 2


def test_unregistered_adapter_stays_while_in_use(tmp_path: Path) -> None:
    m, _ = _manager()
    m.register(_request("a", _write(tmp_path / "a", {"q_proj": (8, 8)})))
    _load(m, "a")
    assert m.unregister("a") and m.get("a") is None and not m.unregister("a")
    m.collect(in_use=("a",))
    assert m.is_loaded("a")
    # Another folder under the same name must wait until its requests are done.
    with pytest.raises(InvalidRequestError, match="still in use"):
        m.register(_request("a", _write(tmp_path / "other", {"q_proj": (8, 8)})))
    m.collect(in_use=())
    assert not m.is_loaded("a")


def test_a_failed_load_is_forgotten_and_can_be_retried(tmp_path: Path) -> None:
    m, _ = _manager()
    folder = tmp_path / "late"
    m.register(_request("late", folder))
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        m.load("late").result()
    # Absent from the moment it failed, before any engine step collects the failure.
    assert m.get("late") is None and m.known() == [] and not m.unregister("late")
    other = _write(tmp_path / "other", {"q_proj": (8, 8)})
    assert m.register(_request("late", other)).lora_path == str(other)
    m.unregister("late")
    m.register(_request("late", folder))
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        m.load("late").result()
    _write(folder, {"q_proj": (8, 8)})
    _load(m, "late")  # the old failure is not answered again
    assert m.is_loaded("late")


def test_slots_are_reused_least_recently_used_first(tmp_path: Path) -> None:
    m, linears = _manager(max_loras=2, max_cpu_loras=3)
    for i, name in enumerate("abc"):
        m.register(_request(name, _write(tmp_path / name, {"q_proj": (8, 8)}), i + 1))
        _load(m, name)
    m.set_step([("a", 0, 2), (None, 2, 3), ("b", 3, 4)])
    assert m._slot_of == {"a": 0, "b": 1} and m.batch.active
    # Both adapters have few rows: one grouped pass over every slot, rows placed slot-major.
    g = m.batch.grouped
    assert g is not None and not m.batch.segments
    assert g.src.tolist() == [0, 1, 3] and g.dst.tolist() == [0, 1, 2] and g.max_rows == 2
    m.set_step([("b", 0, 1)])
    m.set_step([("c", 0, 1), ("b", 1, 2)])  # c takes a's slot, the least recently used
    assert m._slot_of == {"b": 1, "c": 0}
    m.set_step([(None, 0, 4)])
    assert not m.batch.active
    assert linears[0][1].lora is m.layers["model.layers.0.self_attn.qkv_proj"]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("rank", "rank 4 of model.layers.0.self_attn.q_proj is over --max-lora-rank 2"),
        ("shape", "shaped for another base model"),
        ("target", "has no LoRA-capable layer"),
        ("half", "needs both lora_A and lora_B"),
        ("dora", "DoRA"),
        ("bias", "trained biases"),
        ("saved", "modules_to_save"),
        ("bin", "safetensors only"),
        ("peft", "not a LoRA adapter"),
    ],
)
def test_bad_folders_are_refused_with_the_reason(case: str, reason: str, tmp_path: Path) -> None:
    m, _ = _manager(max_lora_rank=2)
    folder = tmp_path / case
    q = {"q_proj": (8, 8)}
    a = f"{PREFIX}.self_attn.q_proj.lora_A.weight"
    if case == "rank":
        _write(folder, q, rank=4)
    elif case == "shape":
        _write(folder, {"q_proj": (16, 8)})
    elif case == "target":
        _write(folder, {"x_proj": (8, 8)})
    elif case == "half":
        _write(folder, q, tensors={a: torch.randn(2, 8)})
    elif case in ("dora", "bias", "saved", "peft"):
        key = {"dora": "use_dora", "bias": "bias", "saved": "modules_to_save", "peft": "peft_type"}
        value = {"dora": True, "bias": "all", "saved": ["lm_head"], "peft": "IA3"}
        _write(folder, q, config={key[case]: value[case]})
    else:
        _write(folder, q)
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    m.register(_request(case, folder))
    with pytest.raises(InvalidRequestError, match=reason):
        m.load(case).result()
    m.take_loaded(())
    assert m.get(case) is None
