"""A whole context as one record (record.py): what the journal's snapshot holds of each context,
and what a host cache chain of commits starts from.

The map holds id, owner, version, the per-field version bookkeeping `changes_since` needs, and
each field's name, kind and type (a scalar's value itself); the frames are the other fields'
bytes in order, as they are (no copy, no compression: the cache rewrites small contexts whole at
every commit). Arrays come back with their dtype (byte order included), shape and bytes,
bit-identical. Older journal snapshots held each field as a delta from nothing (codec.diff): they
are still read.
"""
from __future__ import annotations

import numpy as np

from mcpd.contexts.context import REPLAY_LIMITS, Context
from mcpd.contexts.record import Record
from mcpd.protocol import delta as codec

_SCALARS = (int, float, bool, type(None))


def encode(context: Context) -> Record:
    described, frames = [], []
    for name, value in context.fields.items():
        if type(value) in _SCALARS:   # most fields of a context of many: no frame to describe
            described.append([name, "scalar", value])
            continue
        kind, info, frame = _describe(value)
        described.append([name, kind, info])
        frames.append(frame)
    return Record({"id": context.id, "owner": context.owner, "version": context.version,
                   "changed_at": context.changed_at, "deleted_at": context.deleted_at,
                   "token_count_at": list(context.token_count_at.items()),
                   "tokens_rewritten_at": context.tokens_rewritten_at, "fields": described}, frames)


def decode(record: Record) -> Context:
    meta = record.meta
    if "fields" not in meta:
        return _from_deltas(meta, record.frames)
    frames = iter(record.frames)
    fields = {name: info if kind == "scalar" else _value(kind, info, next(frames)) for name, kind, info in meta["fields"]}
    return _context(meta, fields, dict(map(tuple, meta["token_count_at"])))


def _from_deltas(meta: dict, frames: list) -> Context:
    """An older journal snapshot record: each field a delta from nothing."""
    changes = codec.from_wire(meta["changes"], frames, REPLAY_LIMITS)
    return _context(meta, {c.name: codec.apply(None, c, REPLAY_LIMITS) for c in changes}, dict(meta["token_count_at"]))


def _context(meta: dict, fields: dict, token_count_at: dict) -> Context:
    return Context(meta["id"], meta["owner"], meta["version"], fields, meta["changed_at"], meta["deleted_at"],
                   token_count_at, meta["tokens_rewritten_at"])


def _describe(value) -> tuple[str, object, memoryview | bytes]:
    if isinstance(value, np.ndarray):
        return "array", [value.dtype.str, list(value.shape)], memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    if isinstance(value, bytes):
        return "bytes", None, value
    return "str", None, value.encode()


def _value(kind: str, info, frame):
    if kind == "array":
        dtype, shape = info
        # A copy the context owns, writable like every array the store holds.
        return np.frombuffer(frame, np.dtype(dtype)).reshape(shape).copy()
    return bytes(frame) if kind == "bytes" else str(frame, "utf-8")
