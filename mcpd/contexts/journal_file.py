"""The context journal's files on disk: records that can be found again after damage.

Format 2 (this one), for the snapshot and the journal alike:

    file   = FILE_MAGIC record*
    record = RECORD_MAGIC (4 bytes) | body length u32 | crc32(body) u32 | crc32 of those 12 bytes u32
             | body (a msgpack map)

Why a marker and a header with its own checksum: format 1 was [length u32][crc32 u32][body], so
one flipped bit in a length made every later record unreadable, and its reader cut the file
there: one bit lost every context with a record after it. A reader of format 2 that meets
a damaged record searches for the next RECORD_MAGIC whose header checksum holds and whose body
matches its checksum, and goes on from there: damage costs the records it touches, nothing more.
A false start inside a body would need both checksums to match by chance (about 1 in 2^64).

Format 1 files (no FILE_MAGIC) are still read, up to their first damaged
record (nothing marks where the next one begins); the journal migrates them to format 2 at start.
A file whose first bytes are damaged is still recognised as format 2 by its records.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from mcpd.contexts.record import Record

FILE_MAGIC = b"MCPDJ2\r\n"
RECORD_MAGIC = b"\xd3JR\x02"
HEADER = struct.Struct("<4sIII")   # magic, body length, crc32(body), crc32(the 12 bytes before)
V1_HEADER = struct.Struct("<II")   # format 1: body length, crc32(body)


@dataclass
class Contents:
    """What could be read from one file."""
    format: int
    records: list[dict] = field(default_factory=list)
    damage: list[tuple[int, int]] = field(default_factory=list)   # (offset, length) no record could be read from
    size: int = 0

    @property
    def damaged_bytes(self) -> int:
        return sum(length for _, length in self.damage)


def encode(body_map: dict) -> bytes:
    body = msgpack.packb(body_map)
    head = struct.pack("<4sII", RECORD_MAGIC, len(body), zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def decode(data: bytes) -> dict | None:
    """The map of one record as encode() made it, or None when its checksums or body do not hold."""
    found = _record_at(data, 0)
    return found[0] if found is not None and found[1] == len(data) else None


def read(path: Path) -> Contents:
    """Every record of the file whose checksums hold, and the byte ranges that held none."""
    data = path.read_bytes()
    if data.startswith(FILE_MAGIC):
        return _read_v2(data, len(FILE_MAGIC))
    if not data or _has_record(data):
        return _read_v2(data, 0)
    return _read_v1(data)


def _has_record(data: bytes) -> bool:
    offset = data.find(RECORD_MAGIC)
    while offset >= 0:
        if _record_at(data, offset) is not None:
            return True
        offset = data.find(RECORD_MAGIC, offset + 1)
    return False


def _read_v2(data: bytes, start: int) -> Contents:
    contents, offset, bad_from = Contents(2, size=len(data)), start, None
    while offset < len(data):
        found = _record_at(data, offset)
        if found is None:
            bad_from = offset if bad_from is None else bad_from
            offset = data.find(RECORD_MAGIC, offset + 1)
            offset = len(data) if offset < 0 else offset
            continue
        if bad_from is not None:
            contents.damage.append((bad_from, offset - bad_from))
            bad_from = None
        record, offset = found
        contents.records.append(record)
    if bad_from is not None:
        contents.damage.append((bad_from, len(data) - bad_from))
    return contents


def _record_at(data: bytes, offset: int) -> tuple[dict, int] | None:
    """The record at offset and the offset after it, or None if no intact record starts there."""
    if offset < 0 or offset + HEADER.size > len(data):
        return None
    magic, length, crc, head_crc = HEADER.unpack_from(data, offset)
    start = offset + HEADER.size
    if magic != RECORD_MAGIC or zlib.crc32(data[offset:start - 4]) != head_crc or start + length > len(data):
        return None
    body = data[start:start + length]
    if zlib.crc32(body) != crc:
        return None
    record = _decoded(body)
    return (record, start + length) if record is not None else None


def _read_v1(data: bytes) -> Contents:
    contents, offset = Contents(1, size=len(data)), 0
    while offset + V1_HEADER.size <= len(data):
        length, crc = V1_HEADER.unpack_from(data, offset)
        start = offset + V1_HEADER.size
        body = data[start:start + length]
        record = _decoded(body) if start + length <= len(data) and zlib.crc32(body) == crc else None
        if record is None:
            break
        contents.records.append(record)
        offset = start + length
    if offset < len(data):
        contents.damage.append((offset, len(data) - offset))
    return contents


def _decoded(body: bytes) -> dict | None:
    """The body's map; None for one that is not (its checksum held, but it cannot be used)."""
    try:
        record = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("op"), str) else None


def encode_record(op: str, record: Record, **extra) -> bytes:
    """A commit or a snapshot (record.py) as one journal record: its frames inside the body."""
    return encode({"op": op, **extra, **record.meta, "frames": record.frames})


def record_of(body: dict) -> Record:
    """The record a commit or snapshot body holds, for commit.decode or snapshot.decode."""
    return Record(body, body["frames"])
