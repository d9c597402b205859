"""A model folder to a ready model runner: load the weights, prepare every linear layer for the
kernel that runs it, bind the KV pool.

    target = load_runner(config, config.model, device, env)
    draft = load_runner(config, draft_model_config, device, env, target.dtype, num_blocks)

The engine calls it once for the served model and, with speculative decoding's `draft_model`, once
more for the draft, which gets its own KV pool of `num_blocks` blocks (spec_decode/draft_model.py).
Everything device-side of start-up is here, so the engine only wires the parts together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from inferd.config import EngineConfig, Environment, ModelConfig
from inferd.executor.device import resolve_dtype
from inferd.executor.kv_pool import kv_cache_dtype
from inferd.executor.model_runner import ModelRunner
from inferd.models import kernels
from inferd.models.config import ArchConfig
from inferd.models.linear import (
    checkpoint_quantization,
    native_linear,
    prepare_linears,
    resolve_linear_kind,
)
from inferd.models.llama import LlamaForCausalLM
from inferd.models.loader import load_model, resolve_model_path

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: Path
    arch: ArchConfig
    dtype: torch.dtype
    model: LlamaForCausalLM
    runner: ModelRunner


def load_runner(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    env: Environment,
    dtype: torch.dtype | None = None,
    num_blocks: int | None = None,
) -> LoadedModel:
    """Loads `model_config`'s model under the engine's device and cache settings. `dtype`: the
    model dtype (None: from `model_config.dtype` and the checkpoint); `num_blocks`: the KV pool's
    blocks (None: as many as the cache budget holds)."""
    path = resolve_model_path(model_config.model, model_config.revision, env)
    arch = ArchConfig.from_json(path / "config.json")
    if dtype is None:
        dtype = resolve_dtype(model_config.dtype, arch.torch_dtype, device)
    model, arch = load_model(path, dtype, device, model_config.load_format, model_config.seed, arch)
    quantization = model_config.quantization
    if quantization is None and arch.quantization is not None:
        quantization = checkpoint_quantization(device)
    backend = config.device.linear_backend
    kind = resolve_linear_kind(backend, quantization, device, dtype)
    kv_dtype = kv_cache_dtype(config.cache, dtype)
    native = kernels.select(
        config.cache.attention_backend, device, dtype, kv_dtype, arch.head_dim, env
    )
    float_kind = resolve_linear_kind(backend, None, device, dtype)
    gemv = native.gemv if native else None
    on_native = native_linear(config.device.native_linear, kind, gemv, model, float_kind)
    prepare_linears(model, kind, on_native, float_kind)
    runner = ModelRunner(
        model,
        arch,
        device,
        dtype,
        config.cache,
        native,
        greedy_screen=config.device.greedy_screen != "off",
        num_blocks=num_blocks,
    )
    return LoadedModel(path, arch, dtype, model, runner)
