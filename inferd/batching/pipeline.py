"""ServedModel: one loaded model version, from a decoded request to its response.

    validate (event loop) -> preprocess steps (preprocess thread pool)
      -> DynamicBatcher queue -> batch formation (event loop)
      -> compute_input (concatenate + pad) -> backend.infer -> compute_output (split rows)
         -> postprocess steps -> requested outputs / classification      (one worker thread)
      -> futures resolved (event loop)

Performance rules: the event loop runs only validation and bookkeeping; a request makes at
most one hop to the preprocess pool (none without preprocess steps), and a batch makes one hop
to a worker and one back, whatever its size. Every accepted request ends in exactly one of: a
response, or an InferdError (nothing is dropped, even when the model stops).

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

from inferd.backends.base import Backend, TensorSpec
from inferd.batching.batcher import BatchPolicy, DynamicBatcher, Queued
from inferd.batching.validate import InputValidator, QueueRules, check_requested_outputs
from inferd.errors import (
    InferdError,
    InvalidRequestError,
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.model_config import ModelRepoConfig
from inferd.steps.base import Step
from inferd.steps.classification import classify
from inferd.telemetry.stages import StageTimings
from inferd.tensors import DATATYPES, InferRequest, InferResponse, OutputTensor, datatype_of

if TYPE_CHECKING:
    from inferd.telemetry.model_metrics import ModelObserver

logger = logging.getLogger(__name__)

# Tensors a preprocess step adds for the pipeline itself (never sent to the backend).
PRIVATE_PREFIX = "__"
NUM_TOKENS = "__num_tokens__"
# Preprocess (tokenize, image decode) threads per model; created on first use.
_PREPROCESS_THREADS = max(2, min(8, os.cpu_count() or 1))

State = Literal["new", "ready", "stopping", "stopped"]


@dataclass(frozen=True)
class QueueLimits:
    """Server-wide queue defaults; a model's config.yaml may set its own."""

    max_queue_size: int = 1024
    default_timeout_s: float | None = None


class BackendError(InferdError):
    """The backend (or a pre/postprocess step) failed for a reason not in the request (500)."""


@dataclass(eq=False, slots=True)
class _Work:
    """One accepted request on its way through the pipeline."""

    request: InferRequest
    future: asyncio.Future[InferResponse]
    timings: dict[str, float]
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


# (rows, padding ratio) of each backend call a batch made.
_Executed = list[tuple[int, float]]


