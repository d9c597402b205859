"""Dynamic batching for classic (stateless) models, in a request's order: validate.py (checks
before queueing), batcher.py (when a batch runs; buckets.py what it holds), assembler.py (stack,
pad, split, select outputs), pipeline.py (ServedModel, the per-model orchestrator); rules.py
reads config.yaml; clock.py is the batcher's injectable time source, pace.py its injectable
judge of whether waiting can grow a batch."""

from inferd.batching.assembler import BackendError
from inferd.batching.batcher import BatchPolicy, DynamicBatcher, Queued
from inferd.batching.pipeline import ServedModel
from inferd.batching.rules import QueueLimits
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
