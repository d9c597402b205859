"""Raw tensor bytes, as the binary HTTP extension and gRPC raw_*_contents carry them.

Fixed-size types: little-endian, row-major, no padding. BYTES: each element a 4-byte
little-endian length followed by its bytes. BOOL: one byte, 0 or 1.

>>> import numpy as np
>>> decode_raw(encode_raw(np.array([b"ab", b""], dtype=object)), "BYTES", [2]).tolist()
[b'ab', b'']
"""

from __future__ import annotations

import math
import struct

import numpy as np

from inferd.errors import InvalidRequestError
from inferd.tensors import DATATYPES

_LEN = struct.Struct("<I")
# More elements than any tensor a server holds; below numpy's limit, which it applies to the
# non-zero dims even of an empty tensor (a [0, 2**63 - 1] shape is refused by numpy).
MAX_ELEMENTS = 2**40
MAX_RANK = 32  # numpy's limit is 64; no served model comes near either


def check_extent(shape: list[int], name: str) -> None:
    """InvalidRequestError when the shape's non-zero dims multiply past MAX_ELEMENTS: a size no
    request can carry, or an empty tensor numpy cannot make (it would fail as a 500)."""
    extent = 1
    for d in shape:
        extent *= max(d, 1)
        if extent > MAX_ELEMENTS:
            raise InvalidRequestError(
                f"input {name!r}: shape {shape} is larger than {MAX_ELEMENTS} elements", name
            )


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (BF16: 2); 0 for BYTES."""
    if datatype == "BYTES":
        return 0
    if datatype == "BF16":
        return 2
    return DATATYPES[datatype].itemsize


def decode_raw(
    raw: bytes | memoryview, datatype: str, shape: list[int], name: str = ""
) -> np.ndarray:
    """Bytes -> array of `shape`; InvalidRequestError when the size does not match."""
    count = math.prod(shape)
    label = f"input {name!r}: " if name else ""
    if datatype == "BYTES":
        return _decode_bytes(raw, count, shape, label)
    if datatype not in DATATYPES:
        raise InvalidRequestError(f"{label}datatype {datatype} is not supported", name or None)
    dtype = DATATYPES[datatype].newbyteorder("<")
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequestError(
            f"{label}expected {expected} bytes for shape {shape} of {datatype}, got {len(raw)}",
            name or None,
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if datatype == "BOOL" and array.size and np.any(array.view(np.uint8) > 1):
        raise InvalidRequestError(f"{label}BOOL bytes must be 0 or 1", name or None)
    return array.astype(DATATYPES[datatype], copy=False)


def _decode_bytes(raw: bytes | memoryview, count: int, shape: list[int], label: str) -> np.ndarray:
    view = memoryview(raw)
    # Each element needs at least its 4-byte length: refuse before allocating `count` slots.
    if 4 * count > len(view):
        raise InvalidRequestError(f"{label}{len(view)} bytes cannot hold {count} BYTES elements")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(view):
            raise InvalidRequestError(f"{label}BYTES data ends inside element {i} of {count}")
        (n,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise InvalidRequestError(f"{label}BYTES element {i} claims {n} bytes past the end")
        out[i] = bytes(view[pos : pos + n])
        pos += n
    if pos != len(view):
        extra = len(view) - pos
        raise InvalidRequestError(f"{label}{extra} bytes left over after {count} elements")
    return out.reshape(shape)


def encode_raw(array: np.ndarray) -> bytes:
    """Array -> raw bytes (object/str/bytes arrays as length-prefixed BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        parts = []
        for item in array.reshape(-1):
            data = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(_LEN.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def from_binary(raw: memoryview, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """A tensor from request bytes (HTTP binary extension, raw binary request), writeable, with
    the size checked before anything of the claimed size is allocated."""
    count = math.prod(shape)
    if datatype == "BF16":
        raise InvalidRequestError(f"input {name!r}: BF16 is not supported by inferd", name)
    if datatype == "BYTES" and count * 4 > len(raw):
        # Each element carries a 4-byte length: refuse before allocating `count` objects.
        raise InvalidRequestError(
            f"input {name!r}: {len(raw)} bytes cannot hold {count} BYTES elements", name
        )
    array = decode_raw(raw, datatype, shape, name)
    # frombuffer over the request body is read-only; steps and backends may write in place.
    return array if array.flags.writeable else array.copy()
