"""Named tensors as requests carry them: a name, a datatype (KServe v2's names, which Triton,
KServe and MLServer speak), a shape, and raw bytes in their own frame.

Raw bytes are little-endian and in C order. A BYTES tensor's raw form is each element as a
4-byte little-endian length and then its bytes (the KServe binary extension's form); it becomes
a numpy object array of bytes. Every check runs before anything is allocated from a peer's
numbers: a shape's element count must match the bytes that really arrived.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from mcpd.handlers.tensor_header import TensorHeader, check_header, element_count  # noqa: F401 (theirs too)
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

BAD_INPUT = codes.BAD_INPUT
VARIABLE = -1   # in a declared shape: any size (the batch dim, or a length-binned one)

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"), "BYTES": np.dtype(object),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items() if name != "BYTES"}
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class TensorSpec:
    """What a handler declares for one input or output: its datatype and shape, the first dim the
    batch's rows (VARIABLE), VARIABLE elsewhere for a dim that varies between requests."""
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.datatype not in DTYPES:
            raise ValueError(f"datatype {self.datatype!r}: use one of {', '.join(DTYPES)}")
        if not self.shape or self.shape[0] != VARIABLE:
            raise ValueError("a tensor's first dim is the batch's rows: declare it -1")

    def check(self, name: str, array: np.ndarray) -> None:
        """Raise BAD_INPUT unless `array` (decoded from a request) is what this spec declares."""
        if datatype_of(array) != self.datatype:
            raise MCPDError(BAD_INPUT, f"input {name!r} is {datatype_of(array)}; the model takes {self.datatype}")
        if len(array.shape) != len(self.shape) or any(
                want != VARIABLE and got != want for want, got in zip(self.shape, array.shape)):
            raise MCPDError(BAD_INPUT, f"input {name!r} has shape {list(array.shape)}; the model takes "
                                       f"{list(self.shape)} (-1: any)")


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == object:
        return "BYTES"
    name = _NAMES.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)
    if name is None:
        raise ValueError(f"numpy dtype {array.dtype} has no KServe datatype")
    return name


def decode(header: TensorHeader, frame: bytes) -> np.ndarray:
    """The tensor a header and its frame describe, or BAD_INPUT naming what is wrong."""
    check_header(header)
    count = element_count(header.shape)
    if header.datatype == "BYTES":
        return _decode_bytes(header, frame, count)
    itemsize = DTYPES[header.datatype].itemsize
    if count * itemsize != len(frame):
        raise MCPDError(BAD_INPUT, f"input {header.name!r}: shape {list(header.shape)} of {header.datatype} is "
                                   f"{count * itemsize} bytes; its frame has {len(frame)}")
    return np.frombuffer(frame, DTYPES[header.datatype]).reshape(header.shape)


def _decode_bytes(header: TensorHeader, frame: bytes, count: int) -> np.ndarray:
    if count * _LENGTH.size > len(frame):   # every element takes at least its length prefix
        raise MCPDError(BAD_INPUT, f"input {header.name!r}: {count} BYTES elements cannot fit in {len(frame)} bytes")
    items, at = [], 0
    view = memoryview(frame)
    for _ in range(count):
        if at + _LENGTH.size > len(frame):
            raise MCPDError(BAD_INPUT, f"input {header.name!r}: its frame ends inside an element's length")
        (length,) = _LENGTH.unpack_from(frame, at)
        at += _LENGTH.size
        if at + length > len(frame):
            raise MCPDError(BAD_INPUT, f"input {header.name!r}: an element of {length} bytes runs past the frame")
        items.append(bytes(view[at:at + length]))
        at += length
    if at != len(frame):
        raise MCPDError(BAD_INPUT, f"input {header.name!r}: {len(frame) - at} bytes after its {count} elements")
    array = np.empty(count, object)
    array[:] = items
    return array.reshape(header.shape)


def encode(name: str, array: np.ndarray) -> tuple[TensorHeader, bytes]:
    """A tensor as its header and frame (little-endian, C order; BYTES length-prefixed)."""
    datatype = datatype_of(array)
    if datatype == "BYTES":
        frame = b"".join(_LENGTH.pack(len(item)) + item for item in (_as_bytes(x) for x in array.reshape(-1)))
    else:
        frame = np.ascontiguousarray(array, DTYPES[datatype]).tobytes()
    return TensorHeader(name, datatype, tuple(int(d) for d in array.shape)), frame


def _as_bytes(item) -> bytes:
    return item.encode() if isinstance(item, str) else bytes(item)
