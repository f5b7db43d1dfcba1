"""How a context's entries in the host cache are laid out: u32 length of a msgpack map, the map,
then payloads whose sizes the map gives. The map is small and parsed first; the payloads go in as
they are (the arena copies each part straight into its pages, never into one buffer first) and
come out as views of the entry."""
from __future__ import annotations

import struct

import msgpack

_LENGTH = struct.Struct("<I")


def pack(meta: dict, payloads: list) -> list:
    """The entry as parts for ShmArena.put (empty payloads add nothing: left out, a snapshot of
    many scalar fields is a few parts, not thousands)."""
    packed = msgpack.packb(meta)
    return [_LENGTH.pack(len(packed)), packed, *(p for p in payloads if memoryview(p).nbytes)]


def unpack(blob: bytearray, sizes_of) -> tuple[dict, list[memoryview]]:
    """The map, and the payloads as views of blob; sizes_of(map) says their sizes in order."""
    (length,) = _LENGTH.unpack_from(blob)
    meta = msgpack.unpackb(blob[_LENGTH.size:_LENGTH.size + length], raw=False)
    at, views = _LENGTH.size + length, []
    for nbytes in sizes_of(meta):
        views.append(memoryview(blob)[at:at + nbytes])
        at += nbytes
    return meta, views
