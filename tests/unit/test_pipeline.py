"""ServedModel end to end on a fake backend: batching, splitting, padding, failure isolation,
outputs and classification, timings, priorities/timeouts/bounds, stop, no batch dim.

The backend is a small class implementing inferd.backends.base.Backend: it records what it
ran (and on which thread), can be held at a gate, and raises on poison values. The steps are
tiny Step implementations with the same contract as the real tokenize / mean_pool steps.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from inferd.backends.base import TensorSpec
from inferd.batching.cost import CallCost, FixedCallCost
from inferd.batching.pace import FixedWindow, MeasuredPace, Pace
from inferd.batching.pipeline import BackendError, QueueLimits, ServedModel
from inferd.errors import (
    InvalidRequestError,
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.model_config import ModelRepoConfig
from inferd.steps.classification import classify
from inferd.telemetry.stages import Stage, StageTimings
from inferd.tensors import InferRequest, InferResponse, RequestedOutput

POISON = -100.0  # a row starting with this fails the backend (a server-side failure)
BAD = -200.0  # a row starting with this is refused by the backend (InvalidRequestError)
LABELS = ["zero", "one", "two", "three"]
DEFAULT_LIMITS = QueueLimits()


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30))

    return run


class FakeBackend:
    """y = 2x and s = row sums for the tabular model; hidden = ids for the text model."""

    platform = "python"

    def __init__(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        gate: threading.Event | None = None,
    ) -> None:
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self.gate = gate
        self.seen: list[dict[str, np.ndarray]] = []
        self.threads: set[str] = set()
        self.closed = False

    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen.append({k: v.copy() for k, v in inputs.items()})
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        if "ids" in inputs:
            return {"hidden": inputs["ids"][..., None].astype(np.float32)}
        x = inputs["x"]
        if (x[..., 0] == POISON).any():
            raise RuntimeError("poisoned input")
        if (x[..., 0] == BAD).any():
            raise InvalidRequestError("x holds a value this model refuses")
        return {"y": x * 2, "s": x.sum(axis=-1, keepdims=True)}

    def close(self) -> None:
        self.closed = True

    def rows_seen(self) -> list[int]:
        return [len(batch["x"]) for batch in self.seen]


@dataclass
class FakeObserver:
    requests: list[tuple[str, dict[Stage, float], str]] = field(default_factory=list)
    batches: list[tuple[str, int, float]] = field(default_factory=list)
    starts: list[dict[Stage, float]] = field(default_factory=list)
    batch_ids: list[tuple[str, ...]] = field(default_factory=list)

    def observe_request(
        self, model: str, timings: StageTimings, outcome: str, batch: Sequence[str] = ()
    ) -> None:
        self.requests.append((model, dict(timings.seconds), outcome))
        self.starts.append(dict(timings.starts))
        self.batch_ids.append(tuple(batch))

    def observe_batch(self, model: str, size: int, padding_ratio: float) -> None:
        self.batches.append((model, size, padding_ratio))

    def outcomes(self) -> list[str]:
        return [o for _, _, o in self.requests]


TABULAR_IN = [TensorSpec("x", "FP32", (-1, 4))]
TABULAR_OUT = [TensorSpec("y", "FP32", (-1, 4)), TensorSpec("s", "FP32", (-1, 1))]


def tabular_config(**fields: Any) -> ModelRepoConfig:
    data: dict[str, Any] = {
        "backend": "python",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [
            {"name": "y", "data_type": "TYPE_FP32", "dims": [4], "label_filename": "l.txt"},
            {"name": "s", "data_type": "TYPE_FP32", "dims": [1]},
        ],
        "dynamic_batching": {"max_queue_delay_ms": 30},
    }
    data.update(fields)
    return ModelRepoConfig.model_validate(data)


def tabular(
    config: ModelRepoConfig | None = None,
    *,
    instances: int = 1,
    gate: threading.Event | None = None,
    observer: FakeObserver | None = None,
    limits: QueueLimits = DEFAULT_LIMITS,
    pace: Pace | None = None,
) -> tuple[ServedModel, list[FakeBackend]]:
    config = config or tabular_config()
    backends = [FakeBackend(TABULAR_IN, TABULAR_OUT, gate) for _ in range(instances)]
    pace = pace or FixedWindow()  # these tests are about the batch window, not the pace
    model = ServedModel(
        "tab",
        "1",
        config,
        backends,
        labels={"y": LABELS},
        observer=observer,
        limits=limits,
        pace=pace,
    )
    return model, backends


def req(value: float, rows: int = 1, **kw: Any) -> InferRequest:
    x = np.full((rows, 4), value, np.float32) + np.arange(4, dtype=np.float32)
    return InferRequest("tab", {"x": x}, **kw)


def output(response: InferResponse, name: str) -> np.ndarray:
    return next(o.data for o in response.outputs if o.name == name)


async def until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


# -- batching, splitting, validation -------------------------------------------------------------


@async_test
async def test_requests_share_a_batch_and_get_their_own_rows_back() -> None:
    model, (backend,) = tabular()
    await model.start()
    requests = [req(float(i)) for i in range(6)] + [req(10.0, rows=2)]
    responses = await asyncio.gather(*(model.infer(r) for r in requests))
    assert backend.rows_seen() == [8]  # full at 8 rows: sent without waiting for the delay
    for request, response in zip(requests, responses, strict=True):
        np.testing.assert_array_equal(output(response, "y"), request.inputs["x"] * 2)
        assert [o.name for o in response.outputs] == ["y", "s"]  # config order
        assert (response.model_name, response.model_version) == ("tab", "1")
    await model.stop()
    assert backend.closed


@async_test
async def test_invalid_request_fails_alone_before_queueing() -> None:
    model, (backend,) = tabular()
    await model.start()
    wrong = InferRequest("tab", {"x": np.zeros((1, 5), np.float32)})
    too_big = req(1.0, rows=9)
    results = await asyncio.gather(
        model.infer(req(1.0)),
        model.infer(wrong),
        model.infer(too_big),
        model.infer(req(2.0)),
        return_exceptions=True,
    )
    assert isinstance(results[1], InvalidRequestError) and "shape" in str(results[1])
    assert isinstance(results[2], InvalidRequestError) and "1 to 8 rows" in str(results[2])
    assert all(isinstance(r, InferResponse) for r in (results[0], results[3]))
    assert backend.rows_seen() == [2]
    await model.stop()


@async_test
async def test_a_failing_request_is_isolated_from_its_batch() -> None:
    model, (backend,) = tabular()
    await model.start()
    results = await asyncio.gather(
        model.infer(req(1.0)),
        model.infer(req(POISON)),
        model.infer(req(BAD)),
        model.infer(req(3.0)),
        return_exceptions=True,
    )
    assert isinstance(results[0], InferResponse) and isinstance(results[3], InferResponse)
    assert isinstance(results[1], BackendError) and "poisoned" in str(results[1])
    assert isinstance(results[2], InvalidRequestError)
    # The batch of 4 failed, then each request ran alone.
    assert backend.rows_seen() == [4, 1, 1, 1, 1]
    np.testing.assert_array_equal(output(results[3], "y"), req(3.0).inputs["x"] * 2)
    await model.stop()


@async_test
async def test_without_dynamic_batching_each_request_runs_alone() -> None:
    model, (backend,) = tabular(tabular_config(dynamic_batching=None))
    await model.start()
    await asyncio.gather(*(model.infer(req(float(i), rows=2)) for i in range(3)))
    assert backend.rows_seen() == [2, 2, 2]
    await model.stop()


@async_test
async def test_no_batch_dim_model_runs_each_request_alone_as_is() -> None:
    config = tabular_config(max_batch_size=0)  # dynamic_batching is ignored without a batch dim
    model, (backend,) = tabular(config)
    await model.start()
    xs = [np.full((4,), i, np.float32) for i in range(3)]
    responses = await asyncio.gather(*(model.infer(InferRequest("tab", {"x": x})) for x in xs))
    assert [b["x"].shape for b in backend.seen] == [(4,)] * 3
    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_array_equal(output(response, "y"), x * 2)
    with pytest.raises(InvalidRequestError):
        await model.infer(req(1.0))  # a batch dim this model does not take
    await model.stop()


@async_test
async def test_instances_run_batches_on_their_own_backends_off_the_loop() -> None:
    gate = threading.Event()
    model, backends = tabular(tabular_config(dynamic_batching=None), instances=2, gate=gate)
    await model.start()
    tasks = [asyncio.ensure_future(model.infer(req(float(i)))) for i in range(2)]
    await until(lambda: all(b.seen for b in backends))  # both run at once
    gate.set()
    await asyncio.gather(*tasks)
    threads = set().union(*(b.threads for b in backends))
    assert len(threads) == 2 and threading.current_thread().name not in threads
    await model.stop()


# -- outputs -------------------------------------------------------------------------------------


@async_test
async def test_requested_outputs_and_classification() -> None:
    model, (backend,) = tabular()
    await model.start()
    request = req(0.5, rows=2, outputs=[RequestedOutput("y", classification=2)])
    response = await model.infer(request)
    (out,) = response.outputs
    assert (out.name, out.datatype, out.shape) == ("y", "BYTES", [2, 2])
    expected = classify(request.inputs["x"] * 2, 2, LABELS)
    np.testing.assert_array_equal(out.data, expected)
    assert out.data[0, 0] == b"7.000000:3:three"
    only_s = await model.infer(req(1.0, outputs=[RequestedOutput("s")]))
    assert [o.name for o in only_s.outputs] == ["s"]
    with pytest.raises(InvalidRequestError, match="unknown output 'z'"):
        await model.infer(req(1.0, outputs=[RequestedOutput("z")]))
    assert backend.rows_seen() == [2, 1]  # the bad request never ran
    await model.stop()


@async_test
async def test_outputs_default_to_the_backends_when_the_config_lists_none() -> None:
    model, _ = tabular(tabular_config(output=[]))
    await model.start()
    response = await model.infer(req(1.0))
    assert sorted(o.name for o in response.outputs) == ["s", "y"]
    with pytest.raises(InvalidRequestError, match="unknown output"):
        await model.infer(req(1.0, outputs=[RequestedOutput("nope")]))
    await model.stop()


# -- priorities, timeouts, bounds -----------------------------------------------------------------


@async_test
async def test_priority_is_validated_and_orders_the_queue() -> None:
    gate = threading.Event()
    config = tabular_config(
        max_batch_size=1, dynamic_batching={"priority_levels": 2, "default_priority_level": 2}
    )
    model, (backend,) = tabular(config, gate=gate)
    await model.start()
    with pytest.raises(InvalidRequestError, match="priority"):
        await model.infer(req(1.0, priority=3))
    first = asyncio.ensure_future(model.infer(req(0.0)))
    await until(lambda: bool(backend.seen))
    low = asyncio.ensure_future(model.infer(req(1.0)))  # 0 -> default level 2
    high = asyncio.ensure_future(model.infer(req(2.0, priority=1)))
    await until(lambda: model._batcher.num_queued == 2)  # both wait behind the gated batch
    gate.set()
    await asyncio.gather(first, low, high)
    assert [b["x"][0, 0] for b in backend.seen] == [0.0, 2.0, 1.0]
    await model.stop()


@async_test
async def test_queue_timeout_fires_while_the_worker_is_busy() -> None:
    gate = threading.Event()
    observer = FakeObserver()
    model, (backend,) = tabular(tabular_config(dynamic_batching=None), gate=gate, observer=observer)
    await model.start()
    running = asyncio.ensure_future(model.infer(req(0.0)))
    await until(lambda: bool(backend.seen))
    with pytest.raises(QueueTimeoutError):
        await model.infer(req(1.0, timeout_us=50_000))
    assert not running.done()
    gate.set()
    await running
    assert observer.outcomes() == ["queue_timeout", "success"]
    assert observer.requests[0][1][Stage.QUEUE] >= 0.04
    await model.stop()


@async_test
async def test_full_queue_is_a_429_with_a_retry_hint() -> None:
    gate = threading.Event()
    observer = FakeObserver()
    model, (backend,) = tabular(
        tabular_config(dynamic_batching=None),
        gate=gate,
        observer=observer,
        limits=QueueLimits(max_queue_size=1),
    )
    await model.start()
    running = asyncio.ensure_future(model.infer(req(0.0)))
    await until(lambda: bool(backend.seen))
    queued = asyncio.ensure_future(model.infer(req(1.0)))
    await until(lambda: model._batcher.num_queued == 1)
    with pytest.raises(QueueFullError) as info:
        await model.infer(req(2.0))
    assert info.value.retry_after >= 1
    gate.set()
    await asyncio.gather(running, queued)
    assert observer.outcomes().count("queue_full") == 1
    await model.stop()


@async_test
async def test_a_cancelled_request_leaves_the_queue() -> None:
    gate = threading.Event()
    model, (backend,) = tabular(tabular_config(dynamic_batching=None), gate=gate)
    await model.start()
    running = asyncio.ensure_future(model.infer(req(0.0)))
    await until(lambda: bool(backend.seen))
    gone = asyncio.ensure_future(model.infer(req(1.0)))
    await until(lambda: model.inflight == 2)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert model.inflight == 1 and model._batcher.num_queued == 0
    gate.set()
    await running
    assert backend.rows_seen() == [1]
    await model.stop()


# -- lifecycle -----------------------------------------------------------------------------------


@async_test
async def test_stop_lets_accepted_requests_finish() -> None:
    gate = threading.Event()
    model, (backend,) = tabular(tabular_config(dynamic_batching=None), gate=gate)
    with pytest.raises(ModelNotReadyError):
        await model.infer(req(1.0))  # not started
    await model.start()
    assert model.ready and model.platform == "python"
    accepted = [asyncio.ensure_future(model.infer(req(float(i)))) for i in range(3)]
    await until(lambda: bool(backend.seen))
    stopping = asyncio.ensure_future(model.stop(timeout_s=10))
    await until(lambda: not model.ready)
    with pytest.raises(ModelNotReadyError, match="stopping"):
        await model.infer(req(9.0))
    gate.set()
    responses = await asyncio.gather(*accepted)
    await stopping
    assert len(responses) == 3 and backend.rows_seen() == [1, 1, 1]
    assert backend.closed and model.inflight == 0


@async_test
async def test_stop_fails_what_is_left_after_its_timeout() -> None:
    gate = threading.Event()
    model, (backend,) = tabular(tabular_config(dynamic_batching=None), gate=gate)
    await model.start()
    accepted = [asyncio.ensure_future(model.infer(req(float(i)))) for i in range(3)]
    await until(lambda: bool(backend.seen))
    await model.stop(timeout_s=0.05)
    results = await asyncio.gather(*accepted, return_exceptions=True)
    assert all(isinstance(r, ModelNotReadyError) for r in results)  # running and queued alike
    assert not backend.closed  # still inside infer: closed when it returns
    gate.set()
    await until(lambda: backend.closed)
    assert backend.rows_seen() == [1]


# -- variable length, steps, private tensors, timings ---------------------------------------------


class WordIds:
    """Preprocess: text [n, 1] -> ids/mask [n, L] (L: the request's longest row; ids are the
    word lengths), plus __num_tokens__ [n], like the tokenize step."""

    stage = "preprocess"

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        rows = [t.decode().split() for t in tensors.pop("text")[:, 0]]
        length = max(len(r) for r in rows)
        ids = np.zeros((len(rows), length), np.int64)
        for i, words in enumerate(rows):
            ids[i, : len(words)] = [len(w) for w in words]
        mask = (ids > 0).astype(np.int64)
        count = mask.sum(axis=1)
        return tensors | {"ids": ids, "mask": mask, "__num_tokens__": count}


class MeanOfHidden:
    """Postprocess: masked mean of hidden [n, L, 1] -> mean [n, 1]; records the mask it saw."""

    stage = "postprocess"

    def __init__(self) -> None:
        self.masks: list[np.ndarray] = []
        self.threads: set[str] = set()

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.add(threading.current_thread().name)
        hidden, mask = tensors.pop("hidden")[..., 0], tensors["mask"]
        self.masks.append(mask.copy())
        mean = (hidden * mask).sum(axis=1, keepdims=True) / mask.sum(axis=1, keepdims=True)
        return tensors | {"mean": mean.astype(np.float32)}


def text_model(
    observer: FakeObserver,
    limits: QueueLimits = DEFAULT_LIMITS,
    pace: Pace | None = None,
    cost: CallCost | None = None,
) -> tuple[ServedModel, FakeBackend, WordIds, MeanOfHidden]:
    """Concurrent requests reach the batcher one by one from the preprocess pool; FixedWindow
    (the default here) holds each partial batch for its window, so they meet in one. The call
    cost is stated unknown (length buckets) unless given: None would calibrate at start."""
    config = ModelRepoConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
            "dynamic_batching": {"max_queue_delay_ms": 100},
        }
    )
    backend = FakeBackend(
        [TensorSpec("ids", "INT64", (-1, -1)), TensorSpec("mask", "INT64", (-1, -1))],
        [TensorSpec("hidden", "FP32", (-1, -1, 1))],
    )
    pre, post = WordIds(), MeanOfHidden()
    model = ServedModel(
        "text",
        "2",
        config,
        [backend],
        [pre],
        [post],
        observer=observer,
        limits=limits,
        pace=pace or FixedWindow(),
        cost=cost or FixedCallCost(None),
    )
    return model, backend, pre, post


def text(*sentences: str, id: str = "") -> InferRequest:
    data = np.array([[s.encode()] for s in sentences], dtype=object)
    return InferRequest("text", {"text": data}, id=id)


@async_test
async def test_variable_length_requests_are_bucketed_padded_and_pooled() -> None:
    observer = FakeObserver()
    model, backend, pre, post = text_model(observer)
    await model.start()
    three, four, seven = "a bb ccc", "dddd e ff ggg", "a b c d e f g"
    responses = await asyncio.gather(
        model.infer(text(three)), model.infer(text(seven)), model.infer(text(four))
    )
    # Lengths 3 and 4 share the bucket of 4; 7 is in the bucket of 8.
    shapes = sorted(b["ids"].shape for b in backend.seen)
    assert shapes == [(1, 7), (2, 4)]
    assert all("__num_tokens__" not in b for b in backend.seen)
    padded = next(b for b in backend.seen if b["ids"].shape == (2, 4))
    assert padded["ids"][0].tolist() == [1, 2, 3, 0]  # padded with 0
    # 1 padded element of 8 in each of ids and mask.
    assert sorted(r for _, _, r in observer.batches) == [0.0, 0.125]
    assert sorted(s for _, s, _ in observer.batches) == [1, 2]
    # Pooling saw the mask at the padded length and still averaged only real tokens.
    assert sorted(m.shape[1] for m in post.masks) == [4, 4, 7]
    means = [output(r, "mean")[0, 0] for r in responses]
    assert means == pytest.approx([2.0, 1.0, 2.5])
    assert [r.num_input_tokens for r in responses] == [3, 7, 4]
    assert [o.name for o in responses[0].outputs] == ["mean"]  # inputs are not outputs
    loop_thread = threading.current_thread().name
    assert loop_thread not in pre.threads | post.threads | backend.threads
    await model.stop()


@async_test
async def test_start_calibrates_the_call_cost_on_zero_batches_of_the_declared_inputs() -> None:
    model, backend, _, _ = text_model(FakeObserver())
    model._cost = None  # as the repository builds it: calibrated at start
    await model.start()
    # An untimed first call, then 1 and 8 rows (the max batch size) at lengths 16 and 64.
    shapes = [b["ids"].shape for b in backend.seen]
    assert shapes == [(1, 16)] + [s for s in [(1, 16), (8, 16), (1, 64), (8, 64)] for _ in range(5)]
    assert all(not b["ids"].any() and b["mask"].shape == b["ids"].shape for b in backend.seen)
    assert backend.threads and threading.current_thread().name not in backend.threads
    await model.stop()


@async_test
async def test_no_call_cost_is_timed_where_two_dims_vary() -> None:
    config = ModelRepoConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "ids", "data_type": "TYPE_INT64", "dims": [-1, -1]}],
            "dynamic_batching": {"max_queue_delay_ms": 1},
        }
    )
    backend = FakeBackend(
        [TensorSpec("ids", "INT64", (-1, -1, -1))], [TensorSpec("hidden", "FP32", (-1, -1, -1))]
    )
    model = ServedModel("grid", "1", config, [backend], observer=FakeObserver())
    await model.start()
    # Rows x longest says nothing of an [h, w] input's cost: no synthetic batch, no overhead.
    assert backend.seen == [] and model.call_overhead is None
    await model.stop()


@async_test
async def test_timings_cover_every_stage() -> None:
    observer = FakeObserver()
    model, _, _, _ = text_model(observer)
    await model.start()
    response = await model.infer(text("one two"))
    stages = [  # in the response body's order
        "validate",
        "preprocess",
        "queue",
        "batch",
        "compute_input",
        "infer",
        "compute_output",
        "postprocess",
    ]
    seconds = response.timings.seconds
    assert set(seconds) == set(stages)
    assert all(v >= 0 for v in seconds.values())
    # Alone in its bucket with a free worker: it waited out the 100 ms batch delay.
    assert seconds[Stage.QUEUE] + seconds[Stage.BATCH] >= 0.099
    assert observer.requests == [("text", seconds, "success")]
    assert list(response.timings.as_dict()) == stages
    # Each stage starts where the one before it ended (to clock resolution): a waterfall of them
    # has no overlaps, and the dashboard places each bar at its real instant.
    starts = observer.starts[0]
    assert list(starts) == sorted(starts, key=starts.__getitem__)
    for before, after in itertools.pairwise(stages):
        assert starts[Stage(after)] >= starts[Stage(before)] + seconds[Stage(before)] - 1e-6
    assert observer.batch_ids == [(response.id,)]  # it ran alone: no batch mates
    await model.stop()


@async_test
async def test_a_lone_request_runs_at_once_preprocessed_by_its_worker() -> None:
    observer = FakeObserver()
    model, backend, pre, _ = text_model(observer, pace=MeasuredPace(max_delay_s=0.1))
    await model.start()
    for words in ("one two", "three four five"):  # one client: the instance is idle each time
        response = await model.infer(text(words))
        seconds = response.timings.seconds
        assert seconds[Stage.QUEUE] + seconds[Stage.BATCH] < 0.05  # not the 100 ms window
        assert seconds[Stage.PREPROCESS] > 0 and response.num_input_tokens == len(words.split())
    assert pre.threads == backend.threads  # one hop: the worker ran the preprocess steps
    # Its preprocess failing there fails it alone, as in the pool.
    not_utf8 = InferRequest("text", {"text": np.array([[b"\xff"]], dtype=object)})
    with pytest.raises(BackendError, match="preprocess"):
        await model.infer(not_utf8)
    assert observer.outcomes() == ["success", "success", "error"]
    assert [b["ids"].shape for b in backend.seen] == [(1, 2), (1, 3)]
    await model.stop()


class FastAloneBackend(FakeBackend):
    """A FakeBackend with the optional `infer_alone` (ONNX Runtime's spinning twin session)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append("batch")
        return super().infer(inputs)

    def infer_alone(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append("alone")
        return super().infer(inputs)


@async_test
async def test_only_a_lone_request_with_nothing_queued_runs_on_infer_alone() -> None:
    gate = threading.Event()
    backend = FastAloneBackend(TABULAR_IN, TABULAR_OUT, gate)
    model = ServedModel("tab", "1", tabular_config(), [backend], pace=MeasuredPace(0.03))
    await model.start()
    gate.set()
    await model.infer(req(1.0))  # an idle instance: it runs at once, alone
    gate.clear()
    first = asyncio.ensure_future(model.infer(req(2.0)))  # held at the gate, alone
    await until(lambda: len(backend.seen) == 2)
    rest = [asyncio.ensure_future(model.infer(req(float(i)))) for i in range(3)]
    await until(lambda: model._batcher.num_queued == 3)
    gate.set()
    await asyncio.gather(first, *rest)
    assert backend.calls == ["alone", "alone", "batch"]
    assert backend.rows_seen() == [1, 1, 3]
    await model.stop()


@async_test
async def test_a_burst_goes_to_the_preprocess_pool_in_groups() -> None:
    observer = FakeObserver()
    model, *_ = text_model(observer)
    await model.start()
    assert model._pre_pool is not None
    submitted: list[int] = []
    submit = model._pre_pool.submit

    def counting(fn: Callable[..., None], works: list[Any]) -> Any:
        submitted.append(len(works))
        return submit(fn, works)

    model._pre_pool.submit = counting  # type: ignore[method-assign,assignment]
    words = [" ".join(["w"] * (i + 1)) for i in range(10)]
    # Ten arrivals in one loop iteration: two hand-offs to the pool (8 + 2), not ten.
    responses = await asyncio.gather(*(model.infer(text(w)) for w in words))
    assert submitted == [8, 2]
    assert [r.num_input_tokens for r in responses] == list(range(1, 11))
    assert sorted(observer.outcomes()) == ["success"] * 10
    await model.stop()


@async_test
async def test_each_request_reports_the_batch_it_ran_in() -> None:
    observer = FakeObserver()
    model, _, _, _ = text_model(observer)
    await model.start()
    requests = [text("one two", id=f"r{i}") for i in range(3)]
    await asyncio.gather(*(model.infer(r) for r in requests))
    assert sorted(observer.batch_ids) == [("r0", "r1", "r2")] * 3
    await model.stop()


@async_test
async def test_a_failing_preprocess_fails_only_its_request() -> None:
    observer = FakeObserver()
    model, backend, _, _ = text_model(observer)
    await model.start()
    not_utf8 = InferRequest("text", {"text": np.array([[b"\xff"]], dtype=object)})
    results = await asyncio.gather(
        model.infer(not_utf8), model.infer(text("fine")), return_exceptions=True
    )
    assert isinstance(results[0], BackendError) and "preprocess" in str(results[0])
    assert isinstance(results[1], InferResponse)
    assert sorted(observer.outcomes()) == ["error", "success"]
    assert [b["ids"].shape for b in backend.seen] == [(1, 1)]
    await model.stop()


@async_test
async def test_requests_being_preprocessed_count_against_the_queue_bound() -> None:
    model, _, pre, _ = text_model(FakeObserver(), QueueLimits(max_queue_size=1))
    pre.gate = threading.Event()
    await model.start()
    first = asyncio.ensure_future(model.infer(text("held in preprocess")))
    await until(lambda: model.inflight == 1)
    with pytest.raises(QueueFullError):
        await model.infer(text("no room"))
    pre.gate.set()
    assert (await first).num_input_tokens == 3
    await model.infer(text("room again"))
    await model.stop()


@async_test
async def test_concurrent_stops_all_wait_for_the_backends_to_close() -> None:
    model, (backend,) = tabular()
    await model.start()
    await asyncio.gather(model.stop(), model.stop())
    assert backend.closed and not model.ready
    await model.stop()  # again: nothing left to do
