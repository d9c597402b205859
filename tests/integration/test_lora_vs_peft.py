"""Many LoRA adapters in one batch: greedy output equals transformers + PEFT, token for token.

Several adapters (ranks 4, 8 and 16; attention only, MLP only, all seven layers, rsLoRA) and the
base model run mixed in the same steps, with prompts that share prefixes across adapters, chunked
prefill, preemption and prefix caching on, on the native kernels and on the PyTorch path.
Each request's tokens must equal PEFT's `generate` with that adapter (or with it disabled).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_engine_vs_hf import _engine, _hf_greedy, _make_checkpoint  # noqa: E402

from inferd import LLMEngine, RequestOutput, SamplingParams  # noqa: E402
from inferd.errors import InvalidRequestError  # noqa: E402
from inferd.lora.random_adapter import write_random_adapter  # noqa: E402
from inferd.lora.request import LoRARequest  # noqa: E402
from inferd.models.kernels import kernel_available  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> (rank, targets, rsLoRA)
ADAPTERS: dict[str, tuple[int, tuple[str, ...], bool]] = {
    "qv-r8": (8, ("q_proj", "v_proj"), False),
    "mlp-r4": (4, MLP, False),
    "all-r16": (16, ATTENTION + MLP, False),
    "ko-r8-rs": (8, ("k_proj", "o_proj"), True),
}


def _adapters(model: Path, root: Path) -> dict[str, LoRARequest]:
    out = {}
    for i, (name, (rank, targets, rs)) in enumerate(ADAPTERS.items()):
        folder = write_random_adapter(model, root / name, rank, targets, seed=i, use_rslora=rs)
        out[name] = LoRARequest(name, i + 1, str(folder))
    return out


def _workload(seed: int, names: list[str | None]) -> list[tuple[list[int], int, str | None]]:
    """Prompts of mixed lengths, two thirds of them opening with one shared 24-token prefix, in
    pairs under one adapter or the base model (None), round robin."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, 380) for _ in range(24)]
    lengths = [3, 70, 12, 41, 1, 25, 58, 7, 33, 19, 30, 9]
    work = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(5, 380) for _ in range(n)]
        if i % 3:
            prompt = shared + prompt
        work.append((prompt, rng.randint(4, 14), names[i // 2 % len(names)]))
    return work


def _run(
    engine: LLMEngine, work: list[tuple[list[int], int, str | None]], loras: dict[str, LoRARequest]
) -> dict[str, RequestOutput]:
    """Half the requests at t0, the rest one per step while the first run."""
    results: dict[str, RequestOutput] = {}
    pending = list(enumerate(work))

    def add() -> None:
        i, (prompt, n, name) = pending.pop(0)
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        lora = None if name is None else loras[name]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora_request=lora)

    for _ in range(len(work) // 2):
        add()
    while engine.has_unfinished_requests() or pending:
        if pending:
            add()
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return results


def _peft_greedy(
    model_path: Path, work: list[tuple[list[int], int, str | None]], loras: dict[str, LoRARequest]
) -> tuple[list[list[int]], list[list[int]]]:
    """PEFT's greedy tokens for each request, and the base model's for its prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    names = list(loras)
    model: Any = peft.PeftModel.from_pretrained(hf, loras[names[0]].lora_path, names[0])
    for other in names[1:]:
        model.load_adapter(loras[other].lora_path, other)
    model.eval()
    out, base = [], []
    for prompt, n, name in work:
        with model.disable_adapter():
            base.append(_hf_greedy(model, prompt, n))
        if name is None:
            out.append(base[-1])
        else:
            model.set_adapter(name)
            out.append(_hf_greedy(model, prompt, n))
    return out, base


# PEFT (0.21) reads a property transformers deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
NATIVE = pytest.mark.skipif(not kernel_available(), reason="native CPU kernels unavailable")


@pytest.mark.parametrize(
    "backend", [pytest.param("cpu_kernel", marks=NATIVE), "torch"], ids=["native", "torch"]
)
def test_mixed_adapters_match_peft(backend: str, tmp_path: Path) -> None:
    model_path = _make_checkpoint("llama", tmp_path)
    loras = _adapters(model_path, tmp_path / "adapters")
    names: list[str | None] = [None, *loras]
    work = _workload(7, names)
    engine = _engine(
        model_path,
        attention_backend=backend,
        enable_lora=True,
        max_loras=3,
        max_cpu_loras=4,
    )
    results = _run(engine, work, loras)
    expected, base = _peft_greedy(model_path, work, loras)
    got = [results[str(i)].outputs[0].token_ids for i in range(len(work))]
    assert got == expected
    # Every adapter request's tokens differ from the base model's: the adapters were applied.
    adapted = [i for i, (_, _, name) in enumerate(work) if name is not None]
    assert all(expected[i] != base[i] for i in adapted)
    # The workload exercised what it should: preemption, chunked prefill, prefix hits.
    assert engine.num_preemptions_total > 0
    assert engine.scheduler.prefix_cache.hits > 0
    engine.scheduler.block_manager.check_invariants()


def test_same_prompt_under_two_adapters_differs_and_caches_apart(tmp_path: Path) -> None:
    model_path = _make_checkpoint("llama", tmp_path)
    loras = _adapters(model_path, tmp_path / "adapters")
    engine = _engine(model_path, enable_lora=True, max_loras=2)
    prompt = list(range(10, 50))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs: dict[str | None, list[tuple[list[int], int]]] = {}
    for name in (None, "all-r16", None, "all-r16", "qv-r8"):
        lora = None if name is None else loras[name]
        engine.add_request("r", {"prompt_token_ids": prompt}, params, lora_request=lora)
        out = next(o for o in engine.run_to_completion() if o.finished)
        outs.setdefault(name, []).append((out.outputs[0].token_ids, out.metrics.num_cached_tokens))
    # Second run of a prompt under the same adapter hits the cache; another adapter does not.
    assert outs[None][0][1] == 0 and outs[None][1][1] > 0
    assert outs["all-r16"][0][1] == 0 and outs["all-r16"][1][1] > 0
    assert outs["qv-r8"][0][1] == 0
    assert outs[None][0][0] == outs[None][1][0]
    assert outs["all-r16"][0][0] == outs["all-r16"][1][0]
    assert outs[None][0][0] != outs["all-r16"][0][0]


def test_bad_adapters_are_refused_with_the_reason(tmp_path: Path) -> None:
    model_path = _make_checkpoint("llama", tmp_path)
    engine = _engine(model_path, enable_lora=True, max_lora_rank=8)
    big = write_random_adapter(model_path, tmp_path / "big", 16, ("q_proj",))
    cases = {
        "missing": (str(tmp_path / "nowhere"), "is not a folder"),
        "rank": (str(big), "rank 16 of model.layers.0.self_attn.q_proj is over"),
    }
    for i, (name, (path, reason)) in enumerate(cases.items()):
        future = engine.add_lora(LoRARequest(name, i + 1, path))
        with pytest.raises(InvalidRequestError, match=reason):
            future.result()
        engine.step()
        assert name not in [r.lora_name for r in engine.list_loras()]
    off = _engine(model_path)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        off.add_lora(LoRARequest("x", 1, str(big)))
