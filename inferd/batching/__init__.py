"""Dynamic batching for classic (stateless) models: the per-model pipeline and its batcher."""

from inferd.batching.batcher import BatchPolicy, DynamicBatcher, Queued
from inferd.batching.pipeline import BackendError, QueueLimits, ServedModel
from inferd.batching.validate import InputValidator, QueueRules

__all__ = [
    "BackendError",
    "BatchPolicy",
    "DynamicBatcher",
    "InputValidator",
    "QueueLimits",
    "QueueRules",
    "Queued",
    "ServedModel",
]
