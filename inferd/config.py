"""The one validated config tree.

Built once (from the CLI, the offline `LLM(...)` keyword arguments, or a file) and never mutated.
Values derived at run time (number of KV blocks, EOS ids, the resolved `max_model_len`) live in
runtime objects, not here. This is also the only module that reads the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_MODEL = "inferd-tiny"

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
LoadFormat = Literal["auto", "safetensors", "dummy"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """What to load. `model` is a local Hugging Face folder, a hub id, or `inferd-tiny`."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    revision: str | None = None
    dtype: DType = "auto"
    load_format: LoadFormat = "auto"
    seed: int = 0
    max_model_len: int | None = Field(default=None, gt=0)


class CacheConfig(_Frozen):
    """Paged KV cache. One pool of `block_size`-token blocks per device."""

    block_size: int = Field(default=16, gt=0, le=1024)
    # Bytes for the KV pool. None: 4 GiB on CPU (vLLM's CPU default); on CUDA the pool takes
    # `gpu_memory_utilization` of total memory minus what the weights and activations use.
    kv_cache_memory: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True


class SchedulerConfig(_Frozen):
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    # Prefills longer than the remaining step budget are split across steps.
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"


class DeviceConfig(_Frozen):
    device: Device = "auto"
    # CPU threads for torch; None keeps torch's default (one per physical core).
    num_threads: int | None = Field(default=None, gt=0)
    # CUDA graphs for decode batches; ignored on CPU.
    enforce_eager: bool = False


class EngineConfig(_Frozen):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build the tree from flat vLLM-style keyword arguments (`LLM(model=..., dtype=...)`)."""
        sections: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            if value is None and key != "max_model_len":
                continue
            section = _FIELD_TO_SECTION.get(key)
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            sections[section][key] = value
        return cls.model_validate(sections)


_SECTIONS: dict[str, type[_Frozen]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
}
_FIELD_TO_SECTION = {f: s for s, cls in _SECTIONS.items() for f in cls.model_fields}


class Environment(_Frozen):
    """Settings that come from the environment, read here and nowhere else."""

    cache_dir: Path
    hf_offline: bool

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()


def read_environment() -> Environment:
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "inferd"
    return Environment(
        cache_dir=Path(os.environ.get("INFERD_CACHE_DIR", str(default_cache))),
        hf_offline=os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"),
    )
