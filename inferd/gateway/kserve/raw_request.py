"""The raw binary request (`Inference-Header-Content-Length: 0`): the whole body is the one
input of a single-input model, its variable dim (if any) following from the byte count.

    spec = raw_input_spec(repository.config_dict(model, version))
    request = decode_raw_request(body, spec, model, version)   # every output comes back binary
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve.codec import HEADER_LENGTH
from inferd.gateway.kserve.raw import element_size, from_binary
from inferd.tensors import DATATYPES, InferRequest


@dataclass(frozen=True)
class InputSpec:
    """The one input a raw binary request may feed, from the model's config."""

    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dim; -1 varies
    batched: bool  # max_batch_size > 0: the request gets a batch dim of 1


def raw_input_spec(config: Mapping[str, Any]) -> InputSpec:
    """The input of a model that can take a raw binary request, from its Triton-style config
    (`ModelRepository.config_dict`): exactly one input with at most one variable dim."""
    inputs = config.get("input") or []
    if len(inputs) != 1:
        raise InvalidRequestError(
            f"a raw binary request ({HEADER_LENGTH}: 0) needs a model with exactly one input; "
            f"this one has {len(inputs)}"
        )
    spec = inputs[0]
    datatype = str(spec.get("datatype") or spec.get("data_type", "")).removeprefix("TYPE_")
    datatype = "BYTES" if datatype == "STRING" else datatype
    dims = tuple(int(d) for d in spec.get("dims", ()))
    return InputSpec(str(spec["name"]), datatype, dims, int(config.get("max_batch_size", 0)) > 0)


def decode_raw_request(body: bytes, spec: InputSpec, model: str, version: str = "") -> InferRequest:
    """The whole body is one tensor of the model's single input, batch 1 when batched; its one
    variable dim (if any) follows from the byte count. Every output comes back binary."""
    if spec.dims.count(-1) > 1:
        raise InvalidRequestError(
            f"a raw binary request needs an input with at most one variable dim; "
            f"{spec.name!r} has dims {list(spec.dims)}"
        )
    bytes_type = spec.datatype == "BYTES"
    array = _raw_bytes_element(body, spec) if bytes_type else _raw_fixed(body, spec)
    if spec.batched:
        array = array.reshape((1, *array.shape))
    return InferRequest(
        model_name=model,
        model_version=version,
        inputs={spec.name: array},
        parameters={"binary_data_output": True},
    )


def _raw_bytes_element(body: bytes, spec: InputSpec) -> np.ndarray:
    # BYTES: the body is the single element itself, without the 4-byte length prefix.
    if spec.dims not in ((1,), (-1,)):
        raise InvalidRequestError(
            f"a raw binary request for BYTES input {spec.name!r} needs dims [1], "
            f"not {list(spec.dims)}"
        )
    out = np.empty(1, dtype=object)
    out[0] = bytes(body)
    return out


def _raw_fixed(body: bytes, spec: InputSpec) -> np.ndarray:
    if spec.datatype not in DATATYPES:
        raise InvalidRequestError(f"input {spec.name!r}: {spec.datatype} is not supported")
    fixed = math.prod(d for d in spec.dims if d != -1) * element_size(spec.datatype)
    shape = list(spec.dims)
    if -1 in spec.dims:
        if len(body) % fixed:
            raise InvalidRequestError(
                f"a raw binary request of {len(body)} bytes is not a whole number of "
                f"{fixed}-byte rows for input {spec.name!r} {list(spec.dims)}"
            )
        shape[shape.index(-1)] = len(body) // fixed
    return from_binary(memoryview(body), spec.datatype, shape, spec.name)
