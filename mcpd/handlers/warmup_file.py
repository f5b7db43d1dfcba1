"""The file of inputs a handler's result cache is warmed from at start ([..cache] warmup): a
msgpack array of requests, each a map
    {"tenant": str (1..64 characters, default "default"),
     "inputs": [{"name": str, "datatype": str, "shape": [int, ...]}, ...],
     "payload": [bytes, ...]}            # payload[i] = input i's raw bytes, as an `infer` frame
The worker runs them through the model and caches the results for that tenant. Every entry is
checked as a request is (tensors.check_header here, the bytes when the worker decodes them).
"""
from __future__ import annotations

import msgspec

from mcpd import small_file
from mcpd.handlers.tensors import TensorHeader, check_header
from mcpd.protocol.codes import MCPDError

MAX_FILE_BYTES = 1 << 30   # it is read whole at start


class _Input(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    datatype: str
    shape: list[int]


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[_Input]
    payload: list[bytes]
    tenant: str = "default"


class WarmInput(msgspec.Struct, frozen=True):
    tenant: str
    headers: tuple[TensorHeader, ...]
    frames: tuple[bytes, ...]


def read_warmup(path: str, max_bytes: int = MAX_FILE_BYTES) -> list[WarmInput]:
    """The requests in a warm-up file. Raises ValueError naming the file, and the entry, at fault."""
    try:   # a FIFO in its place would hang the worker's start, a device flood it
        entries = msgspec.msgpack.decode(small_file.read_bytes(path, max_bytes), type=list[_Entry])
        return [_checked(entry, at) for at, entry in enumerate(entries)]
    except (OSError, ValueError, msgspec.DecodeError) as e:
        raise ValueError(f"cache warmup file {path}: {e}") from None


def _checked(entry: _Entry, at: int) -> WarmInput:
    if not 0 < len(entry.tenant) <= 64:
        raise ValueError(f"entry {at}: a tenant is 1..64 characters")
    if len(entry.inputs) != len(entry.payload):
        raise ValueError(f"entry {at}: {len(entry.inputs)} inputs but {len(entry.payload)} payload frames")
    headers = tuple(TensorHeader(i.name, i.datatype, tuple(i.shape)) for i in entry.inputs)
    try:
        for header in headers:
            check_header(header)
    except MCPDError as e:
        raise ValueError(f"entry {at}: {e.message}") from None
    return WarmInput(entry.tenant, headers, tuple(entry.payload))


def write_warmup(path: str, requests: list[WarmInput]) -> None:
    """A warm-up file of these requests (for operators' scripts and the tests)."""
    entries = [_Entry([_Input(h.name, h.datatype, list(h.shape)) for h in r.headers], list(r.frames), r.tenant)
               for r in requests]
    with open(path, "wb") as f:
        f.write(msgspec.msgpack.encode(entries))
