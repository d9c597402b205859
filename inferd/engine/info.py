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
    enable_prefix_caching: bool = True
    # The KV pool's element type ("auto" resolved: the model dtype when not set).
    kv_cache_dtype: str = ""
    # --reasoning-parser: the front splits the thinking text from the answer with it.
    reasoning_parser: str | None = None

    def cache_config_labels(self) -> tuple[tuple[str, str], ...]:
        """The KV cache's settings as (label, value) pairs, vLLM's `cache_config_info` labels."""
        return (
            ("block_size", str(self.block_size)),
            ("num_blocks", str(self.num_kv_blocks)),
            ("enable_prefix_caching", str(self.enable_prefix_caching)),
            ("cache_dtype", self.kv_cache_dtype or self.dtype),
        )


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
    step_token_budget: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    in_flight: int = 0  # accepted and not yet finished: queued + in the engine
    prefix_cache_queries_tokens_total: int = 0
    prefix_cache_hits_tokens_total: int = 0
    grammar_cache_hits_total: int = 0
    grammar_cache_misses_total: int = 0
    # Speculative decoding (vLLM's spec_decode_*): chunks that verified drafts, their draft
    # tokens, the drafts accepted, and accepted drafts by position (0 = the first draft).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    # EngineInfo.cache_config_labels(); () until the engine has loaded.
    cache_config: tuple[tuple[str, str], ...] = ()
