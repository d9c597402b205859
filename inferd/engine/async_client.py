"""AsyncLLM: the server's asyncio front to an engine core running in its own process.

    llm = await AsyncLLM.start(EngineConfig(), AdmissionConfig())
    async for delta in llm.generate("r1", ids, SamplingParams(max_tokens=8)):
        print(delta.outputs[0].text, end="")
    await llm.shutdown()

Three tasks run beside the callers' generators:
  - the reader takes EngineOutputs off the output socket and merges each DELTA output into its
    stream's pending delta (text appended, token ids and logprobs extended), then sets the
    stream's event. A slow consumer only grows its own pending delta; past
    `max_pending_output_tokens` unread tokens its request is aborted (OutputBacklogError).
  - the pump moves requests from the admission queue to the core while the core's backlog is
    small (see `_engine_room`), and fails queued requests whose deadline passed.
  - the watcher notices the core process exiting: `dead` turns True and every accepted request
    raises EngineDeadError. The server then exits non-zero; the orchestrator restarts it.

Nothing is dropped silently: every accepted request ends with a finished output or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from inferd.admission.queue import AdmissionQueue
from inferd.admission.retry_after import CompletionRate
from inferd.admission.timeouts import deadline_at
from inferd.config import AdmissionConfig, EngineConfig
from inferd.engine.core_proc import run_engine_core
from inferd.engine.info import EngineInfo, EngineStats
from inferd.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
    EngineCoreEvent,
    EngineCoreRequest,
    EngineOutputs,
    RejectedRequest,
    ShutdownCore,
)
from inferd.errors import (
    DrainingError,
    EngineDeadError,
    InferdError,
    InvalidRequestError,
    ModelLoadError,
    OutputBacklogError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams
from inferd.telemetry.timeline import RequestTimeline
from inferd.types import CompletionOutput, RequestMetrics, RequestOutput, RequestStatus

logger = logging.getLogger("inferd.engine.async")

_WATCH_INTERVAL_S = 0.1
_SHUTDOWN_GRACE_S = 5.0
# Past this KV usage the core gets only `min_engine_waiting` more: the rest wait in the front,
# where priority, deadlines and bounds apply.
_KV_HIGH_WATERMARK = 0.9


@dataclass(eq=False)
class _Stream:
    """One accepted request, as its generator and the reader share it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: RequestOutput | None = None
    pending_tokens: int = 0
    error: BaseException | None = None
    done: bool = False  # a finished output or an error is recorded; nothing more will come
    in_engine: bool = False
    num_yielded: int = 0
    timeline: RequestTimeline | None = None

    def deliver(self, out: RequestOutput) -> None:
        self.pending_tokens += sum(len(c.token_ids) for c in out.outputs)
        if self.pending is None:
            self.pending = out
        else:
            _merge(self.pending, out)
        self.done = self.done or out.finished
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self.done = True
            self.event.set()


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
        self._dir = Path(tempfile.mkdtemp(prefix="inferd-ipc-"))
        self._input_address = f"ipc://{self._dir / 'input'}"
        self._output_address = f"ipc://{self._dir / 'output'}"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        # Sends never block: unbounded high-water mark, and a send is a memcpy into zmq's queue.
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(self._input_address)
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self._proc: BaseProcess | None = None
        self._queue: AdmissionQueue[AddRequest] = AdmissionQueue(
            limits.max_queued_requests, limits.max_queued_tokens
        )
        self._streams: dict[str, _Stream] = {}
        self._core_stats = CoreStats()
        self._num_sent = 0
        self._pump_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._completions = CompletionRate(window=256)
        self._started = False
        self._draining = False
        self._dead = False
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
    ) -> AsyncLLM:
        """Spawns the engine core, waits until its model is loaded, starts the front's tasks."""
        self = cls(config, limits or AdmissionConfig(), served_model_name)
        try:
            ready = await self._launch(start_timeout_s)
            self.tokenizer = await asyncio.to_thread(
                Tokenizer.from_pretrained, Path(ready.tokenizer_path)
            )
        except BaseException:
            await self.shutdown()
            raise
        self.info = ready.info
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="inferd-reader"),
            asyncio.create_task(self._pump(), name="inferd-pump"),
            asyncio.create_task(self._watch(), name="inferd-watcher"),
        ]
        self._started = True
        return self

    async def _launch(self, timeout_s: float) -> CoreReady:
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, self._input_address, self._output_address),
            name="inferd-engine-core",
            daemon=True,
        )
        self._proc = proc
        await asyncio.to_thread(proc.start)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(TimeoutError):
                frame = await asyncio.wait_for(self._output.recv(), _WATCH_INTERVAL_S)
                return _ready_or_raise(self._decoder.decode(frame))
            if not proc.is_alive():
                raise EngineDeadError(
                    f"the engine core exited with code {proc.exitcode} while loading the model"
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not load the model in {timeout_s} s")

    @property
    def ready(self) -> bool:
        """Loaded, admitting, and the engine core is alive."""
        return self._started and not self._draining and not self.dead

    @property
    def dead(self) -> bool:
        return self._dead

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting; waits up to `timeout_s` for accepted requests, then aborts the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and not self._dead and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
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
        await self._stop_process()
        self._dead = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            self._send(ShutdownCore())
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.terminate()
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()
            await _wait_exit(proc, _SHUTDOWN_GRACE_S)
        proc.join(timeout=0)

    # -- requests ------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        timeline: RequestTimeline | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields DELTA outputs; the last has finished=True.

        Raises before the first yield: QueueFullError, DrainingError, EngineDeadError,
        QueueTimeoutError (the deadline passed before the request was scheduled), and
        InvalidRequestError if the engine rejects it. Closing the iterator early aborts the
        request in the engine."""
        stream = self._admit(request_id, prompt_token_ids, params, prompt, priority, timeout_s)
        stream.timeline = timeline
        try:
            while True:
                out = await self._next(stream)
                stream.num_yielded += 1
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
            self._send(AbortRequests([request_id]))
            return
        entry = self._queue.remove(request_id)
        del self._streams[request_id]
        if entry is not None:
            stream.deliver(_aborted_output(entry.item))

    def stats(self) -> EngineStats:
        s = self._core_stats
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            queued=len(self._queue),
            queued_prompt_tokens=self._queue.num_prompt_tokens,
            kv_cache_usage=s.kv_cache_usage,
            step_num_batched_tokens=s.step_num_batched_tokens,
            step_num_seqs=s.step_num_seqs,
            num_preemptions_total=s.num_preemptions_total,
            num_steps_total=s.num_steps_total,
            in_flight=len(self._streams),
        )

    def _admit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        priority: int,
        timeout_s: float | None,
    ) -> _Stream:
        self._check_admitting()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "id")
        now = time.monotonic()
        deadline = deadline_at(now, self.limits.request_timeout_s, timeout_s)
        message = AddRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            prompt=prompt,
            priority=priority,
            arrival_time=now,
            deadline=deadline,
        )
        try:
            self._queue.push(
                request_id,
                message,
                num_prompt_tokens=len(prompt_token_ids),
                priority=priority,
                deadline=deadline,
            )
        except QueueFullError as e:
            e.retry_after = self._completions.retry_after(len(self._queue))
            raise
        stream = _Stream(request_id, prompt, message.prompt_token_ids)
        self._streams[request_id] = stream
        self._pump_wake.set()
        return stream

    def _check_admitting(self) -> None:
        if self._dead:
            raise EngineDeadError(self._death_reason)
        if not self._started:
            raise EngineDeadError("the engine is not started")
        if self._draining:
            raise DrainingError("the server is shutting down and accepts no new requests")

    async def _next(self, stream: _Stream) -> RequestOutput:
        """The next coalesced delta; pending output is delivered before a recorded error."""
        while True:
            out = stream.pending
            if out is not None:
                stream.pending, stream.pending_tokens = None, 0
                self._on_yield(stream, out)
                return out
            if stream.error is not None:
                raise stream.error
            stream.event.clear()
            await stream.event.wait()

    def _on_yield(self, stream: _Stream, out: RequestOutput) -> None:
        if stream.timeline is not None:
            stream.timeline.update_from_engine(out.metrics, stream.request_id)
        if out.finished:
            self._completions.record(time.monotonic())
        # The engine core sends neither the prompt nor its ids back (the front has both).
        if out.prompt is None:
            out.prompt = stream.prompt
        if not out.prompt_token_ids:
            out.prompt_token_ids = stream.prompt_token_ids

    def _release(self, stream: _Stream) -> None:
        """The generator is done (finished, failed, closed or cancelled)."""
        if self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        if stream.in_engine:
            if not self._dead and not self._closed:
                self._send(AbortRequests([stream.request_id]))
        else:
            self._queue.remove(stream.request_id)

    # -- the three tasks -----------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                frame = await self._output.recv(copy=False)
                event = self._decoder.decode(frame.buffer)
                if isinstance(event, EngineOutputs):
                    self._on_outputs(event)
        except asyncio.CancelledError:
            raise
        except Exception:  # a broken message stream is as fatal as a dead core
            logger.exception("the engine output reader failed")
            self._on_death("the engine output stream failed")

    def _on_outputs(self, event: EngineOutputs) -> None:
        self._core_stats = event.stats
        for out in event.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                self._dispatch(stream, out)
        for rejected in event.rejected:
            stream = self._streams.pop(rejected.request_id, None)
            if stream is not None:
                stream.fail(_rejection_error(rejected))
        self._pump_wake.set()

    def _dispatch(self, stream: _Stream, out: RequestOutput) -> None:
        if out.finished:
            del self._streams[stream.request_id]
            if _expired_waiting(out) and stream.num_yielded == 0 and stream.pending is None:
                stream.fail(QueueTimeoutError(_QUEUE_TIMEOUT_MESSAGE))
                return
        stream.deliver(out)
        if stream.pending_tokens > self.limits.max_pending_output_tokens and not out.finished:
            del self._streams[stream.request_id]
            self._send(AbortRequests([stream.request_id]))
            stream.pending = None
            stream.fail(
                OutputBacklogError(
                    f"the client read too slowly: more than "
                    f"{self.limits.max_pending_output_tokens} output tokens were waiting unread, "
                    "so the request was aborted"
                )
            )

    async def _pump(self) -> None:
        while True:
            now = time.monotonic()
            for entry in self._queue.expire(now):
                stream = self._streams.pop(entry.request_id, None)
                if stream is not None:
                    stream.fail(QueueTimeoutError(_QUEUE_TIMEOUT_MESSAGE))
            self._release_queued()
            wait = self._queue.time_to_next_deadline(now)
            self._pump_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pump_wake.wait(), None if wait == math.inf else wait)

    def _release_queued(self) -> None:
        if self._dead:
            return
        room = self._engine_room()
        while room > 0:
            entry = self._queue.pop()
            if entry is None:
                return
            stream = self._streams.get(entry.request_id)
            if stream is None:
                continue
            stream.in_engine = True
            self._send(entry.item)
            self._num_sent += 1
            room -= 1

    def _engine_room(self) -> int:
        """How many more requests the core should get now.

        Its backlog is what waits in its scheduler plus what is sent but not yet received. It
        may hold enough to fill every free sequence slot (so a burst batches as offline does),
        and only `min_engine_waiting` once KV memory is nearly full."""
        s = self._core_stats
        backlog = s.num_waiting + (self._num_sent - s.num_added_total)
        target = self.limits.min_engine_waiting
        if s.kv_cache_usage < _KV_HIGH_WATERMARK:
            free_slots = self.config.scheduler.max_num_seqs - s.num_running
            target = max(target, free_slots)
        return target - backlog

    async def _watch(self) -> None:
        proc = self._proc
        assert proc is not None
        while proc.is_alive():
            await asyncio.sleep(_WATCH_INTERVAL_S)
        if not self._closed:
            logger.error("the engine core process exited with code %s", proc.exitcode)
            self._on_death(f"the engine core process exited with code {proc.exitcode}")

    def _on_death(self, reason: str) -> None:
        self._dead = True
        self._death_reason = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: Exception) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        while self._queue.pop() is not None:
            pass
        for stream in streams:
            stream.fail(error)

    def _send(self, message: EngineCoreRequest) -> None:
        self._input.send(self._encoder.encode(message), copy=False)


_QUEUE_TIMEOUT_MESSAGE = "the request's deadline passed before it was scheduled"


def _ready_or_raise(event: EngineCoreEvent) -> CoreReady:
    if isinstance(event, CoreReady):
        return event
    if isinstance(event, CoreFailed):
        raise ModelLoadError(f"the engine failed to start: {event.error_type}: {event.message}")
    raise EngineDeadError(f"unexpected first message from the engine core: {type(event).__name__}")


async def _wait_exit(proc: BaseProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _merge(into: RequestOutput, new: RequestOutput) -> None:
    """Coalesces delta `new` into the unread delta `into` (same request, later step)."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
        else:
            _merge_choice(old, c)
    into.finished = new.finished
    into.metrics = new.metrics


def _merge_choice(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
    old.cumulative_logprob = new.cumulative_logprob


def _expired_waiting(out: RequestOutput) -> bool:
    """The engine says the request's deadline passed before its first token (a queue timeout)."""
    return all(c.status is RequestStatus.FINISHED_EXPIRED_WAITING for c in out.outputs)


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


def _rejection_error(rejected: RejectedRequest) -> Exception:
    if rejected.error_type == "invalid_request":
        return InvalidRequestError(rejected.message, rejected.param)
    return InferdError(f"the engine could not take the request: {rejected.message}")