class ServedModel:
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
        limits: QueueLimits = QueueLimits(),
    ) -> None:
        if len(backends) < 1:
            raise ValueError("a served model needs at least one backend")
        self.name = name
        self.version = version
        self.config = config
        self._backends = list(backends)
        self._pre = list(preprocess)
        self._post = list(postprocess)
        self._labels = dict(labels or {})
        self._observer = observer
        declared = backends[0].inputs()
        # With preprocess steps the client's inputs are the config's, not the model file's.
        self._validate = InputValidator(config, () if self._pre else declared)
        self._rules = queue_rules(config, limits)
        self._variable = variable_dims(config, declared, has_preprocess=bool(self._pre))
        self._keyed_by_names = any(t.optional for t in config.input)
        self._known_outputs = _known_outputs(config, backends[0], has_postprocess=bool(self._post))
        self._output_types = {t.name: t.data_type for t in config.output}
        self._batched = config.max_batch_size > 0
        self._batcher: DynamicBatcher[_Work, Backend, _Executed] = DynamicBatcher(
            batch_policy(config, limits),
            self._backends,
            run=self._run_batch,
            done=self._finish_batch,
            expired=self._expire,
            name=name,
        )
        self._state: State = "new"
        self._live: set[asyncio.Future[InferResponse]] = set()
        self._idle: asyncio.Event | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._preprocessing = 0  # requests in the preprocess pool: they count against the bound
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
    def inflight(self) -> int:
        """Accepted requests not yet answered (preprocessing, queued or running)."""
        return len(self._live)

    async def start(self) -> None:
        if self._state != "new":
            return
        self._loop = asyncio.get_running_loop()
        self._batcher.start()
        if self._pre:
            self._pre_pool = ThreadPoolExecutor(
                _PREPROCESS_THREADS, thread_name_prefix=f"inferd-{self.name}-pre"
            )
        self._state = "ready"

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
        timings: dict[str, float] = {}
        outcome: str | None = "error"
        try:
            response = await self._infer(request, timings)
            outcome = "success"
            return response
        except asyncio.CancelledError:
            outcome = None  # the client went away; no outcome to count
            raise
        except BaseException as exc:
            outcome = _outcome(exc)
            raise
        finally:
            if outcome is not None and self._observer is not None:
                self._observe_request(timings, outcome)

    async def _infer(self, request: InferRequest, timings: dict[str, float]) -> InferResponse:
        if self._state != "ready":
            raise self._not_ready("is not ready" if self._state == "new" else "is stopping")
        work = self._admit(request, timings)
        future = work.future
        self._live.add(future)
        try:
            if self._pre_pool is not None:
                self._batcher.check_room(self._preprocessing)
                self._preprocessing += 1
                self._pre_pool.submit(self._prepare, work)
            else:
                work.tensors, work.extras = _split_private(request.inputs)
                self._place(work)
                self._enqueue(work)
            return await future
        except asyncio.CancelledError:
            if work.queued is not None:
                self._batcher.remove(work.queued)
            raise
        finally:
            self._live.discard(future)
            if self._idle is not None and not self._live:
                self._idle.set()

    def _admit(self, request: InferRequest, timings: dict[str, float]) -> _Work:
        """Validation: everything that can be known wrong about a request before queueing."""
        start = time.perf_counter()
        arrival = request.arrival or time.monotonic()
        rows = self._validate(request.inputs)
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
        )
        timings["validate"] = time.perf_counter() - start
        return work

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
            work.timings["queue"] = time.monotonic() - work.queued.enqueued
        _fail(work.future, QueueTimeoutError("the request's queue timeout passed before it ran"))

    def _observe_request(self, timings: Mapping[str, float], outcome: str) -> None:
        assert self._observer is not None
        try:
            # A copy: after a stop timeout a worker may still be writing the live dict.
            self._observer.observe_request(self.name, StageTimings.from_mapping(timings), outcome)
        except Exception:  # metrics must never fail a request
            logger.exception("observe_request failed")

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

    # -- preprocess (preprocess thread) ------------------------------------------------------

    def _prepare(self, work: _Work) -> None:
        """Runs the preprocess steps, then hands the request to the loop (one hop each way)."""
        assert self._loop is not None
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            tensors = dict(work.request.inputs)
            for step in self._pre:
                tensors = step(tensors)
            work.tensors, work.extras = _split_private(tensors)
            self._check_rows(work)
            self._place(work)
            work.num_tokens = _num_tokens(work.extras)
        except Exception as exc:
            error = _step_error("preprocess", exc)
        work.timings["preprocess"] = time.perf_counter() - start
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._prepared, work, error)

    def _prepared(self, work: _Work, error: BaseException | None) -> None:
        self._preprocessing -= 1
        if error is None:
            self._enqueue(work)
        else:
            _fail(work.future, error)

    def _check_rows(self, work: _Work) -> None:
        if not self._batched:
            return
        for name, array in work.tensors.items():
            if array.ndim == 0 or array.shape[0] != work.rows:
                raise BackendError(
                    f"preprocessing made input {name!r} of shape {list(array.shape)} from a "
                    f"request of {work.rows} rows"
                )

    def _place(self, work: _Work) -> None:
        """Sets the request's length bucket (key: lengths within 2x), its length, and its group:
        requests may share a batch only with the same input names (optional inputs)."""
        length = 0
        for name, dims in self._variable.items():
            array = work.tensors.get(name)
            if array is not None:
                for d in dims:
                    if d < array.ndim and array.shape[d] > length:
                        length = array.shape[d]
        bucket = 1 << (length - 1).bit_length() if length > 1 else length
        work.length = length
        if self._keyed_by_names:
            work.group = frozenset(work.tensors)
            work.key = bucket, work.group
        else:
            work.key = bucket

    # -- one batch (worker thread) -----------------------------------------------------------

    def _run_batch(self, backend: Backend, batch: list[Queued[_Work]]) -> _Executed:
        works = []
        for queued in batch:
            queued.item.timings["queue"] = queued.queue_s
            queued.item.timings["batch"] = queued.batch_s
            works.append(queued.item)
        executed: _Executed = []
        self._execute(backend, works, executed)
        return executed

    def _execute(self, backend: Backend, works: list[_Work], executed: _Executed) -> None:
        """compute_input -> infer -> compute_output -> per-request postprocess; sets each
        work's `result`. A failed batch of several requests is re-run one request at a time."""
        t0 = time.perf_counter()
        try:
            inputs, ratio = self._compute_input(works)
            t1 = time.perf_counter()
            outputs = backend.infer(inputs)
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
            works[0].result = _backend_error(exc)
            return
        t2 = time.perf_counter()
        rows = sum(w.rows for w in works)
        executed.append((rows, ratio))
        try:
            parts = self._split(outputs, works, rows)
        except BackendError as exc:
            for work in works:
                work.result = exc
            return
        t3 = time.perf_counter()
        offset = 0
        for work, outs in zip(works, parts, strict=True):
            work.timings.update(compute_input=t1 - t0, infer=t2 - t1, compute_output=t3 - t2)
            work.result = self._respond(work, inputs, offset, outs)
            offset += work.rows

    def _compute_input(self, works: list[_Work]) -> tuple[dict[str, np.ndarray], float]:
        """Concatenates the requests' rows; pads dims that differ with 0 (b"" for BYTES).
        Returns the batch and padded / total elements of its variable-length tensors."""
        if len(works) == 1:
            return works[0].tensors, 0.0
        inputs: dict[str, np.ndarray] = {}
        padded = total = 0
        for name in works[0].tensors:
            arrays = [w.tensors[name] for w in works]
            inputs[name], pad = _stack(arrays)
            if pad or name in self._variable:
                padded += pad
                total += inputs[name].size
        return inputs, (padded / total if total else 0.0)

    def _split(
        self, outputs: Mapping[str, np.ndarray], works: list[_Work], rows: int
    ) -> list[dict[str, np.ndarray]]:
        if not self._batched:
            return [dict(outputs)]
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != rows:
                raise BackendError(
                    f"the model returned output {name!r} of shape {list(array.shape)} for a "
                    f"batch of {rows} rows"
                )
        if len(works) == 1:
            return [dict(outputs)]
        parts, start = [], 0
        for work in works:
            stop = start + work.rows
            parts.append({name: array[start:stop] for name, array in outputs.items()})
            start = stop
        return parts

    def _respond(
        self,
        work: _Work,
        inputs: Mapping[str, np.ndarray],
        offset: int,
        outs: dict[str, np.ndarray],
    ) -> InferResponse | BaseException:
        start = time.perf_counter()
        try:
            tensors = outs
            if self._post:
                tensors = self._postprocess(work, inputs, offset, outs)
            selected = self._select(work, tensors, outs)
        except Exception as exc:
            return _step_error("postprocess", exc)
        if self._post or any(o.classification for o in work.request.outputs or ()):
            work.timings["postprocess"] = time.perf_counter() - start
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
        stop = offset + work.rows
        rows = {n: a[offset:stop] for n, a in inputs.items()} if self._batched else dict(inputs)
        tensors = rows | work.extras | outs
        for step in self._post:
            tensors = step(tensors)
        # What the steps left of the model's inputs is not an output.
        for name in rows:
            if name not in outs:
                tensors.pop(name, None)
        return tensors

    def _select(
        self, work: _Work, tensors: dict[str, np.ndarray], outs: Mapping[str, np.ndarray]
    ) -> list[OutputTensor]:
        requested = work.request.outputs
        if requested is not None:
            return [self._output(r.name, tensors, r.classification) for r in requested]
        if self.config.output:
            return [self._output(t.name, tensors, 0) for t in self.config.output]
        return [
            self._output(name, tensors, 0)
            for name in tensors
            if not name.startswith(PRIVATE_PREFIX)
        ]

    def _output(self, name: str, tensors: Mapping[str, np.ndarray], k: int) -> OutputTensor:
        data = tensors.get(name)
        if data is None:
            if self._known_outputs is not None and name in self._known_outputs:
                raise BackendError(f"the model produced no output {name!r}")
            raise InvalidRequestError(f"unknown output {name!r}", param=name)
        if k > 0:
            data = self._classify(name, data, k)
        datatype = datatype_of(data)
        declared = self._output_types.get(name)
        if (
            k == 0
            and declared is not None
            and declared != datatype
            and "BYTES"
            not in (
                declared,
                datatype,
            )
        ):
            data, datatype = data.astype(DATATYPES[declared]), declared
        return OutputTensor(name, data, datatype)

    def _classify(self, name: str, scores: np.ndarray, k: int) -> np.ndarray:
        return classify(scores, k, self._labels.get(name), batched=self._batched)


