"""A served model's batching and queue rules, read from its config.yaml and server defaults.

    policy = batch_policy(config, QueueLimits(max_queue_size=1024))   # for DynamicBatcher
    rules = queue_rules(config, limits)                               # priority, timeout
    variable = variable_dims(config, backend.inputs(), has_preprocess=False)  # what to pad

Pure functions of the config: the pipeline builds them once, at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.backends.base import Backend, TensorSpec
from inferd.batching.batcher import BatchPolicy
from inferd.batching.validate import QueueRules
from inferd.model_config import ModelRepoConfig


@dataclass(frozen=True)
class QueueLimits:
    """Server-wide queue defaults; a model's config.yaml may set its own."""

    max_queue_size: int = 1024
    default_timeout_s: float | None = None


DEFAULT_LIMITS = QueueLimits()


def batch_policy(config: ModelRepoConfig, limits: QueueLimits) -> BatchPolicy:
    db = config.dynamic_batching
    max_queue = limits.max_queue_size
    if db is not None and db.default_queue_policy.max_queue_size > 0:
        max_queue = db.default_queue_policy.max_queue_size
    dynamic = db is not None and config.max_batch_size > 0
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        dynamic=dynamic,
        max_delay_s=config.batch_delay_s,
        preferred_batch_sizes=db.preferred_batch_sizes if db is not None else (),
        max_queue_size=max_queue,
        max_padding_ratio=db.max_padding_ratio if db is not None else 0.0,
    )


def queue_rules(config: ModelRepoConfig, limits: QueueLimits) -> QueueRules:
    db = config.dynamic_batching
    if db is None:
        return QueueRules(default_timeout_s=limits.default_timeout_s)
    policy = db.default_queue_policy
    timeout = policy.default_timeout_ms / 1e3 if policy.default_timeout_ms > 0 else None
    return QueueRules(
        priority_levels=db.priority_levels,
        # Triton requires a default level; when none is set, unmarked requests go last.
        default_priority=db.default_priority_level or max(1, db.priority_levels),
        default_timeout_s=timeout if timeout is not None else limits.default_timeout_s,
        allow_timeout_override=policy.allow_timeout_override,
    )


def variable_dims(
    config: ModelRepoConfig, declared: Sequence[TensorSpec], *, has_preprocess: bool
) -> dict[str, tuple[int, ...]]:
    """Model input name -> its variable dims (axis numbers in the batched tensor)."""
    if config.max_batch_size == 0:
        return {}  # never batched: nothing to pad
    found: dict[str, set[int]] = {}
    for spec in declared:
        found.setdefault(spec.name, set()).update(
            i for i, d in enumerate(spec.shape) if i > 0 and d == -1
        )
    if not has_preprocess:  # then the config's inputs are the model's inputs
        for t in config.input:
            found.setdefault(t.name, set()).update(i + 1 for i, d in enumerate(t.dims) if d == -1)
    return {name: tuple(sorted(dims)) for name, dims in found.items() if dims}


def known_outputs(
    config: ModelRepoConfig, backend: Backend, *, has_postprocess: bool
) -> frozenset[str] | None:
    """Output names a request may ask for, when known before running (else None)."""
    if config.output:
        return frozenset(t.name for t in config.output)
    if has_postprocess:
        return None
    names = frozenset(s.name for s in backend.outputs())
    return names or None
