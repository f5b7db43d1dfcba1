"""A named tensor's header as a request carries it (name, datatype, shape; its bytes are a frame
of their own), and the checks it passes before any frame is read. Without numpy: the protocol
checks headers in the front-end, and the client library loads it (tensors.py has the arrays)."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

DATATYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES")
MAX_RANK = 8
MAX_DIM = (1 << 31) - 1


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's description in a request or reply header; its bytes are a payload frame."""
    name: str
    datatype: str
    shape: tuple[int, ...]

    def describe(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def check_header(header: TensorHeader) -> None:
    """The checks a header passes before its frame is read (the front-end runs them)."""
    if header.datatype not in DATATYPES:
        raise MCPDError(codes.BAD_INPUT, f"input {header.name!r}: datatype {header.datatype!r}; use one of "
                                         f"{', '.join(DATATYPES)}")
    if not 0 < len(header.shape) <= MAX_RANK or not all(type(d) is int and 0 <= d <= MAX_DIM for d in header.shape):
        raise MCPDError(codes.BAD_INPUT, f"input {header.name!r}: a shape is 1..{MAX_RANK} integers 0..{MAX_DIM}")


def element_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim   # Python integers: a hostile 2^40-element shape is a number, not an allocation
    return count