# -- building from a config ----------------------------------------------------------------------


def batch_policy(config: ModelRepoConfig, limits: QueueLimits) -> BatchPolicy:
    db = config.dynamic_batching
    max_queue = limits.max_queue_size
    if db is not None and db.default_queue_policy.max_queue_size > 0:
        max_queue = db.default_queue_policy.max_queue_size
    dynamic = db is not None and config.max_batch_size > 0
    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        dynamic=dynamic,
        max_delay_s=config.batch_delay_s,
        preferred_batch_sizes=db.preferred_batch_sizes if db is not None else (),
        max_queue_size=max_queue,
        max_padding_ratio=db.max_padding_ratio if db is not None else 0.0,
    )


def queue_rules(config: ModelRepoConfig, limits: QueueLimits) -> QueueRules:
    db = config.dynamic_batching
    if db is None:
        return QueueRules(default_timeout_s=limits.default_timeout_s)
    policy = db.default_queue_policy
    timeout = policy.default_timeout_ms / 1e3 if policy.default_timeout_ms > 0 else None
    return QueueRules(
        priority_levels=db.priority_levels,
        # Triton requires a default level; when none is set, unmarked requests go last.
        default_priority=db.default_priority_level or max(1, db.priority_levels),
        default_timeout_s=timeout if timeout is not None else limits.default_timeout_s,
        allow_timeout_override=policy.allow_timeout_override,
    )


