"""AsyncLLM: the server's asyncio front to an engine core running in its own process.

    llm = await AsyncLLM.start(EngineConfig(), AdmissionConfig())
    async for delta in llm.generate(GenerateRequest("r1", ids, SamplingParams(max_tokens=8))):
        print(delta.outputs[0].text, end="")
    await llm.shutdown()

It composes three parts, each with one job:
  - EngineCoreClient (engine/core_client.py): the process and its two sockets;
  - FrontDoor (admission/front_door.py): the bounded queue, its deadlines, the release policy
    and Retry-After, pure and driven by `(now, engine load)`;
  - StreamTable (engine/streams.py): one stream per accepted request, merging DELTA outputs.

Beside the callers' generators:
  - the core client's callback (`_on_event`, on the event loop as each message arrives)
    dispatches EngineOutputs to the streams (aborting a request whose reader fell too far
    behind, see StreamTable.dispatch), hands each KVBlocks to the oldest `kv_blocks` call
    waiting (the core answers requests in the order sent), and each LoRAReply to the LoRA call
    with its id (engine/lora_calls.py, which also keeps the adapters' names for the gateway);
  - the pump task fails queued requests whose deadline passed and releases queued requests to the
    core as the front door allows;
  - the watcher task notices the core process exiting: `dead` turns True and every accepted request
    raises EngineDeadError. The server then exits non-zero; the orchestrator restarts it.

Nothing is dropped silently: every accepted request ends with a finished output or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from inferd.admission.front_door import FrontDoor
from inferd.config import AdmissionConfig, EngineConfig, Environment, read_environment
from inferd.engine.core_client import EngineCoreClient
from inferd.engine.generate_request import GenerateRequest
from inferd.engine.info import EngineInfo, EngineStats
from inferd.engine.lora_calls import LoRACalls, raise_for
from inferd.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreEvent,
    CoreStats,
    EngineCoreRequest,
    EngineOutputs,
    KVBlocks,
    KVBlocksRequest,
    LoRAReply,
)
from inferd.engine.streams import QUEUE_TIMEOUT_MESSAGE, RequestStream, StreamTable
from inferd.errors import DrainingError, EngineDeadError, QueueTimeoutError
from inferd.lora.request import LoRARequest
from inferd.preprocess.tokenizer import Tokenizer
from inferd.types import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger("inferd.engine.async")


class AsyncLLM:
    """Use `await AsyncLLM.start(...)`; the constructor only binds the sockets."""

    def __init__(
        self, config: EngineConfig, limits: AdmissionConfig, served_model_name: str | None
    ) -> None:
        self.config = config
        self.limits = limits
        self.model_name = served_model_name or config.model.model
        self.info: EngineInfo
        self.tokenizer: Tokenizer
        self._core = EngineCoreClient()
        self._door: FrontDoor[AddRequest] = FrontDoor(limits, config.scheduler.max_num_seqs)
        self._streams = StreamTable(limits.max_pending_output_tokens)
        self._core_stats = CoreStats()
        self._pump_wake = asyncio.Event()
        # `kv_blocks` calls waiting for the core's answer, oldest first.
        self._kv_blocks_waiters: deque[asyncio.Future[KVBlocks]] = deque()
        self._loras = LoRACalls()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._draining = False
        self._dead = False
        self._died = asyncio.Event()  # set with _dead, for `wait_dead`
        self._closed = False
        self._death_reason = "the engine core process exited"

    # -- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        limits: AdmissionConfig | None = None,
        *,
        served_model_name: str | None = None,
        start_timeout_s: float = 600.0,
        env: Environment | None = None,
    ) -> AsyncLLM:
        """Spawns the engine core, waits until its model is loaded, starts the front's tasks.
        `env`: the environment the server read at start-up (read here when not given)."""
        self = cls(config, limits or AdmissionConfig(), served_model_name)
        try:
            ready = await self._core.start(
                config,
                env or read_environment(),
                start_timeout_s,
                on_event=self._on_event,
                on_broken=self._on_broken,
            )
            self.tokenizer = await asyncio.to_thread(
                Tokenizer.from_pretrained, Path(ready.tokenizer_path)
            )
        except BaseException:
            await self.shutdown()
            raise
        self.info = ready.info
        self._loras.reset(ready.loras)
        self._tasks = [
            asyncio.create_task(self._pump(), name="inferd-pump"),
            asyncio.create_task(self._watch(), name="inferd-watcher"),
        ]
        self._started = True
        return self

    @property
    def ready(self) -> bool:
        """Loaded, admitting, and the engine core is alive."""
        return self._started and not self._draining and not self.dead

    @property
    def dead(self) -> bool:
        return self._dead

    async def wait_dead(self) -> None:
        """Returns once the engine is dead (its core exited) or shut down."""
        await self._died.wait()

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting; waits up to `timeout_s` for accepted requests, then aborts the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and not self._dead and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in self._streams:
            await self.abort(rid)
        # Aborts finish within one step; give the reader that long to deliver them.
        grace = time.monotonic() + 1.0
        while self._streams and not self._dead and time.monotonic() < grace:
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        """Fails what is still in flight, stops the core (gently, then by force), cleans up."""
        if self._closed:
            return
        self._closed = True
        self._draining = True
        self._fail_all(EngineDeadError("the engine was shut down"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._core.stop()
        self._dead = True
        self._died.set()
        self._core.close()

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yields DELTA outputs; the last has finished=True.

        Raises before the first yield: QueueFullError, DrainingError, EngineDeadError,
        QueueTimeoutError (the deadline passed before the request was scheduled), and
        InvalidRequestError if the engine rejects it. Closing the iterator early aborts the
        request in the engine."""
        stream = self._admit(request)
        try:
            while True:
                out = await stream.next()
                if out.finished:
                    self._door.record_finish(time.monotonic())
                yield out
                if out.finished:
                    return
        finally:
            self._release(stream)

    async def abort(self, request_id: str) -> None:
        """Ends a request: it gets a finished output with finish_reason "abort"."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream.in_engine:
            self._core.send(AbortRequests([request_id]))
            return
        entry = self._door.remove(request_id)
        self._streams.pop(request_id)
        if entry is not None:
            stream.deliver(_aborted_output(entry.item))

    async def kv_blocks(
        self, limit: int, recent_s: float = 0.0, timeout_s: float = 5.0
    ) -> KVBlocks:
        """The prefix cache's block digest (messages.KVBlocks), read by the core between two
        steps. Raises EngineDeadError when the core is gone, TimeoutError past `timeout_s`."""
        if self._dead or not self._started:
            raise EngineDeadError(self._death_reason if self._dead else "the engine is loading")
        waiter: asyncio.Future[KVBlocks] = asyncio.get_running_loop().create_future()
        if not self._core.send(KVBlocksRequest(limit, recent_s)):
            raise EngineDeadError(self._death_reason)
        self._kv_blocks_waiters.append(waiter)
        return await asyncio.wait_for(waiter, timeout_s)

    # -- LoRA adapters ---------------------------------------------------------------------------

    def lora(self, name: str) -> LoRARequest | None:
        """The registered adapter named `name` (the front's cache: no round trip)."""
        return self._loras.get(name)

    def loras(self) -> list[LoRARequest]:
        """The registered adapters as the front knows them (the cache)."""
        return self._loras.all()

    def next_lora_id(self) -> int:
        """A fresh `lora_int_id` for an adapter loaded at run time."""
        return self._loras.next_id()

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Registers and loads an adapter; returns once it has loaded. Raises
        InvalidRequestError with the reason when the engine refuses it (then it is not
        registered), EngineDeadError when the core is gone."""
        message, reply = self._loras.add(lora_request)
        raise_for(await self._lora_call(message, reply))

    async def remove_lora(self, lora_name: str) -> bool:
        """Unregisters an adapter at once (requests using it finish first); False if unknown."""
        message, reply = self._loras.remove(lora_name)
        done = await self._lora_call(message, reply)
        raise_for(done)
        return done.error_type != "not_found"

    async def list_loras(self) -> list[LoRARequest]:
        """The engine's registered adapters (and the front's cache set from them)."""
        message, reply = self._loras.list()
        done = await self._lora_call(message, reply)
        raise_for(done)
        self._loras.reset(done.loras)
        return done.loras

    async def _lora_call(
        self, message: EngineCoreRequest, reply: asyncio.Future[LoRAReply]
    ) -> LoRAReply:
        if self._dead or not self._started or not self._core.send(message):
            self._loras.forget(reply)
            raise EngineDeadError(self._death_reason if self._dead else "the engine is loading")
        return await reply

    def stats(self) -> EngineStats:
        s = self._core_stats
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            queued=len(self._door),
            queued_prompt_tokens=self._door.num_prompt_tokens,
            kv_cache_usage=s.kv_cache_usage,
            step_num_batched_tokens=s.step_num_batched_tokens,
            step_num_seqs=s.step_num_seqs,
            step_token_budget=s.step_token_budget,
            num_preemptions_total=s.num_preemptions_total,
            num_steps_total=s.num_steps_total,
            in_flight=len(self._streams),
            prefix_cache_queries_tokens_total=s.prefix_cache_queries_tokens_total,
            prefix_cache_hits_tokens_total=s.prefix_cache_hits_tokens_total,
            grammar_cache_hits_total=s.grammar_cache_hits_total,
            grammar_cache_misses_total=s.grammar_cache_misses_total,
            spec_decode_num_drafts_total=s.spec_decode_num_drafts_total,
            spec_decode_num_draft_tokens_total=s.spec_decode_num_draft_tokens_total,
            spec_decode_num_accepted_tokens_total=s.spec_decode_num_accepted_tokens_total,
            spec_decode_accepted_per_pos=s.spec_decode_accepted_per_pos,
            cache_config=self.info.cache_config_labels() if self._started else (),
        )

    def _admit(self, request: GenerateRequest) -> RequestStream:
        self._check_admitting()
        stream = self._streams.open(request)
        now = time.monotonic()
        message = AddRequest(
            request_id=request.request_id,
            prompt_token_ids=stream.prompt_token_ids,
            params=request.params,
            prompt=request.prompt,
            priority=request.priority,
            arrival_time=now,
            deadline=self._door.deadline_for(now, request.timeout_s),
            lora_request=request.lora_request,
        )
        try:
            self._door.enqueue(
                request.request_id,
                message,
                num_prompt_tokens=len(message.prompt_token_ids),
                priority=request.priority,
                deadline=message.deadline,
            )
        except BaseException:
            self._streams.close(stream)
            raise
        self._pump_wake.set()
        return stream

    def _check_admitting(self) -> None:
        if self._dead:
            raise EngineDeadError(self._death_reason)
        if not self._started:
            raise EngineDeadError("the engine is not started")
        if self._draining:
            raise DrainingError("the server is shutting down and accepts no new requests")

    def _release(self, stream: RequestStream) -> None:
        """The generator is done (finished, failed, closed or cancelled)."""
        if not self._streams.close(stream):
            return
        if stream.in_engine:
            if not self._dead and not self._closed:
                self._core.send(AbortRequests([stream.request_id]))
        else:
            self._door.remove(stream.request_id)

    # -- the core's messages, the pump and the watcher -------------------------------------------

    def _on_event(self, event: CoreEvent) -> None:
        if isinstance(event, KVBlocks):
            self._on_kv_blocks(event)
        elif isinstance(event, LoRAReply):
            self._loras.on_reply(event)
        else:
            self._on_outputs(event)

    def _on_broken(self, reason: str) -> None:
        """A broken message stream is as fatal as a dead core (but expected once shut down)."""
        if not self._closed and not self._dead:
            logger.error("%s", reason)
            self._on_death(reason)

    def _on_outputs(self, event: EngineOutputs) -> None:
        self._core_stats = event.stats
        for out in event.outputs:
            if self._streams.dispatch(out):
                self._core.send(AbortRequests([out.request_id]))
        for rejected in event.rejected:
            self._streams.reject(rejected)
        if self._door:  # the engine's room changed; with nothing queued there is nothing to do
            self._pump_wake.set()

    def _on_kv_blocks(self, event: KVBlocks) -> None:
        if self._kv_blocks_waiters:
            waiter = self._kv_blocks_waiters.popleft()
            if not waiter.done():  # a caller that timed out has gone
                waiter.set_result(event)

    async def _pump(self) -> None:
        while True:
            now = time.monotonic()
            for entry in self._door.expire(now):
                self._streams.fail(entry.request_id, QueueTimeoutError(QUEUE_TIMEOUT_MESSAGE))
            self._release_queued()
            wait = self._door.time_to_next_deadline(now)
            self._pump_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pump_wake.wait(), None if wait == math.inf else wait)

    def _release_queued(self) -> None:
        if self._dead:
            return
        for entry in self._door.release(self._core_stats, self._streams.__contains__):
            stream = self._streams.get(entry.request_id)
            assert stream is not None, "released only while its stream is open"
            stream.in_engine = True
            self._core.send(entry.item)

    async def _watch(self) -> None:
        code = await self._core.wait_exit()
        if not self._closed:
            logger.error("the engine core process exited with code %s", code)
            self._on_death(f"the engine core process exited with code {code}")

    def _on_death(self, reason: str) -> None:
        self._dead = True
        self._died.set()
        self._death_reason = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: Exception) -> None:
        self._door.clear()
        self._streams.fail_all(error)
        while self._kv_blocks_waiters:
            waiter = self._kv_blocks_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        self._loras.fail_all(error)


def _aborted_output(message: AddRequest) -> RequestOutput:
    """The final output of a request aborted before it reached the engine."""
    return RequestOutput(
        request_id=message.request_id,
        prompt=message.prompt,
        prompt_token_ids=message.prompt_token_ids,
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(message.params.n)
        ],
        finished=True,
        metrics=RequestMetrics(arrival_time=message.arrival_time or 0.0),
    )
