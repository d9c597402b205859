"""ServedModel: one loaded model version, from a decoded request to its response (the
orchestrator; the batch's array work is assembler.py's, when a batch runs batcher.py's).

    validate (event loop) -> preprocess steps (preprocess thread pool)
      -> DynamicBatcher queue -> batch formation (event loop)
      -> compute_input (concatenate + pad) -> backend.infer -> compute_output (split rows)
         -> postprocess steps -> requested outputs / classification      (one worker thread)
      -> futures resolved (event loop)

Performance rules: the event loop runs only validation and bookkeeping; the requests that
arrive in one loop iteration go to the preprocess pool together (one hop there and one back per
group of up to 8, not per request: each hand-off wakes a thread, which on a busy machine
preempts the loop; none without preprocess steps), and a batch makes one hop to a worker and
one back, whatever its size. A request that would run at once and alone (the
batcher is idle: a worker free, nothing queued or preprocessing, arrivals slower than a batch
runs) skips the pool: its worker runs the preprocess steps before the model, so a lone request
costs two thread wake-ups instead of four (each one a scheduling delay on a busy machine).
Every accepted request ends in exactly one of: a response, or an InferdError (nothing is
dropped, even when the model stops).

Failure isolation: a request that fails validation fails alone before queueing; when the
backend raises on a batch of several requests, each is re-run alone on the same worker and only
those that fail alone get the error (InvalidRequestError stays a 400; anything else becomes
BackendError, a 500).

Variable-length inputs (a -1 dim beyond the batch dim): requests are bucketed by the next power
of two of their longest variable dim, so the requests of one bucket differ at most 2x in length.
A batch with rows to spare also takes requests of other buckets while its padding ratio stays
<= dynamic_batching.max_padding_ratio (see inferd.batching.batcher). The batch is padded with
zeros to its longest request and the padding ratio is reported.
Postprocess steps see the request's rows of the *padded* inputs, so mean pooling weighs by an
attention_mask of the same length as the hidden states.
"""

