"""Checks a decoded request against its model before anything is queued (failures: 400).

The gateway already checked the protocol (each tensor's data matches its shape and datatype);
this checks the model: input names, datatypes, ranks, fixed dims, batch size, requested
outputs, priority. Config dims exclude the batch dimension; request shapes include it when
max_batch_size > 0 (Triton's convention).

>>> from inferd.model_config import ModelRepoConfig
>>> cfg = ModelRepoConfig.model_validate({"backend": "python", "max_batch_size": 4,
...     "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}]})
>>> InputValidator(cfg, ())({"x": np.zeros((2, 3), np.float32)})
2
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.admission.timeouts import effective_timeout
from inferd.backends.base import TensorSpec
from inferd.errors import InvalidRequestError
from inferd.model_config import ModelRepoConfig
from inferd.tensors import DATATYPES, RequestedOutput, datatype_of


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # batch dim excluded; -1 varies
    optional: bool = False


def input_specs(config: ModelRepoConfig, declared: Sequence[TensorSpec]) -> list[InputSpec]:
    """The config's inputs, else what the backend declares (its batch dim dropped)."""
    if config.input:
        return [InputSpec(t.name, t.data_type, t.dims, t.optional) for t in config.input]
    skip = 1 if config.max_batch_size > 0 else 0
    return [InputSpec(s.name, s.datatype, tuple(s.shape[skip:])) for s in declared]


class InputValidator:
    """Callable: client tensors -> the request's batch rows (1 when the model has no batch dim)."""

    def __init__(self, config: ModelRepoConfig, declared: Sequence[TensorSpec]) -> None:
        self.specs = {s.name: s for s in input_specs(config, declared)}
        self.max_batch_size = config.max_batch_size
        self._required = [s.name for s in self.specs.values() if not s.optional]

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> int:
        if not inputs:
            raise InvalidRequestError("the request has no inputs", param="inputs")
        for name in self._required:
            if name not in inputs:
                raise InvalidRequestError(f"input {name!r} is missing", param=name)
        rows: int | None = None
        for name, array in inputs.items():
            self._check(name, array)
            n = array.shape[0] if self.max_batch_size > 0 else 1
            if rows is not None and n != rows:
                raise InvalidRequestError(
                    f"input {name!r} has batch size {n}, other inputs have {rows}", param=name
                )
            rows = n
        assert rows is not None
        return rows

    def _check(self, name: str, array: np.ndarray) -> None:
        spec = self.specs.get(name)
        if spec is None:
            if not self.specs:  # nothing declared anywhere: the backend checks
                self._check_batch(name, array, None)
                return
            raise InvalidRequestError(
                f"unknown input {name!r}; the model takes {sorted(self.specs)}", param=name
            )
        got = _datatype(name, array)
        if got != spec.datatype:
            raise InvalidRequestError(
                f"input {name!r} has datatype {got}, the model expects {spec.datatype}",
                param=name,
            )
        self._check_batch(name, array, spec)
        skip = 1 if self.max_batch_size > 0 else 0
        for want, size in zip(spec.dims, array.shape[skip:], strict=True):
            if want != -1 and want != size:
                raise InvalidRequestError(
                    f"input {name!r} has shape {list(array.shape)}, the model expects "
                    f"{_expected(spec, self.max_batch_size)}",
                    param=name,
                )

    def _check_batch(self, name: str, array: np.ndarray, spec: InputSpec | None) -> None:
        batched = self.max_batch_size > 0
        if spec is not None and array.ndim != len(spec.dims) + batched:
            raise InvalidRequestError(
                f"input {name!r} has shape {list(array.shape)} (rank {array.ndim}), the model "
                f"expects {_expected(spec, self.max_batch_size)}",
                param=name,
            )
        if not batched:
            return
        if array.ndim == 0 or not 1 <= array.shape[0] <= self.max_batch_size:
            size = array.shape[0] if array.ndim else "no"
            raise InvalidRequestError(
                f"input {name!r} has batch size {size}; the model takes 1 to "
                f"{self.max_batch_size} rows per request",
                param=name,
            )


# dtype -> KServe name, for a lookup per input instead of datatype_of's scan (hot path).
_NAMES: dict[np.dtype[Any], str] = {dtype: name for name, dtype in DATATYPES.items()}


def _datatype(name: str, array: np.ndarray) -> str:
    found = _NAMES.get(array.dtype)
    if found is not None:
        return found
    try:
        return datatype_of(array)
    except ValueError as e:
        raise InvalidRequestError(f"input {name!r}: {e}", param=name) from e


def _expected(spec: InputSpec, max_batch_size: int) -> list[int]:
    return ([-1] if max_batch_size > 0 else []) + list(spec.dims)


def check_requested_outputs(
    requested: Iterable[RequestedOutput] | None, known: frozenset[str] | None
) -> None:
    """Unknown names (when the outputs are known before running) and bad `classification`."""
    if requested is None:
        return
    for out in requested:
        if known is not None and out.name not in known:
            raise InvalidRequestError(
                f"unknown output {out.name!r}; the model produces {sorted(known)}",
                param=out.name,
            )
        if out.classification < 0:
            raise InvalidRequestError(
                f"output {out.name!r}: classification must be >= 0", param=out.name
            )


@dataclass(frozen=True)
class QueueRules:
    """Priority and queue timeout of one model (dynamic_batching + server defaults)."""

    priority_levels: int = 0  # 0: one level
    default_priority: int = 1
    default_timeout_s: float | None = None
    allow_timeout_override: bool = True

    def priority(self, requested: int) -> int:
        """1 is the highest level. 0 asks for the default. With no levels configured the
        request's priority is ignored (Triton does the same), so every request shares one."""
        if self.priority_levels == 0:
            return 1
        if requested == 0:
            return self.default_priority
        if not 1 <= requested <= self.priority_levels:
            raise InvalidRequestError(
                f"priority {requested} is out of range: this model has priority levels 1 "
                f"(highest) to {self.priority_levels}",
                param="priority",
            )
        return requested

    def timeout_s(self, timeout_us: int) -> float | None:
        """The request's queue timeout: it may only shorten the model's default."""
        if timeout_us < 0:
            raise InvalidRequestError("timeout must be >= 0", param="timeout")
        if timeout_us == 0 or not self.allow_timeout_override:
            return self.default_timeout_s
        return effective_timeout(self.default_timeout_s, timeout_us / 1e6)
