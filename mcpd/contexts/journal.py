"""The context journal: every committed context version on disk, so contexts outlive the daemon.

Layout, in <state_dir>/contexts/:
    snapshot          every live context as of one moment, with its version bookkeeping
    journal-<gen>.log every open, commit and drop since that snapshot (gen names the snapshot)

Both files are sequences of records that can be found again after damage (journal_file.py). A
commit record holds the deltas that took the context from its previous version to this one, a
snapshot record a whole context, in the encodings the host cache uses too (commit.py,
snapshot.py). Replaying commits (replay.py) rebuilds each context's per-field versions, so
`context.get since=` keeps answering with deltas after a restart.

Why an append-only journal of deltas rather than rewriting state: an update is usually small
next to its context (an appended turn, a 1%-changed array as a packed XOR), so writing the delta
is what keeps persistence cheap; snapshots bound how much history a restore has to replay.

Durability: each record goes to the kernel with one write before the commit is acknowledged
(the store calls `committed` before the scheduler replies), so a crash of any process, or a
`systemctl restart`, loses nothing acknowledged. Surviving a power cut is the fsync policy's job
(see [persistence] in etc/mcpd.toml).

Damage at start (a torn last record after a power cut, a flipped bit, an operator's mistake):
every record whose checksums hold is recovered, a damaged one costs at most its context's later
versions, one ERROR line says what was lost, the damaged files are kept in
<state_dir>/contexts.damaged-<time>/ and a clean snapshot replaces them (journal_recovery.py).
A journal it cannot use at all never makes the scheduler restart in a loop: it starts, and
every context change is refused (UNAVAILABLE, or STORAGE_FULL while the disk is full) until a
snapshot can be written, which each change retries. Format 1 journals are
read and migrated: the first start writes them out as a format 2 snapshot.

A full disk: a record that cannot be written is cut off again and the change refused with
STORAGE_FULL and retry_after_ms; the store undoes it everywhere else (store.py), so the context
stays at its previous version in memory, in the cache and here. A compaction that cannot be
written is retried once the journal has grown a quarter of compact_after_bytes more.

The store tells listeners of opens, commits and drops: a context opened and never changed
(version 0, empty) is one "open" record, so it comes back too. persistence.py starts the journal:
recover() reads what the files hold, and once the store holds what comes back, start() opens
the journal for appending.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path

from mcpd.config import Config
from mcpd.contexts import journal_file, journal_recovery, snapshot
from mcpd.contexts.context import Context
from mcpd.contexts.journal_recovery import SNAPSHOT, TEMPORARY, Recovery
from mcpd.contexts.record import Record
from mcpd.contexts.store import STORAGE_RETRY_MS, ContextStore, storage_full
from mcpd.daemon.child_stats import JournalStats
from mcpd.histogram import DISK_BOUNDS, Histogram
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)   # EFBIG: over RLIMIT_FSIZE or the file system's limit


class Journal:
    """A StoreListener that appends each open, commit and drop to the journal file."""

    def __init__(self, config: Config, log: logging.Logger):
        self.config = config.persistence
        self.state_dir = config.state_dir
        self.directory = config.state_dir / "contexts"
        self.log = log
        self.store: ContextStore | None = None
        self.fd: int | None = None
        self.generation = 0
        self.size = 0
        self.restored = 0             # contexts the store took from the files (persistence.py counts)
        self.recovery: Recovery | None = None
        self.damaged_bytes = 0        # unreadable bytes found at start (kept aside, never dropped)
        self.unusable: str | None = None   # why the journal cannot be used at all, if so
        self.needs_snapshot = False   # the files do not hold the store's state: the next change writes a snapshot
        self.retry_compact_above = 0  # a compaction failed: the journal size to try again at
        self.last_commit: tuple | None = None   # (owner, id, version, size before, size after) of the last record
        self.dirty = False
        # False in a cluster: the Redis listener fsyncs each commit (sync_commit) while Redis takes it.
        self.sync_commits = True
        self.sync_time = Histogram(DISK_BOUNDS)   # seconds per fdatasync: a slow disk stalls every commit
        # Guards the fd against the interval fsync thread; reentrant because the SIGTERM handler
        # (close) may run on the main thread while it is inside _append.
        self.lock = threading.RLock()
        self.stop = threading.Event()

    # -- start: recover, then open for appending ------------------------------------------------

    def recover(self) -> list[Context]:
        """Every context the files hold, as last committed (damage reported and kept aside)."""
        try:
            self.recovery = journal_recovery.recover(self.state_dir)
        except OSError as e:
            self.unusable = f"{self.directory}: {e.strerror or e}"
            self.log.error("context journal %s cannot be used (%s): contexts start empty, its files are left as "
                           "they are, and every context change is refused until the daemon is restarted with it "
                           "fixed", self.directory, e)
            return []
        self.generation, self.damaged_bytes = self.recovery.generation, self.recovery.damaged_bytes
        if self.recovery.damaged:
            self.log.error("%s", self.recovery.describe())
        return list(self.recovery.replay.contexts.values())

    def start(self, store: ContextStore, behind: bool) -> None:
        """Journal `store`'s changes from now on; it holds what recover() gave back and, if
        `behind`, versions the files lack (from the host cache): a snapshot then writes them."""
        self.store = store
        if self.unusable:
            return
        # Past a file size limit (RLIMIT_FSIZE, systemd's LimitFSIZE=) a write raises SIGXFSZ,
        # whose default kills the process: ignored, the write fails with EFBIG instead and the
        # change is refused with STORAGE_FULL, like on a full disk.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self._start_appending(rewrite=behind or self.recovery.damaged or self.recovery.read_format < 2)
        if self.config.fsync == "interval":
            threading.Thread(target=self._fsync_periodically, name="journal-fsync", daemon=True).start()
        self.log.info("restored %d context(s) from %s", self.restored, self.directory)

    def _start_appending(self, rewrite: bool) -> None:
        """Open the journal, or write a clean snapshot first (after damage, or to migrate)."""
        try:
            self._remove_stale_journals()
            if rewrite:
                self.compact()
            else:
                self._open(self._journal_path(self.generation))
        except OSError as e:
            self.needs_snapshot = True
            self.log.error("context journal %s cannot be written (%s): every context change is refused until "
                           "a snapshot can be written, which each change retries", self.directory, e)
            return
        if self.size > self._compact_threshold():
            self._try_compact()

    def _remove_stale_journals(self) -> None:
        current = self._journal_path(self.generation).name
        for path in self.directory.glob("journal-*.log"):
            if path.name != current:
                path.unlink()   # folded into the snapshot already

    def _journal_path(self, generation: int) -> Path:
        return self.directory / f"journal-{generation}.log"

    def _open(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                _write_all(fd, [journal_file.FILE_MAGIC])
                size = len(journal_file.FILE_MAGIC)
            _fsync_directory(self.directory)   # the file's name must survive a power cut too
        except OSError:
            os.close(fd)
            raise
        self.fd, self.size = fd, size

    # -- StoreListener --------------------------------------------------------------------------

    def opened(self, context: Context) -> None:
        self._append(journal_file.encode({"op": "open", "owner": context.owner, "id": context.id}))

    def adopted(self, context: Context) -> None:
        """A whole context from elsewhere (the cluster's copy): one snapshot record, which replay
        takes as it stands whatever came before it."""
        self._append(journal_file.encode_record("context", snapshot.encode(context), generation=self.generation))

    def committed(self, context: Context, record: Record) -> None:
        before = self.size
        self._append(journal_file.encode_record("commit", record), sync=self.sync_commits)
        self.last_commit = (context.owner, context.id, context.version, before, self.size)

    def reverted(self, context: Context) -> None:
        """Forget the commit after context.version (a later listener refused it): cut its record
        off, or, once other bytes follow it, write a snapshot without it."""
        last = (context.owner, context.id, context.version + 1)
        with self.lock:
            if self.last_commit is not None and self.last_commit[:3] == last and self.last_commit[4] == self.size:
                try:
                    self._truncate(self.last_commit[3])
                    return
                except OSError:
                    pass
        self.needs_snapshot = True
        self._try_compact()

    def dropped(self, context: Context) -> None:
        # The store still holds the context: a snapshot written first would hold it too.
        self._append(journal_file.encode({"op": "drop", "owner": context.owner, "id": context.id}), in_snapshot=False)

    def _append(self, data: bytes, in_snapshot: bool = True, sync: bool = True) -> None:
        """Write the record before the change is acknowledged, or refuse the change; `sync` False
        leaves the fsync to sync_commit."""
        if self.unusable:
            raise MCPDError(codes.UNAVAILABLE, f"the context journal cannot be used ({self.unusable}); nothing "
                                               "changed; see the daemon's log", retry_after_ms=STORAGE_RETRY_MS)
        if self.needs_snapshot:
            self._snapshot_or_refuse()
            if in_snapshot:
                return   # the snapshot holds the change
        with self.lock:
            try:
                _write_all(self.fd, [data])
                if self.config.fsync == "always" and sync:
                    self._sync()
            except OSError as e:
                self._cut_back()
                raise _refusal(e) from None
            self.size += len(data)
            self.dirty = True
        if self.size > self._compact_threshold():
            self._try_compact()

    def _cut_back(self) -> None:
        """Take a partly written record off again; a snapshot catches up if even that fails."""
        try:
            self._truncate(self.size)
        except OSError:
            self.needs_snapshot = True

    def _truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        if self.config.fsync == "always":
            self._sync()
        self.size = size

    def _compact_threshold(self) -> int:
        # Folding only pays once the history outweighs the live data it rebuilds.
        return max(self.config.compact_after_bytes, 2 * self.store.total_bytes, self.retry_compact_above)

    # -- snapshots ------------------------------------------------------------------------------

    def compact(self) -> None:
        """Write every live context to a new snapshot and start an empty journal after it.

        The order makes every crash point safe: the snapshot is complete and fsynced before its
        rename makes it current; until then the old snapshot and journal still describe the store.
        Raises OSError (the disk is full, ...) with the old files still current.
        """
        generation = self.generation + 1
        self._write_snapshot(generation)
        with self.lock:
            old_fd, old_path = self.fd, self._journal_path(self.generation)
            # The new snapshot is current: nothing may be appended to the old journal any more.
            self.generation, self.fd, self.needs_snapshot, self.dirty = generation, None, True, False
            if old_fd is not None:
                os.close(old_fd)
            self._open(self._journal_path(generation))
            self.needs_snapshot, self.retry_compact_above, self.last_commit = False, 0, None
        old_path.unlink(missing_ok=True)
        self.log.info("journal folded into snapshot %d (%d context(s))", generation, len(self.store.contexts))

    def _write_snapshot(self, generation: int) -> None:
        tmp = self.directory / TEMPORARY
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(journal_file.FILE_MAGIC)
                f.write(journal_file.encode({"op": "generation", "generation": generation}))
                for context in list(self.store.contexts.values()):
                    f.write(journal_file.encode_record("context", snapshot.encode(context), generation=generation))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / SNAPSHOT)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _try_compact(self) -> None:
        try:
            self.compact()
        except OSError as e:
            self.retry_compact_above = self.size + self.config.compact_after_bytes // 4
            self.log.warning("journal compaction failed (%s); the journal goes on and it is tried again later", e)

    def _snapshot_or_refuse(self) -> None:
        try:
            self.compact()
        except OSError as e:
            raise _refusal(e) from None

    # -- durability -----------------------------------------------------------------------------

    def _fsync_periodically(self) -> None:
        while not self.stop.wait(self.config.fsync_interval_s):
            try:
                self.flush()
            except OSError as e:
                self.log.error("journal fsync failed (%s): the last interval's changes may not survive a power cut", e)

    def flush(self) -> None:
        """Make everything written so far durable."""
        with self.lock:
            if self.dirty and self.fd is not None:
                self._sync()
                self.dirty = False

    def sync_commit(self) -> None:
        """With sync_commits off, make the last commit as durable as the fsync policy asks, or
        refuse it: the store then reverts it here as when a later listener refuses."""
        if self.config.fsync != "always":
            return
        try:
            self.flush()
        except OSError as e:
            raise _refusal(e) from None

    def _sync(self) -> None:
        """fdatasync the journal, timed (the caller holds the lock)."""
        started = time.monotonic()
        os.fdatasync(self.fd)
        self.sync_time.observe(time.monotonic() - started)

    def close(self) -> None:
        self.stop.set()
        try:
            self.flush()
        except OSError as e:
            self.log.error("journal fsync at stop failed (%s)", e)
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def stats(self) -> JournalStats:
        state = "unusable" if self.unusable else ("refusing changes until a snapshot is written"
                                                  if self.needs_snapshot else "ok")
        return JournalStats(self.config.enabled, self.config.fsync, self.restored, self.size, self.generation,
                            self.damaged_bytes, state, self.sync_time.snapshot())


def _refusal(error: OSError) -> MCPDError:
    if error.errno in NO_ROOM:
        return storage_full(f"no room on disk to journal the change ({os.strerror(error.errno)}); nothing "
                            "changed: retry later")
    return MCPDError(codes.UNAVAILABLE, f"the context journal cannot be written ({error}); nothing changed",
                     retry_after_ms=STORAGE_RETRY_MS)


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
