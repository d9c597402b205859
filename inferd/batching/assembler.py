"""Batch assembly, pure numpy: requests' tensors -> one batch -> each request's outputs.

    batch, ratio = assemble([a.tensors, b.tensors], variable={"input_ids"})  # stack + pad
    parts = split_rows(outputs, [a.rows, b.rows], batched=True)               # rows back
    rows = request_rows(batch, offset=a.rows, rows=b.rows, batched=True)     # b's padded inputs
    tensors = OutputSelector(...).select(b.request.outputs, postprocessed)    # what b asked for

Padding: dims beyond the batch dim that differ between requests are padded with 0 (b"" for
BYTES) to the longest; the padding ratio is padded / total elements of the variable-length
tensors (the `inferd_model_batch_padding_ratio` metric). Bucketing: a request's length is its
longest variable dim and its bucket the next power of two, so one bucket differs at most 2x.

No threads, no clock, no model: ServedModel (pipeline.py) calls these on its worker thread.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from inferd.backends.base import TensorSpec
from inferd.errors import (
    InferdError,
    InvalidRequestError,
    ModelNotReadyError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.steps.classification import classify
from inferd.tensors import DATATYPES, OutputTensor, RequestedOutput, datatype_of

Tensors = dict[str, np.ndarray]

# Tensors a preprocess step adds for the pipeline itself (never sent to the backend).
PRIVATE_PREFIX = "__"
NUM_TOKENS = "__num_tokens__"


class BackendError(InferdError):
    """The backend (or a pre/postprocess step) failed for a reason not in the request (500)."""


def backend_error(exc: Exception) -> BaseException:
    """What a request sees when the backend raised `exc`: its own InferdError when that is a
    400 or already a BackendError, else a BackendError (500) that keeps `exc` as the cause."""
    if isinstance(exc, InferdError):
        return (
            exc if isinstance(exc, InvalidRequestError | BackendError) else BackendError(str(exc))
        )
    error = BackendError(f"the backend failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def outcome_of(exc: BaseException) -> str:
    """How a failed request is counted (`inferd_model_requests{outcome}`, the request log)."""
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, QueueTimeoutError):
        return "queue_timeout"
    if isinstance(exc, ModelNotReadyError):
        return "unavailable"
    return "error"


def step_error(stage: str, exc: Exception) -> BaseException:
    """What a request sees when a pre/postprocess step raised `exc` (a step's 400 stays one)."""
    if isinstance(exc, InvalidRequestError | BackendError):
        return exc
    error = BackendError(f"{stage} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


# -- into a batch --------------------------------------------------------------------------------


def split_private(tensors: Mapping[str, np.ndarray]) -> tuple[Tensors, Tensors]:
    """(model inputs, the `__`-prefixed tensors the pipeline keeps for itself)."""
    if not any(name.startswith(PRIVATE_PREFIX) for name in tensors):
        return dict(tensors), {}
    public = {n: a for n, a in tensors.items() if not n.startswith(PRIVATE_PREFIX)}
    private = {n: a for n, a in tensors.items() if n.startswith(PRIVATE_PREFIX)}
    return public, private


def num_tokens(extras: Mapping[str, np.ndarray]) -> int | None:
    """Tokens the text preprocess counted (for /v1/embeddings usage); None without one."""
    counts = extras.get(NUM_TOKENS)
    return None if counts is None else int(np.asarray(counts).sum())


def check_rows(tensors: Mapping[str, np.ndarray], rows: int) -> None:
    """Every preprocessed input keeps the request's row count (a step bug otherwise: 500)."""
    for name, array in tensors.items():
        if array.ndim == 0 or array.shape[0] != rows:
            raise BackendError(
                f"preprocessing made input {name!r} of shape {list(array.shape)} from a "
                f"request of {rows} rows"
            )


@dataclass(frozen=True)
class Placement:
    """Where a request queues: `key` (its length bucket, and with optional inputs its input
    names), `length` (its longest variable dim, 0: none) and `group` (requests may share a
    batch only within one group; None: all may)."""

    key: Hashable
    length: int
    group: Hashable


def place(
    tensors: Mapping[str, np.ndarray],
    variable: Mapping[str, Sequence[int]],
    *,
    keyed_by_names: bool,
) -> Placement:
    """The request's length bucket (lengths within 2x share one) and batch group."""
    length = 0
    for name, dims in variable.items():
        array = tensors.get(name)
        if array is not None:
            for d in dims:
                if d < array.ndim and array.shape[d] > length:
                    length = array.shape[d]
    bucket = 1 << (length - 1).bit_length() if length > 1 else length
    if not keyed_by_names:
        return Placement(bucket, length, None)
    group = frozenset(tensors)
    return Placement((bucket, group), length, group)


def stack(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
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


def assemble(
    requests: Sequence[Mapping[str, np.ndarray]], variable: Collection[str]
) -> tuple[Tensors, float]:
    """Concatenates the requests' rows (the first request's input names), padding dims that
    differ. Returns the batch and its padding ratio: padded / total elements of the tensors
    that are variable-length (`variable`) or were padded. One request: its tensors, 0.0."""
    if len(requests) == 1:
        return dict(requests[0]), 0.0
    inputs: Tensors = {}
    padded = total = 0
    for name in requests[0]:
        inputs[name], pad = stack([r[name] for r in requests])
        if pad or name in variable:
            padded += pad
            total += inputs[name].size
    return inputs, (padded / total if total else 0.0)


def synthetic_batch(
    specs: Sequence[TensorSpec],
    variable: Mapping[str, Sequence[int]],
    rows: int,
    length: int,
) -> Tensors:
    """Zero-filled inputs of `rows` rows for the backend's declared inputs: `length` in each
    variable dim (`variable`), 1 in any other dim the model leaves open. For timing a call
    (inferd.batching.cost.calibrate); every datatype must be numeric (not BYTES)."""
    out: Tensors = {}
    for spec in specs:
        dims = variable.get(spec.name, ())
        shape = [rows] + [
            length if i in dims else (d if d > 0 else 1) for i, d in enumerate(spec.shape[1:], 1)
        ]
        out[spec.name] = np.zeros(shape, DATATYPES[spec.datatype])
    return out


# -- out of a batch ------------------------------------------------------------------------------


def split_rows(
    outputs: Mapping[str, np.ndarray], rows: Sequence[int], *, batched: bool
) -> list[Tensors]:
    """Each request's rows of the batch outputs, in order. An unbatched model's outputs belong
    to its one request whole. Raises BackendError when an output lacks the batch's rows."""
    if not batched:
        return [dict(outputs)]
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise BackendError(
                f"the model returned output {name!r} of shape {list(array.shape)} for a "
                f"batch of {total} rows"
            )
    if len(rows) == 1:
        return [dict(outputs)]
    parts, start = [], 0
    for n in rows:
        parts.append({name: array[start : start + n] for name, array in outputs.items()})
        start += n
    return parts


def request_rows(
    inputs: Mapping[str, np.ndarray], offset: int, rows: int, *, batched: bool
) -> Tensors:
    """One request's rows [offset, offset + rows) of the (padded) batch inputs."""
    if not batched:
        return dict(inputs)
    return {name: array[offset : offset + rows] for name, array in inputs.items()}


@dataclass(frozen=True)
class OutputSelector:
    """Picks and types a request's outputs: the ones it asked for (else the config's, else
    all public ones), top-k classification strings where asked, and a cast to the config's
    data_type when the model returned another numeric type."""

    config_outputs: tuple[str, ...]  # config.yaml's output names, in order (may be empty)
    output_types: Mapping[str, str]  # output name -> KServe datatype from config.yaml
    known: frozenset[str] | None  # names a request may ask for, when known before running
    labels: Mapping[str, Sequence[str]]
    batched: bool

    def select(
        self, requested: Sequence[RequestedOutput] | None, tensors: Mapping[str, np.ndarray]
    ) -> list[OutputTensor]:
        if requested is not None:
            return [self.output(r.name, tensors, r.classification) for r in requested]
        if self.config_outputs:
            return [self.output(name, tensors, 0) for name in self.config_outputs]
        return [
            self.output(name, tensors, 0) for name in tensors if not name.startswith(PRIVATE_PREFIX)
        ]

    def output(self, name: str, tensors: Mapping[str, np.ndarray], k: int) -> OutputTensor:
        """The tensor `name` (top `k` classes as strings when k > 0), cast to its config type."""
        data = tensors.get(name)
        if data is None:
            if self.known is not None and name in self.known:
                raise BackendError(f"the model produced no output {name!r}")
            raise InvalidRequestError(f"unknown output {name!r}", param=name)
        if k > 0:
            data = classify(data, k, self.labels.get(name), batched=self.batched)
        datatype = datatype_of(data)
        declared = self.output_types.get(name)
        if k == 0 and declared is not None and _castable(declared, datatype):
            data, datatype = data.astype(DATATYPES[declared]), declared
        return OutputTensor(name, data, datatype)


def _castable(declared: str, actual: str) -> bool:
    # BYTES is never cast to or from: a string output has no numeric value to convert.
    return declared != actual and "BYTES" not in (declared, actual)
