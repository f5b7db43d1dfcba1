"""Deltas on the wire: change entries (protocol/change_entry.py) and the payload frames they
index, checked on the way in."""
from __future__ import annotations

import msgspec

from mcpd.protocol import change_entry, codes
from mcpd.protocol.delta.field import DeltaError, DeltaLimits, FieldDelta, bad


def to_wire(deltas: list[FieldDelta]) -> tuple[list[dict], list[bytes]]:
    """Entries as msgpack-able maps {"kind", "meta", "name", "frame"} and the payload frames they
    index. Maps, not structs: the journal, the host cache and clients pack them with `msgpack`."""
    entries, frames = [], []
    for delta in deltas:
        index = None
        if delta.data is not None:
            index = len(frames)
            frames.append(delta.data)
        entry = change_entry.BY_KIND[delta.kind](name=delta.name, meta=delta.meta, frame=index)
        entries.append(msgspec.to_builtins(entry))
    return entries, frames


def from_wire(entries, frames: list, limits: DeltaLimits) -> list[FieldDelta]:
    """Deltas from a peer's entries (typed, or maps as msgpack decoded them) and frames; raises
    DeltaError. Checks the envelope: the entries' shape, names, frame indexes. `apply` checks
    each delta's meta against the limits.
    """
    names, used_frames, deltas = set(), set(), []
    for entry in change_entry.decode(entries):
        if entry.name in names:
            raise bad(f"field {entry.name!r} appears twice")
        names.add(entry.name)
        deltas.append(FieldDelta(entry.name, entry.kind, entry.meta,
                                 _frame(entry.name, entry.frame, frames, used_frames, limits)))
    return deltas


def _frame(name: str, index: int | None, frames: list, used_frames: set, limits: DeltaLimits):
    if index is None:
        return None
    if index >= len(frames):
        raise bad(f"field {name!r}: frame must be nil or an index below {len(frames)}, not {index!r}")
    if index in used_frames:
        raise bad(f"field {name!r}: frame {index} is already used by another field")
    used_frames.add(index)
    frame = frames[index]
    # A payload frame is never larger than its field (zstd is only used when it shrinks data).
    if memoryview(frame).nbytes > limits.max_field_bytes:
        raise DeltaError(codes.TOO_LARGE,
                         f"field {name!r}: payload frame of {memoryview(frame).nbytes} bytes; "
                         f"the limit is {limits.max_field_bytes}")
    return frame
