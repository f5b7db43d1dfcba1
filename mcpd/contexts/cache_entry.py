"""How a record (record.py) lies in a host cache entry: u32 length of a msgpack [map, frame
sizes], that, then the frames. The map is small and parsed first; the frames go in as they are
(the arena copies each part straight into its pages, never into one buffer first) and come out
as views of the entry."""
from __future__ import annotations

import struct

import msgpack

from mcpd.contexts.record import Record

_LENGTH = struct.Struct("<I")


def pack(record: Record) -> list:
    """The entry as parts for ShmArena.put (empty frames add nothing: left out, a snapshot of
    many scalar fields is a few parts, not thousands)."""
    sizes = [memoryview(frame).nbytes for frame in record.frames]
    packed = msgpack.packb([record.meta, sizes])
    return [_LENGTH.pack(len(packed)), packed, *(frame for frame, size in zip(record.frames, sizes) if size)]


def unpack(blob: bytearray) -> Record:
    (length,) = _LENGTH.unpack_from(blob)
    meta, sizes = msgpack.unpackb(blob[_LENGTH.size:_LENGTH.size + length], raw=False)
    at, views = _LENGTH.size + length, []
    for nbytes in sizes:
        views.append(memoryview(blob)[at:at + nbytes])
        at += nbytes
    return Record(meta, views)
