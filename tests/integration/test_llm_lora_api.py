"""The offline API's LoRA surface, as vLLM's: `generate(..., lora_request=)` (one for every
prompt, or one per prompt) and `add_lora` / `remove_lora` / `list_loras`."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import LLM, SamplingParams
from inferd.config import read_environment
from inferd.errors import InvalidRequestError
from inferd.lora.random_adapter import write_random_adapter
from inferd.lora.request import LoRARequest
from inferd.models.tiny import ensure_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_offline_lora_api(tmp_path: Path) -> None:
    write_random_adapter(ensure_tiny_model(read_environment().cache_dir), tmp_path / "a", seed=1)
    llm = LLM("inferd-tiny", enable_lora=True, max_model_len=128, kv_cache_memory=8 << 20)
    a = LoRARequest("a", 1, str(tmp_path / "a"))
    assert llm.add_lora(a) and llm.list_loras() == [a]
    mixed = llm.generate(["Hello", "Hello"], GREEDY, lora_request=[a, None], use_tqdm=False)
    both = llm.generate(["Hello"], GREEDY, lora_request=a, use_tqdm=False)
    base = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == both[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == base[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], GREEDY, lora_request=[a], use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.add_lora(LoRARequest("missing", 2, str(tmp_path / "missing")))
    assert llm.list_loras() == [a], llm.list_loras()
    assert llm.remove_lora("a") and not llm.remove_lora("a") and llm.list_loras() == []
