"""Deltas on the wire: msgpack-able entries and the payload frames they index, checked on the way in."""
from __future__ import annotations

from mcpd.protocol import codes
from mcpd.protocol.delta.field import DeltaError, DeltaLimits, FieldDelta, KINDS, MAX_NAME_CHARS, bad


def to_wire(deltas: list[FieldDelta]) -> tuple[list[dict], list[bytes]]:
    """msgpack-able entries {"name", "kind", "meta", "frame"} and the payload frames they index."""
    entries, frames = [], []
    for delta in deltas:
        index = None
        if delta.data is not None:
            index = len(frames)
            frames.append(delta.data)
        entries.append({"name": delta.name, "kind": delta.kind, "meta": delta.meta, "frame": index})
    return entries, frames


def from_wire(entries, frames: list, limits: DeltaLimits) -> list[FieldDelta]:
    """Deltas from a peer's entries (as msgpack decoded them) and frames; raises DeltaError.

    Checks the envelope: types, names, frame indexes. `apply` checks each delta's meta.
    `meta` may be left out (as {}), and so may `frame` (as nil); unknown entry keys are ignored,
    like unknown header keys, so a newer peer can add some.
    """
    if not isinstance(entries, (list, tuple)):
        raise bad(f"deltas must be an array, not {type(entries).__name__}")
    names, used_frames, deltas = set(), set(), []
    for entry in entries:
        delta = _entry(entry, frames, used_frames, limits)
        if delta.name in names:
            raise bad(f"field {delta.name!r} appears twice")
        names.add(delta.name)
        deltas.append(delta)
    return deltas


def _entry(entry, frames: list, used_frames: set, limits: DeltaLimits) -> FieldDelta:
    if not isinstance(entry, dict):
        raise bad(f"a delta must be a map, not {type(entry).__name__}")
    name, kind, meta, index = entry.get("name"), entry.get("kind"), entry.get("meta", {}), entry.get("frame")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise bad(f"a field name must be a str of 1..{MAX_NAME_CHARS} characters")
    if kind not in KINDS:
        raise bad(f"field {name!r}: kind must be one of {', '.join(KINDS)}")
    if not isinstance(meta, dict) or not all(isinstance(key, str) for key in meta):
        raise bad(f"field {name!r}: meta must be a map with str keys")
    return FieldDelta(name, kind, meta, _frame(name, index, frames, used_frames, limits))


def _frame(name: str, index, frames: list, used_frames: set, limits: DeltaLimits):
    if index is None:
        return None
    if type(index) is not int or not 0 <= index < len(frames):
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