def variable_dims(
    config: ModelRepoConfig, declared: Sequence[TensorSpec], *, has_preprocess: bool
) -> dict[str, tuple[int, ...]]:
    """Model input name -> its variable dims (axis numbers in the batched tensor)."""
    if config.max_batch_size == 0:
        return {}  # never batched: nothing to pad
    found: dict[str, set[int]] = {}
    for spec in declared:
        found.setdefault(spec.name, set()).update(
            i for i, d in enumerate(spec.shape) if i > 0 and d == -1
        )
    if not has_preprocess:  # then the config's inputs are the model's inputs
        for t in config.input:
            found.setdefault(t.name, set()).update(i + 1 for i, d in enumerate(t.dims) if d == -1)
    return {name: tuple(sorted(dims)) for name, dims in found.items() if dims}


def _known_outputs(
    config: ModelRepoConfig, backend: Backend, *, has_postprocess: bool
) -> frozenset[str] | None:
    """Output names a request may ask for, when known before running (else None)."""
    if config.output:
        return frozenset(t.name for t in config.output)
    if has_postprocess:
        return None
    names = frozenset(s.name for s in backend.outputs())
    return names or None


# -- small helpers -------------------------------------------------------------------------------


def _split_private(
    tensors: Mapping[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    if not any(name.startswith(PRIVATE_PREFIX) for name in tensors):
        return dict(tensors), {}
    public = {n: a for n, a in tensors.items() if not n.startswith(PRIVATE_PREFIX)}
    private = {n: a for n, a in tensors.items() if n.startswith(PRIVATE_PREFIX)}
    return public, private


def _num_tokens(extras: Mapping[str, np.ndarray]) -> int | None:
    counts = extras.get(NUM_TOKENS)
    return None if counts is None else int(np.asarray(counts).sum())


def _stack(arrays: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Concatenates along the batch dim; pads every other dim to the longest. -> (batch, #pad)."""
    first = arrays[0]
    tail = first.shape[1:]
    if all(a.shape[1:] == tail for a in arrays):
        return np.concatenate(arrays), 0
    if any(a.ndim != first.ndim for a in arrays):
        raise InvalidRequestError("requests of one batch have inputs of different ranks")
    target = tuple(max(a.shape[d] for a in arrays) for d in range(1, first.ndim))
    shape = (sum(a.shape[0] for a in arrays), *target)
    out = (
        np.full(shape, b"", dtype=object)
        if first.dtype.kind == "O"
        else np.zeros(shape, first.dtype)
    )
    start = 0
    for a in arrays:
        out[(slice(start, start + a.shape[0]), *(slice(0, s) for s in a.shape[1:]))] = a
        start += a.shape[0]
    return out, out.size - sum(a.size for a in arrays)


def _backend_error(exc: Exception) -> BaseException:
    if isinstance(exc, InferdError):
        return (
            exc if isinstance(exc, InvalidRequestError | BackendError) else BackendError(str(exc))
        )
    error = BackendError(f"the backend failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _step_error(stage: str, exc: Exception) -> BaseException:
    if isinstance(exc, InvalidRequestError | BackendError):
        return exc
    error = BackendError(f"{stage} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _fail(future: asyncio.Future[InferResponse], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, QueueTimeoutError):
        return "queue_timeout"
    if isinstance(exc, ModelNotReadyError):
        return "unavailable"
    return "error"
