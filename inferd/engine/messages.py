"""Typed messages between the front (AsyncLLM) and the engine core process, msgpack-encoded.

front --EngineCoreRequest--> core   (one per frame: AddRequest | AbortRequests | KVBlocksRequest
                                     | AddLoRA | RemoveLoRA | ListLoRAs | ShutdownCore)
core  --EngineCoreEvent-->  front   (CoreReady once loaded, or CoreFailed; then EngineOutputs
                                     after every step, and for requests the core rejected; KVBlocks
                                     for each KVBlocksRequest, between two steps; a LoRAReply for
                                     each LoRA call: at once for a remove or list, once the adapter
                                     has loaded (or failed to) for an add, so in any order)

Times are time.monotonic() seconds; CLOCK_MONOTONIC is system-wide, so the two processes agree.
"""

from __future__ import annotations

import msgspec

from inferd.engine.info import EngineInfo
from inferd.lora.request import LoRARequest
from inferd.sampling.params import SamplingParams
from inferd.types import RequestOutput


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    arrival_time: float | None = None
    # Past this monotonic time the engine's scheduler finishes the request (finish_reason
    # "timeout"; status FINISHED_EXPIRED_WAITING before its first token).
    deadline: float | None = None
    # The adapter the request runs under; None: the base model.
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class KVBlocksRequest(msgspec.Struct, tag="kv_blocks", frozen=True):
    """Asks for the prefix cache's block digest (KVBlocks): at most `limit` hashes, and how
    many of the last were in use within `recent_s` seconds."""

    limit: int
    recent_s: float = 0.0


class AddLoRA(msgspec.Struct, tag="add_lora", frozen=True):
    """Registers an adapter and loads it; answered by a LoRAReply with the same `call_id` once it
    has loaded (or failed to: then it is not registered)."""

    call_id: int
    lora_request: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora", frozen=True):
    """Unregisters an adapter at once (requests already using it finish first)."""

    call_id: int
    lora_name: str


class ListLoRAs(msgspec.Struct, tag="list_loras", frozen=True):
    call_id: int


class ShutdownCore(msgspec.Struct, tag="shutdown", frozen=True):
    pass


EngineCoreRequest = (
    AddRequest | AbortRequests | KVBlocksRequest | AddLoRA | RemoveLoRA | ListLoRAs | ShutdownCore
)


class CoreReady(msgspec.Struct, tag="ready", frozen=True):
    """Sent once the model is loaded."""

    info: EngineInfo
    tokenizer_path: str
    # The adapters registered at start-up (--lora-modules), so the front resolves names at once.
    loras: list[LoRARequest] = []


class CoreFailed(msgspec.Struct, tag="failed", frozen=True):
    """The core could not start (bad model, out of memory); it exits after sending this."""

    error_type: str
    message: str


class CoreStats(msgspec.Struct, frozen=True):
    """The engine's state after a step: what admission's pump and the gauges read."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, in [0, 1]
    # The last step that ran: tokens computed and sequences in the batch.
    step_num_batched_tokens: int = 0
    step_num_seqs: int = 0
    # The scheduler's token budget for the next step (scheduler/step_budget.py).
    step_token_budget: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    # AddRequests received so far: the front subtracts it from what it sent to know how many
    # requests are still in flight to the core.
    num_added_total: int = 0
    # Prompt tokens looked up in the prefix cache at first admission, and found there.
    prefix_cache_queries_tokens_total: int = 0
    prefix_cache_hits_tokens_total: int = 0
    # Structured outputs: grammar lookups that found the spec compiled (or compiling), and not.
    grammar_cache_hits_total: int = 0
    grammar_cache_misses_total: int = 0
    # Speculative decoding (vLLM's spec_decode_*): chunks that verified drafts, their draft
    # tokens, the drafts accepted, and accepted drafts by position (0 = the first draft).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()


class RejectedRequest(msgspec.Struct, frozen=True):
    """A request the engine refused at add time (it never ran)."""

    request_id: str
    error_type: str  # "invalid_request" or "internal"
    message: str
    param: str | None = None


class EngineOutputs(msgspec.Struct, tag="outputs", frozen=True):
    """Everything one loop iteration of the core produced: DELTA outputs of a step, rejections."""

    outputs: list[RequestOutput]
    stats: CoreStats
    rejected: list[RejectedRequest] = []


class KVBlocks(msgspec.Struct, tag="kv_blocks", frozen=True):
    """The prefix cache's block digest when the core read it: the stable hashes of its cached
    blocks (kv_cache/block_hash.py), least recently used first, the most recent `limit` of them."""

    block_size: int
    num_blocks: int
    block_hashes: list[int]
    # Cached blocks in all; more than len(block_hashes) when the limit cut the digest.
    num_cached: int
    prefix_caching: bool
    # The last num_recent hashes were in use within the window asked for (held by a running
    # request, or released within it); the others are evictable and older.
    num_recent: int = 0


class LoRAReply(msgspec.Struct, tag="lora_reply", frozen=True):
    """The answer to the AddLoRA, RemoveLoRA or ListLoRAs with this `call_id`."""

    call_id: int
    # None: done. "invalid_request": the adapter was refused (the message says why, a 400);
    # "not_found": no adapter of that name (a 404); "internal": a bug.
    error_type: str | None = None
    message: str = ""
    # ListLoRAs: every registered adapter.
    loras: list[LoRARequest] = []


# What the core sends once it is ready: everything but CoreReady and CoreFailed.
CoreEvent = EngineOutputs | KVBlocks | LoRAReply
EngineCoreEvent = CoreReady | CoreFailed | EngineOutputs | KVBlocks | LoRAReply
