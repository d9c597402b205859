"""What an engine says about itself: EngineInfo (fixed at start-up) and EngineStats (a snapshot).

A leaf module (no torch, nothing of inferd), so the gateway and the telemetry can name both
without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    """Values derived at start-up (never written back into the config)."""

    model_path: str
    architecture: str
    device: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for gauges and /metrics; engine values are as of the core's last message."""

    running: int = 0
    waiting: int = 0  # in the engine's scheduler
    queued: int = 0  # in the front's admission queue
    queued_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0
    step_num_batched_tokens: int = 0
    step_num_seqs: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    in_flight: int = 0  # accepted and not yet finished: queued + in the engine
