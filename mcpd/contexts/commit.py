"""One committed version of a context: the deltas that made it from the version before, encoded
once by the store for every listener (record.py), and the one way any saved version is replayed.

The map holds owner, id, the version the deltas produce, the fields that version changed and
deleted (as the context's bookkeeping recorded them: a turn that appended no tokens changes
`tokens` with no delta), and the deltas' wire entries (codec.to_wire: the same bytes a client
sent, so persisting costs no re-encoding); the frames are their payloads. Older journal records
name no changed and deleted fields: replay takes them from the deltas.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.contexts.context import REPLAY_LIMITS, Context
from mcpd.contexts.record import Record
from mcpd.protocol import delta as codec
from mcpd.protocol.delta import FieldDelta


@dataclass(frozen=True)
class Commit:
    owner: str
    context_id: str
    version: int
    changes: list[FieldDelta]
    changed: set[str] | None   # None: as the deltas say (an older journal record)
    deleted: set[str] | None

    def apply_to(self, context: Context) -> None:
        """Commit this version onto the context at the version before, as the store did."""
        fields = dict(context.fields)
        changed, deleted = apply_changes(fields, self.changes, _replayed)
        context.commit(fields, changed if self.changed is None else self.changed,
                       deleted if self.deleted is None else self.deleted)


def apply_changes(fields: dict, changes: list[FieldDelta], apply) -> tuple[set[str], set[str]]:
    """Apply the deltas in order to `fields` (a copy the caller owns), each new value being
    apply(old value, delta); returns the names changed and deleted. The store's update and every
    replay run this one loop, so a restored version is built the way the live one was."""
    changed, deleted = set(), set()
    for change in changes:
        if change.kind == "delete":
            fields.pop(change.name, None)
            deleted.add(change.name)
        else:
            fields[change.name] = apply(fields.get(change.name), change)
            changed.add(change.name)
    return changed, deleted


def encode(context: Context, changes: list[FieldDelta]) -> Record:
    """The record of the context's current version, made by `changes`."""
    entries, frames = codec.to_wire(changes)
    return Record({"owner": context.owner, "id": context.id, "version": context.version,
                   "changed": sorted(context.changed_now), "deleted": sorted(context.deleted_now),
                   "changes": entries}, frames)


def decode(record: Record) -> Commit:
    meta = record.meta
    changed, deleted = meta.get("changed"), meta.get("deleted")
    return Commit(meta["owner"], meta["id"], int(meta["version"]),
                  codec.from_wire(meta["changes"], record.frames, REPLAY_LIMITS),
                  None if changed is None else set(changed), None if deleted is None else set(deleted))


def _replayed(old, change: FieldDelta):
    return codec.apply(old, change, REPLAY_LIMITS)
