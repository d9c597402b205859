"""JSON tensor data <-> numpy, checked: what the KServe v2 JSON body's `inputs[].data`,
`shape` and `datatype` may hold (`from_json`), and how an output goes back as JSON (`to_json`).

Nothing here trusts the client: every number is range-checked against its datatype (1.5 is
refused for INT32, not truncated; 300 is refused for UINT8) and every shape against the data.

>>> from_json([[1, 2], [3, 4]], "INT32", [2, 2], "x").tolist()
[[1, 2], [3, 4]]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from inferd.errors import InvalidRequestError
from inferd.gateway.kserve.raw import MAX_RANK, check_extent
from inferd.tensors import DATATYPES

KNOWN_DATATYPES = (*DATATYPES, "BF16")

# Kinds of numpy array (from the JSON numbers) each datatype accepts: an integer tensor takes
# integers only (1.5 is refused, not truncated), a float tensor takes integers and floats.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_WORDS = {"b": "true/false", "iu": "integers", "iuf": "numbers"}


def check_datatype(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in KNOWN_DATATYPES:
        raise InvalidRequestError(
            f"input {name!r}: unknown datatype {value!r}; one of {', '.join(KNOWN_DATATYPES)}",
            name,
        )
    return value


def json_integer(value: Any) -> int | None:
    """A JSON integer: 2, or 2.0 (JSON Schema's `integer` includes it); None for anything else
    (1.5, "2", true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def json_natural(value: Any) -> int | None:
    n = json_integer(value)
    return n if n is not None and n >= 0 else None


def check_shape(value: Any, name: str) -> list[int]:
    dims = [json_integer(d) for d in value] if isinstance(value, list) else [None]
    if len(dims) > MAX_RANK or None in dims:
        raise InvalidRequestError(
            f"input {name!r}: shape must be a list of at most {MAX_RANK} integers", name
        )
    shape = [int(d or 0) for d in dims]
    if any(d < 0 for d in shape):
        raise InvalidRequestError(
            f"input {name!r}: shape {shape} has a negative dimension (-1 is only for metadata)",
            name,
        )
    check_extent(shape, name)
    return shape


def json_object(value: Any, what: str, param: str | None = None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be an object", param)
    return value


def from_json(data: Any, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """JSON tensor data, nested in the tensor's shape or flat, -> array of `shape`."""
    if datatype in ("BF16",):
        raise InvalidRequestError(
            f"input {name!r}: {datatype} cannot be sent as JSON; use binary data", name
        )
    bytes_type = datatype == "BYTES"
    flat = _json_strings(data, name) if bytes_type else _json_numbers(data, datatype, name)
    count = math.prod(shape)
    if flat.size != count:
        raise InvalidRequestError(
            f"input {name!r}: shape {shape} needs {count} elements but 'data' has {flat.size}",
            name,
        )
    return flat.reshape(shape)


def _json_numbers(data: Any, datatype: str, name: str) -> np.ndarray:
    dtype = DATATYPES[datatype]
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError):
        raise InvalidRequestError(
            f"input {name!r}: 'data' is neither flat nor nested in a regular shape", name
        ) from None
    if raw.size == 0:
        return np.empty(0, dtype=dtype)
    accepted = _ACCEPTED_KINDS[dtype.kind]
    if dtype.kind in "iu" and raw.dtype.kind in "fO":
        # numpy infers float64 (or object) for integers past int64 mixed with others: retry
        # element by element so UINT64 keeps every bit (and 1.5 is still refused).
        raw = _python_ints(data, raw.shape, datatype, name)
    if raw.dtype.kind not in accepted:
        raise InvalidRequestError(
            f"input {name!r}: {datatype} data must be {_KIND_WORDS[accepted]}", name
        )
    if dtype.kind in "iu" and not _in_range(raw, dtype):
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    with np.errstate(over="ignore"):  # overflow to inf is refused just below
        out = raw.astype(dtype).reshape(-1)
    if dtype.kind == "f" and dtype.itemsize < 8 and not np.isfinite(out).all():
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    return out


def _python_ints(data: Any, shape: tuple[int, ...], datatype: str, name: str) -> np.ndarray:
    items = list(_leaves(data))
    if not all(type(v) is int for v in items):
        raise InvalidRequestError(f"input {name!r}: {datatype} data must be integers", name)
    info = np.iinfo(DATATYPES[datatype])
    if not all(info.min <= v <= info.max for v in items):
        raise InvalidRequestError(f"input {name!r}: a value is out of range for {datatype}", name)
    return np.array(items, dtype=DATATYPES[datatype]).reshape(shape)


def _in_range(raw: np.ndarray, dtype: np.dtype[Any]) -> bool:
    info = np.iinfo(dtype)
    return int(raw.min()) >= info.min and int(raw.max()) <= info.max


def _json_strings(data: Any, name: str) -> np.ndarray:
    items = []
    for item in _leaves(data):
        if not isinstance(item, str):
            raise InvalidRequestError(
                f"input {name!r}: BYTES data must be strings (send other bytes as binary data)",
                name,
            )
        try:
            items.append(item.encode())
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"input {name!r}: a string is not valid UTF-8", name
            ) from None
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def _leaves(data: Any) -> Iterator[Any]:
    """The non-list items of nested lists, in order (no recursion: nesting depth is the
    client's choice)."""
    stack = [iter((data,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            yield item


_END = object()


def to_json(array: np.ndarray) -> Any:
    """A flat JSON-able form of the tensor; None when JSON cannot carry it (non-UTF-8 BYTES),
    so it goes binary instead."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind not in "OSU":
        return flat  # orjson writes numpy arrays natively (OPT_SERIALIZE_NUMPY)
    items = []
    for item in flat:
        if isinstance(item, str):
            items.append(item)
            continue
        try:
            items.append(bytes(item).decode())
        except UnicodeDecodeError:
            return None
    return items
