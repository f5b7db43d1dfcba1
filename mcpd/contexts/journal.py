"""The context journal: every committed context version on disk, so contexts outlive the daemon.

Layout, in <state_dir>/contexts/:
    snapshot          every live context as of one moment, with its version bookkeeping
    journal-<gen>.log every commit and drop since that snapshot (gen names the snapshot)

Both files are sequences of records: [body length u32][crc32 of body u32][msgpack body]. A
commit record holds the deltas that took the context from its previous version to this one (as
`delta.to_wire` gives them: the same bytes a client sent, so journaling costs no re-encoding).
Replaying them through `Context.commit` rebuilds each context's per-field versions, so
`context.get since=` keeps answering with deltas after a restart.

Why an append-only journal of deltas rather than rewriting state: an update is usually small
next to its context (an appended turn, a 1%-changed array as a packed XOR), so writing the delta
is what keeps persistence cheap; snapshots bound how much history a restore has to replay.

Durability: each record goes to the kernel with one write before the commit is acknowledged
(the store calls `committed` before the scheduler replies), so a crash of any process, or a
`systemctl restart`, loses nothing acknowledged. Surviving a power cut is the fsync policy's job
(see [persistence] in etc/mcpd.toml). A power cut can leave a torn last record: its checksum
fails, restore drops it and everything after it (it was never acknowledged under fsync=always),
logs that, and starts; a corrupt journal never stops the daemon.

The store tells listeners of opens, commits and drops: a context opened and never changed
(version 0, empty) is one "open" record, so it comes back too.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from pathlib import Path

import msgpack

from mcpd.config import Config
from mcpd.contexts.context import Context
from mcpd.contexts.store import ContextStore
from mcpd.protocol import delta as codec
from mcpd.protocol.delta import DeltaLimits, FieldDelta

RECORD_HEADER = struct.Struct("<II")   # body length, crc32(body)
SNAPSHOT = "snapshot"


class Journal:
    """A StoreListener that appends each commit and drop to the journal file."""

    def __init__(self, config: Config, log: logging.Logger):
        self.config = config.persistence
        self.directory = config.state_dir / "contexts"
        self.limits = DeltaLimits(max_field_bytes=config.contexts.max_field_bytes)
        self.log = log
        self.store: ContextStore | None = None
        self.fd: int | None = None
        self.generation = 0
        self.size = 0
        self.restored = 0
        self.dropped_bytes = 0        # torn or corrupt bytes found (and cut off) at restore
        self.needs_snapshot = False   # a failed write left the journal behind the store
        self.dirty = False
        # Guards the fd against the interval fsync thread; reentrant because the SIGTERM handler
        # (close) may run on the main thread while it is inside _append.
        self.lock = threading.RLock()
        self.stop = threading.Event()

    # -- start: restore, then open for appending ------------------------------------------------

    def restore(self, store: ContextStore) -> int:
        """Load the snapshot and replay the journal into `store`; returns how many contexts came back."""
        self.store = store
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        contexts: dict[tuple[str, str], Context] = {}
        self.generation = self._load_snapshot(contexts)
        journal = self._journal_path(self.generation)
        self.size = self._replay(journal, contexts) if journal.exists() else 0
        for context in contexts.values():
            self.restored += store.restore(context)
        self._remove_stale_journals()
        self._open(journal)
        if self.size > self._compact_threshold():
            self.compact()
        if self.config.fsync == "interval":
            threading.Thread(target=self._fsync_periodically, name="journal-fsync", daemon=True).start()
        self.log.info("restored %d context(s) from %s", self.restored, self.directory)
        return self.restored

    def _load_snapshot(self, contexts: dict) -> int:
        path = self.directory / SNAPSHOT
        if not path.exists():
            return 0
        records, good_bytes = _read_records(path)
        self._note_damage(path, good_bytes)
        generation = 0
        for record in records:
            if record["op"] == "generation":
                generation = record["generation"]
            else:
                context = self._context_from_snapshot(record)
                contexts[(context.owner, context.id)] = context
        return generation

    def _replay(self, path: Path, contexts: dict) -> int:
        records, good_bytes = _read_records(path)
        if self._note_damage(path, good_bytes):
            with open(path, "r+b") as f:   # appends must follow the last good record
                f.truncate(good_bytes)
        for record in records:
            key = (record["owner"], record["id"])
            if record["op"] == "drop":
                contexts.pop(key, None)
                continue
            if record["op"] == "open":
                contexts.setdefault(key, Context(record["id"], record["owner"]))
                continue
            context = contexts.get(key) or Context(record["id"], record["owner"])
            if record["version"] != context.version + 1:
                self.log.error("journal %s: context %s/%s jumps from version %d to %d; skipping the record",
                               path, *key, context.version, record["version"])
                continue
            self._replay_commit(context, record)
            contexts[key] = context
        return good_bytes

    def _replay_commit(self, context: Context, record: dict) -> None:
        fields, changed, deleted = dict(context.fields), set(), set()
        for change in codec.from_wire(record["changes"], record["frames"], self.limits):
            if change.kind == "delete":
                fields.pop(change.name, None)
                deleted.add(change.name)
            else:
                fields[change.name] = codec.apply(fields.get(change.name), change, self.limits)
                changed.add(change.name)
        context.commit(fields, changed, deleted)

    def _context_from_snapshot(self, record: dict) -> Context:
        context = Context(record["id"], record["owner"], version=record["version"],
                          changed_at=record["changed_at"], deleted_at=record["deleted_at"],
                          token_count_at=record["token_count_at"],
                          tokens_rewritten_at=record["tokens_rewritten_at"])
        changes = codec.from_wire(record["changes"], record["frames"], self.limits)
        context.fields = {c.name: codec.apply(None, c, self.limits) for c in changes}
        return context

    def _note_damage(self, path: Path, good_bytes: int) -> bool:
        damaged = path.stat().st_size - good_bytes
        if damaged:
            self.dropped_bytes += damaged
            self.log.error("%s: %d byte(s) after offset %d are torn or corrupt; keeping what precedes them",
                           path, damaged, good_bytes)
        return damaged > 0

    def _remove_stale_journals(self) -> None:
        current = self._journal_path(self.generation).name
        for path in self.directory.glob("journal-*.log"):
            if path.name != current:
                path.unlink()   # folded into the snapshot already

    def _journal_path(self, generation: int) -> Path:
        return self.directory / f"journal-{generation}.log"

    def _open(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _fsync_directory(self.directory)   # the file's name must survive a power cut too

    # -- StoreListener --------------------------------------------------------------------------

    def opened(self, context: Context) -> None:
        self._append({"op": "open", "owner": context.owner, "id": context.id})

    def committed(self, context: Context, changes) -> None:
        entries, frames = codec.to_wire(changes)
        self._append({"op": "commit", "owner": context.owner, "id": context.id, "version": context.version,
                      "changes": entries, "frames": frames})

    def dropped(self, context: Context) -> None:
        self._append({"op": "drop", "owner": context.owner, "id": context.id})

    def _append(self, record: dict) -> None:
        if self.needs_snapshot:
            return self.compact()   # the snapshot holds this commit too
        body = msgpack.packb(record)
        header = RECORD_HEADER.pack(len(body), zlib.crc32(body))
        with self.lock:
            try:
                _write_all(self.fd, [header, body])
                if self.config.fsync == "always":
                    os.fdatasync(self.fd)
            except OSError:
                # Cut a partial record off, and catch up with a snapshot at the next commit.
                os.ftruncate(self.fd, self.size)
                self.needs_snapshot = True
                raise
            self.size += len(header) + len(body)
            self.dirty = True
        if self.size > self._compact_threshold():
            self.compact()

    def _compact_threshold(self) -> int:
        # Folding only pays once the history outweighs the live data it rebuilds.
        return max(self.config.compact_after_bytes, 2 * self.store.total_bytes)

    # -- snapshots ------------------------------------------------------------------------------

    def compact(self) -> None:
        """Write every live context to a new snapshot and start an empty journal after it.

        The order makes every crash point safe: the snapshot is complete and fsynced before its
        rename makes it current; until then the old snapshot and journal still describe the store.
        """
        generation = self.generation + 1
        tmp = self.directory / (SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_record({"op": "generation", "generation": generation}))
            for context in list(self.store.contexts.values()):
                f.write(_record(self._snapshot_record(context)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / SNAPSHOT)
        with self.lock:
            old_fd, old_path = self.fd, self._journal_path(self.generation)
            self.generation, self.size, self.needs_snapshot, self.dirty = generation, 0, False, False
            self._open(self._journal_path(generation))
            os.close(old_fd)
        old_path.unlink(missing_ok=True)
        self.log.info("journal folded into snapshot %d (%d context(s))", generation, len(self.store.contexts))

    @staticmethod
    def _snapshot_record(context: Context) -> dict:
        entries, frames = codec.to_wire([_whole(name, value) for name, value in context.fields.items()])
        return {"op": "context", "owner": context.owner, "id": context.id, "version": context.version,
                "changed_at": context.changed_at, "deleted_at": context.deleted_at,
                "token_count_at": context.token_count_at, "tokens_rewritten_at": context.tokens_rewritten_at,
                "changes": entries, "frames": frames}

    # -- durability -----------------------------------------------------------------------------

    def _fsync_periodically(self) -> None:
        while not self.stop.wait(self.config.fsync_interval_s):
            self.flush()

    def flush(self) -> None:
        """Make everything written so far durable."""
        with self.lock:
            if self.dirty and self.fd is not None:
                os.fdatasync(self.fd)
                self.dirty = False

    def close(self) -> None:
        self.stop.set()
        self.flush()
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def stats(self) -> dict:
        return {"enabled": self.config.enabled, "fsync": self.config.fsync, "restored": self.restored, "journal_bytes": self.size,
                "generation": self.generation, "corrupt_bytes_dropped": self.dropped_bytes}


def open_journal(config: Config, store: ContextStore, log: logging.Logger) -> Journal:
    """The scheduler's one call: restore `store` from disk and journal its commits from now on.
    With persistence off the journal stays closed: it writes nothing and reports so."""
    journal = Journal(config, log)
    if config.persistence.enabled:
        journal.restore(store)
        store.listeners.append(journal)
    return journal


def _whole(name: str, value) -> FieldDelta:
    """A delta that sets the field from nothing (diff sees nothing to do for a None value)."""
    return codec.diff(name, None, value) or FieldDelta(name, "set", {"type": "scalar", "value": None}, None)


def _record(body_map: dict) -> bytes:
    body = msgpack.packb(body_map)
    return RECORD_HEADER.pack(len(body), zlib.crc32(body)) + body


def _read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a file up to the first torn or corrupt one, and the bytes they span."""
    data = path.read_bytes()
    records, offset = [], 0
    while offset + RECORD_HEADER.size <= len(data):
        length, crc = RECORD_HEADER.unpack_from(data, offset)
        start, end = offset + RECORD_HEADER.size, offset + RECORD_HEADER.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        try:
            records.append(msgpack.unpackb(data[start:end], raw=False, strict_map_key=False))
        except ValueError:
            break
        offset = end
    return records, offset


def _write_all(fd: int, buffers: list[bytes]) -> None:
    total = sum(len(b) for b in buffers)
    written = os.writev(fd, buffers)
    if written < total:   # rare (a signal, a nearly full disk): write what is left plainly
        rest = b"".join(buffers)[written:]
        while rest:
            rest = rest[os.write(fd, rest):]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
