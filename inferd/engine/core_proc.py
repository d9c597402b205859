"""The engine core process: LLMEngine in a busy loop, fed and drained over one Unix socket.

    while running:
        receive every message that arrived (wait only when no request is unfinished; a
            KVBlocksRequest, RemoveLoRA or ListLoRAs is answered at once, between two steps)
        answer each AddLoRA whose adapter finished loading (the engine loads in the background)
        if work: outputs = engine.step(); send one EngineOutputs (DELTA outputs + stats)

Deadlines travel in AddRequest and are the engine's scheduler's from then on: each step first
finishes the requests past theirs (inferd.scheduler.scheduler.Scheduler.expire).

The front listens on the channel's socket and this process connects (engine/core_channel.py):
EngineCoreRequest frames in, EngineCoreEvent frames out; sends never block the step loop. It
sends CoreReady once the model is loaded (or CoreFailed and exits 1). It exits when the front
closes its end, and while idle it checks every second that its parent is still there, so an
orphaned core never outlives the server.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from concurrent.futures import Future

import msgspec

from inferd.config import EngineConfig, Environment
from inferd.engine.core_channel import CoreSocket
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
    EngineCoreEvent,
    EngineCoreRequest,
    EngineOutputs,
    KVBlocks,
    KVBlocksRequest,
    ListLoRAs,
    LoRAReply,
    RejectedRequest,
    RemoveLoRA,
    ShutdownCore,
)
from inferd.engine.output_processor import OutputKind
from inferd.errors import InvalidRequestError
from inferd.heap import freeze_startup_heap
from inferd.spec_decode.drafter import SpecDecodeCounters
from inferd.types import RequestOutput

logger = logging.getLogger("inferd.engine.core")

_IDLE_POLL_MS = 1000
# While an adapter loads and nothing else runs, the loop wakes this often to answer its AddLoRA
# (the load's future has no descriptor to wait on; 10 ms is noise next to a load from disk).
_LORA_POLL_MS = 10
_SEND_LINGER_S = 2.0


def run_engine_core(config: EngineConfig, env: Environment, channel_path: str) -> None:
    """Entry point of the spawned core process."""
    # Ctrl-C goes to the whole process group; the front decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    channel = CoreSocket(channel_path)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = LLMEngine(config, env)
        ready = CoreReady(
            info=engine.info,
            tokenizer_path=str(engine.tokenizer_path),
            loras=engine.list_loras(),
        )
    except Exception as e:  # any load failure is reported to the front, then we exit
        logger.exception("engine core failed to start")
        channel.send(encoder.encode(CoreFailed(error_type=type(e).__name__, message=str(e))))
        channel.close(_SEND_LINGER_S)
        sys.exit(1)
    freeze_startup_heap("engine core")  # before ready: the front starts sending at once
    channel.send(encoder.encode(ready))
    EngineCore(engine, channel).run()
    if engine.kv_events is not None:
        engine.kv_events.close()
    channel.close(_SEND_LINGER_S)


class EngineCore:
    """Owns the LLMEngine and the channel; `run()` returns on ShutdownCore or once the front is
    gone."""

    def __init__(self, engine: LLMEngine, channel: CoreSocket) -> None:
        self.engine = engine
        self.channel = channel
        self.decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent_pid = os.getppid()
        self.running = True
        self.rejected: list[RejectedRequest] = []
        self.num_added_total = 0
        self.num_steps_total = 0
        # AddLoRA calls whose adapter is loading: call id -> (the engine's future, the adapter).
        self.loading: dict[int, Future[None]] = {}

    def run(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished_requests()
            self.receive(block=idle)
            self.answer_loaded()
            if self.engine.has_unfinished_requests():
                self.step()
            elif self.rejected:
                self.send([])

    def receive(self, block: bool) -> None:
        """Handles every message that arrived; waits first when `block` (up to a second, or
        up to 10 ms while an adapter loads)."""
        wait_ms = (_LORA_POLL_MS if self.loading else _IDLE_POLL_MS) if block else 0
        for payload in self.channel.receive(wait_ms):
            self.handle(self.decoder.decode(payload))
        if self.channel.closed or (block and os.getppid() != self.parent_pid):
            logger.warning("the server process is gone; the engine core exits")
            self.running = False

    def handle(self, message: EngineCoreRequest) -> None:
        if isinstance(message, AddRequest):
            self.add(message)
        elif isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
        elif isinstance(message, KVBlocksRequest):
            digest = self.kv_blocks(message.limit, message.recent_s)
            self.channel.send(self.encoder.encode(digest))
        elif isinstance(message, AddLoRA | RemoveLoRA | ListLoRAs):
            self.handle_lora(message)
        elif isinstance(message, ShutdownCore):
            self.running = False

    def handle_lora(self, message: AddLoRA | RemoveLoRA | ListLoRAs) -> None:
        if isinstance(message, AddLoRA):
            self.loading[message.call_id] = self.start_load(message)
        elif isinstance(message, RemoveLoRA):
            found = self.engine.remove_lora(message.lora_name)
            error = None if found else "not_found"
            message_text = "" if found else f"no LoRA adapter named {message.lora_name!r}"
            self.reply(LoRAReply(message.call_id, error_type=error, message=message_text))
        else:
            self.reply(LoRAReply(message.call_id, loras=self.engine.list_loras()))

    def start_load(self, message: AddLoRA) -> Future[None]:
        try:
            return self.engine.add_lora(message.lora_request)
        except Exception as e:  # refused before loading: answered like a failed load
            failed: Future[None] = Future()
            failed.set_exception(e)
            return failed

    def answer_loaded(self) -> None:
        """A LoRAReply for each AddLoRA whose adapter has loaded or failed (never waits)."""
        for call_id, future in list(self.loading.items()):
            if future.done():
                del self.loading[call_id]
                self.reply(_load_reply(call_id, future))

    def reply(self, reply: LoRAReply) -> None:
        self.channel.send(self.encoder.encode(reply))

    def kv_blocks(self, limit: int, recent_s: float) -> KVBlocks:
        blocks = self.engine.scheduler.block_manager
        digest = blocks.held_hashes(limit, recent_s)
        return KVBlocks(
            block_size=blocks.block_size,
            num_blocks=blocks.num_blocks,
            block_hashes=digest.hashes,
            num_cached=blocks.num_cached_blocks,
            prefix_caching=blocks.enable_prefix_caching,
            num_recent=digest.num_recent,
        )

    def add(self, message: AddRequest) -> None:
        self.num_added_total += 1
        try:
            self.engine.add_request(
                message.request_id,
                {"prompt_token_ids": message.prompt_token_ids},
                message.params,
                priority=message.priority,
                arrival_time=message.arrival_time,
                deadline=message.deadline,
                output_kind=OutputKind.DELTA,
                lora_request=message.lora_request,
            )
        except InvalidRequestError as e:
            self.rejected.append(_rejection(message.request_id, "invalid_request", e, e.param))
            return
        except Exception as e:  # a failing request fails alone; the engine keeps serving
            logger.exception("could not add request %s", message.request_id)
            self.rejected.append(_rejection(message.request_id, "internal", e))
            return

    def step(self) -> None:
        outputs = self.engine.step()
        self.num_steps_total += 1
        for request_id, error in self.engine.take_refused():
            self.rejected.append(_rejection(request_id, "invalid_request", error, error.param))
        self.send(outputs)

    def send(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            # The front holds each request's prompt; sending it with every step's delta would
            # cost both processes an encode/decode of every prompt id per step.
            out.prompt_token_ids = []
            out.prompt = None
        event: EngineCoreEvent = EngineOutputs(
            outputs=outputs, stats=self.stats(), rejected=self.rejected
        )
        self.rejected = []
        self.channel.send(self.encoder.encode(event))

    def stats(self) -> CoreStats:
        engine = self.engine
        last = engine.step_stats.steps[-1] if engine.step_stats.steps else None
        spec = engine.drafter.counters if engine.drafter else SpecDecodeCounters()
        return CoreStats(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=engine.scheduler.block_manager.usage,
            step_num_batched_tokens=last.num_batched_tokens if last else 0,
            step_num_seqs=last.num_running if last else 0,
            step_token_budget=engine.scheduler.step_budget.tokens(),
            num_preemptions_total=engine.num_preemptions_total,
            num_steps_total=self.num_steps_total,
            num_added_total=self.num_added_total,
            prefix_cache_queries_tokens_total=engine.scheduler.prefix_cache.queries,
            prefix_cache_hits_tokens_total=engine.scheduler.prefix_cache.hits,
            grammar_cache_hits_total=engine.grammar_cache_counts[0],
            grammar_cache_misses_total=engine.grammar_cache_counts[1],
            spec_decode_num_drafts_total=spec.num_drafts,
            spec_decode_num_draft_tokens_total=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens,
            spec_decode_accepted_per_pos=tuple(spec.accepted_per_pos),
        )


def _rejection(
    request_id: str, error_type: str, error: Exception, param: str | None = None
) -> RejectedRequest:
    return RejectedRequest(
        request_id=request_id, error_type=error_type, message=str(error), param=param
    )


def _load_reply(call_id: int, future: Future[None]) -> LoRAReply:
    error = future.exception()
    if error is None:
        return LoRAReply(call_id)
    if isinstance(error, InvalidRequestError):
        return LoRAReply(call_id, error_type="invalid_request", message=str(error))
    logger.error("loading a LoRA adapter failed", exc_info=error)
    return LoRAReply(call_id, error_type="internal", message=f"{type(error).__name__}: {error}")