# Over 500 lines because ServedModel is the request's life in order (validate, preprocess on the
# pool or the worker, enqueue, run a batch, respond), one short method per step; its array work
# is already assembler.py's and its scheduling batcher.py's.

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from inferd.backends.base import Backend, FastAlone
from inferd.batching.assembler import (
    BackendError,
    OutputSelector,
    assemble,
    backend_error,
    check_rows,
    num_tokens,
    outcome_of,
    place,
    request_rows,
    split_private,
    split_rows,
    step_error,
    synthetic_batch,
)
from inferd.batching.batcher import DynamicBatcher, Queued
from inferd.batching.cost import CallCost, FixedCallCost, calibrate
from inferd.batching.pace import Pace
from inferd.batching.rules import (
    DEFAULT_LIMITS,
    QueueLimits,
    batch_policy,
    known_outputs,
    queue_rules,
    variable_dims,
)
from inferd.batching.validate import InputValidator, check_requested_outputs
from inferd.errors import (
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.model_config import ModelRepoConfig
from inferd.steps.base import Step
from inferd.telemetry.request_log import log_id
from inferd.telemetry.stages import Stage, StageTimings
from inferd.tensors import DATATYPES, InferRequest, InferResponse

if TYPE_CHECKING:
    from inferd.telemetry.model_metrics import ModelObserver

__all__ = ["BackendError", "QueueLimits", "ServedModel", "batch_policy", "queue_rules"]

logger = logging.getLogger(__name__)

# Preprocess (tokenize, image decode) threads per model; created on first use.
_PREPROCESS_THREADS = max(2, min(8, os.cpu_count() or 1))
# Requests per preprocess task: a burst's arrivals share hand-offs, and still spread over the
# pool's threads.
_PREPROCESS_GROUP = 8

State = Literal["new", "ready", "stopping", "stopped"]


@dataclass(eq=False, slots=True)
class _Work:
    """One accepted request on its way through the pipeline."""

    request: InferRequest
    future: asyncio.Future[InferResponse]
    timings: StageTimings
    rows: int
    priority: int
    deadline: float | None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # model inputs
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # `__` tensors
    key: Hashable = 0  # length bucket
    length: int = 0  # longest variable dim (0: none)
    group: Hashable = None  # which buckets may share a batch (None: all)
    num_tokens: int | None = None
    queued: Queued[_Work] | None = None
    result: InferResponse | BaseException | None = None  # set on the worker thread
    # The ids of the requests of the batch it ran in, itself included (set on the worker thread;
    # a list the caller of infer() holds, so its report can name the batch mates).
    batch: list[str] = field(default_factory=list)
    # The id the request log knows it by (the HTTP X-Request-Id, else the protocol's own id).
    log_id: str = ""
    unprepared: bool = False  # its preprocess steps run on the batch's worker (runs alone)


# (rows, padding ratio) of each backend call a batch made.
_Executed = list[tuple[int, float]]


class ServedModel:
    """One loaded model version: validate -> preprocess -> enqueue -> run_batch -> respond.

    The methods below follow a request in that order; the array work of a batch (stacking,
    padding, splitting rows, selecting and casting outputs) is batching/assembler.py's, the
    decision when a batch runs batching/batcher.py's.
    """

    def __init__(
        self,
        name: str,
        version: str,
        config: ModelRepoConfig,
        backends: Sequence[Backend],
        preprocess: Sequence[Step] = (),
        postprocess: Sequence[Step] = (),
        labels: Mapping[str, Sequence[str]] | None = None,
        observer: ModelObserver | None = None,
        limits: QueueLimits = DEFAULT_LIMITS,
        pace: Pace | None = None,  # when a partial batch waits; None: MeasuredPace
        cost: CallCost | None = None,  # which lengths share a batch; None: calibrated at start
    ) -> None:
        if len(backends) < 1:
            raise ValueError("a served model needs at least one backend")
        self.name = name
        self.version = version
        self.config = config
        self._backends = list(backends)
        self._pre = list(preprocess)
        self._post = list(postprocess)
        self._observer = observer
        declared = backends[0].inputs()
        # With preprocess steps the client's inputs are the config's, not the model file's.
        self._validator = InputValidator(config, () if self._pre else declared)
        self._rules = queue_rules(config, limits)
        self._variable = variable_dims(config, declared, has_preprocess=bool(self._pre))
        self._keyed_by_names = any(t.optional for t in config.input)
        self._known_outputs = known_outputs(config, backends[0], has_postprocess=bool(self._post))
        self._batched = config.max_batch_size > 0
        self._cost = cost  # None: calibrated at start (inferd.batching.cost)
        self._outputs = OutputSelector(
            config_outputs=tuple(t.name for t in config.output),
            output_types={t.name: t.data_type for t in config.output},
            known=self._known_outputs,
            labels={name: list(lines) for name, lines in (labels or {}).items()},
            batched=self._batched,
        )
        self._batcher: DynamicBatcher[_Work, Backend, _Executed] = DynamicBatcher(
            batch_policy(config, limits),
            self._backends,
            run=self._run_batch,
            done=self._finish_batch,
            expired=self._expire,
            name=name,
            pace=pace,
            cost=cost,
        )
        self._state: State = "new"
        self._live: set[asyncio.Future[InferResponse]] = set()
        self._idle: asyncio.Event | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._preprocessing = 0  # requests in the preprocess pool: they count against the bound
        self._to_preprocess: list[_Work] = []  # this loop iteration's, sent at its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pre_pool: ThreadPoolExecutor | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def platform(self) -> str:
        return self._backends[0].platform

    @property
    def ready(self) -> bool:
        return self._state == "ready"

    @property
    def call_overhead(self) -> float | None:
        """A backend call's fixed cost in padded elements, timed at start (inferd.batching.cost);
        None: not known (no variable-length inputs, or the model could not be timed)."""
        return self._batcher.cost.overhead_elements()

    @property
    def inflight(self) -> int:
        """Accepted requests not yet answered (preprocessing, queued or running)."""
        return len(self._live)

    async def start(self) -> None:
        if self._state != "new":
            return
        self._loop = asyncio.get_running_loop()
        if self._cost is None and self._variable and self._batcher.policy.dynamic:
            overhead = await asyncio.to_thread(self._calibrate)
            self._batcher.cost = FixedCallCost(overhead)
        self._batcher.start()
        if self._pre:
            self._pre_pool = ThreadPoolExecutor(
                _PREPROCESS_THREADS, thread_name_prefix=f"inferd-{self.name}-pre"
            )
        self._state = "ready"

    def _calibrate(self) -> float | None:
        """A backend call's overhead in padded elements (inferd.batching.cost), timed on
        zero-filled batches before the model takes requests; None when it cannot be known."""
        if any(len(dims) > 1 for dims in self._variable.values()):
            return None  # a call's cost is not rows x longest where two dims vary (an image's)
        backend = self._backends[0]
        specs = backend.inputs()
        if not specs or any(s.datatype not in DATATYPES or s.datatype == "BYTES" for s in specs):
            return None  # no zeros of BYTES (or of an unknown type) for a synthetic batch

        def run(rows: int, length: int) -> object:
            return backend.infer(synthetic_batch(specs, self._variable, rows, length))

        try:
            overhead = calibrate(run, self._batcher.policy.max_batch_size)
        except Exception as exc:  # a model that rejects zeros keeps its length buckets
            logger.info("model %s: no call cost from a synthetic batch (%r)", self.name, exc)
            return None
        if overhead is not None:
            logger.info(
                "model %s: a backend call costs as much as %.1f padded elements",
                self.name,
                overhead,
            )
        return overhead

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Admits nothing new; accepted requests get up to `timeout_s` to finish, then fail with
        ModelNotReadyError; the workers stop and the backends are closed. Concurrent calls all
        return when that is done."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(timeout_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, timeout_s: float) -> None:
        started = self._state == "ready"
        self._state = "stopping"
        if self._live:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        for future in list(self._live):
            _fail(future, self._not_ready("was stopped before the request finished"))
        self._state = "stopped"
        if started:
            await self._batcher.close()
        else:
            await asyncio.gather(*(asyncio.to_thread(b.close) for b in self._backends))
        if self._pre_pool is not None:
            self._pre_pool.shutdown(wait=False)

    def _not_ready(self, what: str) -> ModelNotReadyError:
        return ModelNotReadyError(f"model {self.name!r} version {self.version} {what}")

    # -- the request path (event loop) -------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        timings = StageTimings()
        batch: list[str] = []
        outcome: str | None = "error"
        try:
            response = await self._infer(request, timings, batch)
            outcome = "success"
            return response
        except asyncio.CancelledError:
            outcome = None  # the client went away; no outcome to count
            raise
        except BaseException as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            if outcome is not None and self._observer is not None:
                self._observe_request(timings, outcome, batch)

    async def _infer(
        self, request: InferRequest, timings: StageTimings, batch: list[str]
    ) -> InferResponse:
        if self._state != "ready":
            raise self._not_ready("is not ready" if self._state == "new" else "is stopping")
        work = self._validate(request, timings)
        work.batch = batch
        future = work.future
        self._live.add(future)
        try:
            if self._pre_pool is None:
                work.tensors, work.extras = split_private(request.inputs)
                self._place(work)
                self._enqueue(work)
            elif not self._preprocessing and self._batcher.idle():
                # It will run alone: a bucket of its own that nothing fills (group and key are
                # the work itself, length 0), preprocessed on the worker.
                work.unprepared = True
                work.key = work.group = work
                self._enqueue(work)
            else:
                self._batcher.check_room(self._preprocessing)
                self._preprocessing += 1
                self._to_preprocess.append(work)
                if len(self._to_preprocess) == 1:
                    asyncio.get_running_loop().call_soon(self._send_to_preprocess)
            return await future
        except asyncio.CancelledError:
            if work.queued is not None:
                self._batcher.remove(work.queued)
            raise
        finally:
            self._live.discard(future)
            if self._idle is not None and not self._live:
                self._idle.set()

    def _validate(self, request: InferRequest, timings: StageTimings) -> _Work:
        """Everything that can be known wrong about a request before queueing (400s)."""
        start = time.monotonic()
        arrival = request.arrival or start
        rows = self._validator(request.inputs)
        check_requested_outputs(request.outputs, self._known_outputs)
        priority = self._rules.priority(request.priority)
        timeout = self._rules.timeout_s(request.timeout_us)
        assert self._loop is not None
        work = _Work(
            request,
            self._loop.create_future(),
            timings,
            rows,
            priority,
            None if timeout is None else arrival + timeout,
            log_id=log_id(request.id),
        )
        timings.set(Stage.VALIDATE, time.monotonic() - start, start)
        return work

    def _send_to_preprocess(self) -> None:
        works, self._to_preprocess = self._to_preprocess, []
        assert self._pre_pool is not None
        for i in range(0, len(works), _PREPROCESS_GROUP):
            self._pre_pool.submit(self._preprocess, works[i : i + _PREPROCESS_GROUP])

    def _preprocess(self, works: list[_Work]) -> None:
        """Preprocess thread: runs the steps of each request, then hands the group back to the
        loop (one hop each way)."""
        assert self._loop is not None
        errors = [self._prepare(work) for work in works]
        for work, error in zip(works, errors, strict=True):
            if error is None:
                self._place(work)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._preprocessed, works, errors)

    def _prepare(self, work: _Work) -> BaseException | None:
        """Runs the preprocess steps (a preprocess or worker thread); returns the error."""
        start = time.monotonic()
        error: BaseException | None = None
        try:
            tensors = dict(work.request.inputs)
            for step in self._pre:
                tensors = step(tensors)
            work.tensors, work.extras = split_private(tensors)
            if self._batched:
                check_rows(work.tensors, work.rows)
            work.num_tokens = num_tokens(work.extras)
        except Exception as exc:
            error = step_error("preprocess", exc)
        work.timings.set(Stage.PREPROCESS, time.monotonic() - start, start)
        return error

    def _preprocessed(self, works: list[_Work], errors: list[BaseException | None]) -> None:
        self._preprocessing -= len(works)
        for work, error in zip(works, errors, strict=True):
            if error is None:
                self._enqueue(work)
            else:
                _fail(work.future, error)

    def _place(self, work: _Work) -> None:
        placement = place(work.tensors, self._variable, keyed_by_names=self._keyed_by_names)
        work.key, work.length, work.group = placement.key, placement.length, placement.group

    def _enqueue(self, work: _Work) -> None:
        if work.future.done():  # cancelled, or failed by stop() while preprocessing
            return
        if self._state == "stopped":
            _fail(work.future, self._not_ready("was stopped before the request was queued"))
            return
        try:
            work.queued = self._batcher.submit(
                work,
                rows=work.rows,
                key=work.key,
                length=work.length,
                group=work.group,
                priority=work.priority,
                deadline=work.deadline,
            )
        except QueueFullError as exc:
            work.future.set_exception(exc)

    def _expire(self, work: _Work) -> None:
        if work.queued is not None:
            enqueued = work.queued.enqueued
            work.timings.set(Stage.QUEUE, self._batcher.now() - enqueued, enqueued)
        _fail(work.future, QueueTimeoutError("the request's queue timeout passed before it ran"))

    # -- one batch (worker thread) -----------------------------------------------------------

    def _run_batch(self, backend: Backend, batch: list[Queued[_Work]]) -> _Executed:
        works = [queued.item for queued in batch]
        ids = [work.log_id for work in works]
        for queued in batch:
            # The wait tiles [enqueued, enqueued + queue_s + batch_s): queue, then batch formation.
            enqueued = queued.enqueued
            queued.item.timings.set(Stage.QUEUE, queued.queue_s, enqueued)
            queued.item.timings.set(Stage.BATCH, queued.batch_s, enqueued + queued.queue_s)
            queued.item.batch[:] = ids
        for work in works:
            if work.unprepared:
                work.result = self._prepare(work)  # None, or the request's 400/500
        executed: _Executed = []
        ready = [w for w in works if w.result is None]
        if ready:
            # Nothing else waiting (a racy read of the loop's count: a hint, not a decision).
            alone = len(ready) == 1 and not self._batcher.num_queued
            self._execute(backend, ready, executed, alone)
        return executed

    def _execute(
        self, backend: Backend, works: list[_Work], executed: _Executed, alone: bool = False
    ) -> None:
        """compute_input -> infer -> compute_output -> respond (per request); sets each work's
        `result`. A failed batch of several requests is re-run one request at a time. `alone`:
        a lone request with nothing queued, run by the backend's `infer_alone` if it has one."""
        t0 = time.monotonic()
        infer = backend.infer_alone if alone and isinstance(backend, FastAlone) else backend.infer
        try:
            inputs, ratio = assemble([w.tensors for w in works], self._variable)
            t1 = time.monotonic()
            outputs = infer(inputs)
        except Exception as exc:
            if len(works) > 1:
                logger.warning(
                    "model %s: a batch of %d failed (%r); re-running each alone",
                    self.name,
                    len(works),
                    exc,
                )
                for work in works:
                    self._execute(backend, [work], executed)
                return
            works[0].result = backend_error(exc)
            return
        t2 = time.monotonic()
        rows = [w.rows for w in works]
        executed.append((sum(rows), ratio))
        try:
            parts = split_rows(outputs, rows, batched=self._batched)
        except BackendError as exc:
            for work in works:
                work.result = exc
            return
        t3 = time.monotonic()
        offset = 0
        for work, outs in zip(works, parts, strict=True):
            work.timings.set(Stage.COMPUTE_INPUT, t1 - t0, t0)
            work.timings.set(Stage.INFER, t2 - t1, t1)
            work.timings.set(Stage.COMPUTE_OUTPUT, t3 - t2, t2)
            work.result = self._respond(work, inputs, offset, outs)
            offset += work.rows

    def _respond(
        self,
        work: _Work,
        inputs: Mapping[str, np.ndarray],
        offset: int,
        outs: dict[str, np.ndarray],
    ) -> InferResponse | BaseException:
        """Postprocess steps, then the outputs the request asked for (or its error)."""
        start = time.monotonic()
        try:
            tensors = outs
            if self._post:
                tensors = self._postprocess(work, inputs, offset, outs)
            selected = self._outputs.select(work.request.outputs, tensors)
        except Exception as exc:
            return step_error("postprocess", exc)
        if self._post or any(o.classification for o in work.request.outputs or ()):
            work.timings.set(Stage.POSTPROCESS, time.monotonic() - start, start)
        return InferResponse(
            self.name, self.version, work.request.id, selected, work.timings, work.num_tokens
        )

    def _postprocess(
        self,
        work: _Work,
        inputs: Mapping[str, np.ndarray],
        offset: int,
        outs: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        # The request's rows of the padded batch inputs, its private tensors, its outputs.
        rows = request_rows(inputs, offset, work.rows, batched=self._batched)
        tensors = rows | work.extras | outs
        for step in self._post:
            tensors = step(tensors)
        # What the steps left of the model's inputs is not an output.
        for name in rows:
            if name not in outs:
                tensors.pop(name, None)
        return tensors

    # -- back on the event loop --------------------------------------------------------------

    def _finish_batch(
        self, batch: list[Queued[_Work]], executed: _Executed | BaseException
    ) -> None:
        """Event loop: one call per batch resolves all of its requests."""
        for queued in batch:
            work = queued.item
            result = work.result
            if isinstance(executed, BaseException):
                result = BackendError(f"the batch failed: {executed!r}")
            if isinstance(result, InferResponse):
                if not work.future.done():
                    work.future.set_result(result)
            else:
                _fail(work.future, result or BackendError("the batch returned no result"))
        if self._observer is not None and not isinstance(executed, BaseException):
            for rows, ratio in executed:
                try:
                    self._observer.observe_batch(self.name, rows, ratio)
                except Exception:
                    logger.exception("observe_batch failed")

    def _observe_request(self, timings: StageTimings, outcome: str, batch: list[str]) -> None:
        assert self._observer is not None
        try:
            # Copies: after a stop timeout a worker may still be writing the live ones.
            copy = StageTimings(dict(timings.seconds), dict(timings.starts))
            self._observer.observe_request(self.name, copy, outcome, tuple(batch))
        except Exception:  # metrics must never fail a request
            logger.exception("observe_request failed")


def _fail(future: asyncio.Future[InferResponse], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
