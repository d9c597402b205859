"""The engine core process: LLMEngine in a busy loop, fed and drained over ZeroMQ.

    while running:
        receive every queued message (block only when no request is unfinished; a
            KVBlocksRequest is answered at once, between two steps)
        if work: outputs = engine.step(); send one EngineOutputs (DELTA outputs + stats)

Deadlines travel in AddRequest and are the engine's scheduler's from then on: each step first
finishes the requests past theirs (inferd.scheduler.scheduler.Scheduler.expire).

The front binds both ipc:// sockets; this process connects: PULL for EngineCoreRequest frames,
PUSH for EngineCoreEvent frames. It sends CoreReady once the model is loaded (or CoreFailed and
exits 1). While idle it wakes every second to check that its parent is still there, so an
orphaned core never outlives the server.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import zmq

from inferd.config import EngineConfig, Environment
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
    EngineCoreEvent,
    EngineCoreRequest,
    EngineOutputs,
    KVBlocks,
    KVBlocksRequest,
    RejectedRequest,
    ShutdownCore,
)
from inferd.engine.output_processor import OutputKind
from inferd.errors import InvalidRequestError
from inferd.heap import freeze_startup_heap
from inferd.types import RequestOutput

logger = logging.getLogger("inferd.engine.core")

_IDLE_POLL_MS = 1000
_SEND_LINGER_MS = 2000


def run_engine_core(
    config: EngineConfig, env: Environment, input_address: str, output_address: str
) -> None:
    """Entry point of the spawned core process."""
    # Ctrl-C goes to the whole process group; the front decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = LLMEngine(config, env)
        ready = CoreReady(info=engine.info, tokenizer_path=str(engine.tokenizer_path))
    except Exception as e:  # any load failure is reported to the front, then we exit
        logger.exception("engine core failed to start")
        outputs.send(encoder.encode(CoreFailed(error_type=type(e).__name__, message=str(e))))
        ctx.destroy(linger=_SEND_LINGER_MS)
        sys.exit(1)
    freeze_startup_heap("engine core")  # before ready: the front starts sending at once
    outputs.send(encoder.encode(ready))
    EngineCore(engine, inputs, outputs).run()
    if engine.kv_events is not None:
        engine.kv_events.close()
    ctx.destroy(linger=_SEND_LINGER_MS)


class EngineCore:
    """Owns the LLMEngine and the two sockets; `run()` returns on ShutdownCore or parent exit."""

    def __init__(
        self, engine: LLMEngine, inputs: zmq.Socket[bytes], outputs: zmq.Socket[bytes]
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent_pid = os.getppid()
        self.running = True
        self.rejected: list[RejectedRequest] = []
        self.num_added_total = 0
        self.num_steps_total = 0

    def run(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished_requests()
            self.receive(block=idle)
            if self.engine.has_unfinished_requests():
                self.step()
            elif self.rejected:
                self.send([])

    def receive(self, block: bool) -> None:
        """Handles every message already queued; waits up to a second first when `block`."""
        timeout = _IDLE_POLL_MS if block else 0
        while self.poller.poll(timeout):
            self.handle(self.decoder.decode(self.inputs.recv(copy=False).buffer))
            timeout = 0
        if block and os.getppid() != self.parent_pid:
            logger.warning("the server process is gone; the engine core exits")
            self.running = False

    def handle(self, message: EngineCoreRequest) -> None:
        if isinstance(message, AddRequest):
            self.add(message)
        elif isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
        elif isinstance(message, KVBlocksRequest):
            digest = self.kv_blocks(message.limit, message.recent_s)
            self.outputs.send(self.encoder.encode(digest))
        elif isinstance(message, ShutdownCore):
            self.running = False

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
        # A copying send: a step's outputs are a few KiB to tens of KiB, which pyzmq copies
        # either way (under 64 KiB), `copy=False` only through a Frame object first. Timed in
        # the engine core during a served llama-32m run: 0.19 ms a send copying, 0.9-3.0 ms
        # through the Frame (docs/benchmarks.md).
        self.outputs.send(self.encoder.encode(event))

    def stats(self) -> CoreStats:
        engine = self.engine
        last = engine.step_stats.steps[-1] if engine.step_stats.steps else None
        return CoreStats(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=engine.scheduler.block_manager.usage,
            step_num_batched_tokens=last.num_batched_tokens if last else 0,
            step_num_seqs=last.num_running if last else 0,
            num_preemptions_total=engine.num_preemptions_total,
            num_steps_total=self.num_steps_total,
            num_added_total=self.num_added_total,
            prefix_cache_queries_tokens_total=engine.scheduler.prefix_cache.queries,
            prefix_cache_hits_tokens_total=engine.scheduler.prefix_cache.hits,
        )


def _rejection(
    request_id: str, error_type: str, error: Exception, param: str | None = None
) -> RejectedRequest:
    return RejectedRequest(
        request_id=request_id, error_type=error_type, message=str(error), param=param
    )
