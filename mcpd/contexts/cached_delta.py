"""One committed version of a context as a host cache entry: the deltas that made it from the
version before (as the store's listeners heard them), replayed on top of a snapshot at restore.

The map holds owner, id, the version the deltas produce, the fields that version changed and
deleted (as the context's bookkeeping recorded them: a turn that appended no tokens changes
`tokens` with no delta), and the deltas' wire entries (codec.to_wire); the payloads are their
frames.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.contexts import cache_entry
from mcpd.contexts.context import REPLAY_LIMITS, Context
from mcpd.protocol import delta as codec
from mcpd.protocol.delta import FieldDelta


@dataclass(frozen=True)
class CachedDelta:
    owner: str
    context_id: str
    version: int
    changed: set[str]
    deleted: set[str]
    changes: list[FieldDelta]
    weight: int   # what it counts toward the next snapshot: see `weight`

    def replay(self, context: Context) -> None:
        """Commit this version onto the context at the version before, as the store did."""
        fields = dict(context.fields)
        for change in self.changes:
            value = codec.apply(fields.get(change.name), change, REPLAY_LIMITS)
            if value is codec.DELETED:
                fields.pop(change.name, None)
            else:
                fields[change.name] = value
        context.commit(fields, self.changed, self.deleted)


def encode(context: Context, changes: list[FieldDelta]) -> tuple[list, int]:
    """The entry's parts for the context's current version, made by `changes`, and its weight."""
    entries, frames = codec.to_wire(changes)
    parts = cache_entry.pack({
        "owner": context.owner, "id": context.id, "version": context.version,
        "changed": sorted(context.changed_now), "deleted": sorted(context.deleted_now),
        "changes": entries, "frames": [memoryview(frame).nbytes for frame in frames]}, frames)
    return parts, weight(entries, sum(memoryview(part).nbytes for part in parts))


def decode(blob: bytearray) -> CachedDelta:
    meta, frames = cache_entry.unpack(blob, lambda m: m["frames"])
    return CachedDelta(meta["owner"], meta["id"], meta["version"], set(meta["changed"]), set(meta["deleted"]),
                       codec.from_wire(meta["changes"], frames, REPLAY_LIMITS), weight(meta["changes"], len(blob)))


def weight(entries: list[dict], stored: int) -> int:
    """The entry's bytes or, when more, the decoded bytes of the new values it brings (set and
    append payloads). A snapshot will have to hold those: counting them decoded makes a big but
    compressible value (zeros) snapshot at the commit that brings it, so a context the cache
    cannot hold whole is refused then, not at a later small commit that happens to compact."""
    brought = sum(entry["meta"]["nbytes"] for entry in entries
                  if entry["kind"] in ("set", "append") and entry["meta"].get("type") != "scalar")
    return max(stored, brought)
