"""Contexts in Redis: a store listener that puts every open, commit and drop there before the
change is acknowledged, and the loader a node restores a context from when it lacks one.

It is the store's last listener (persistence.py): an open or a commit reaches Redis only once
the host cache and the journal hold it, so nothing after it can refuse; a drop reaches it first.
A commit's journal record is written, not yet fsynced, when Redis hears it: the journal's fsync
runs while Redis takes the commit (so a commit waits for the slower fsync, not both), and a
failing fsync takes the commit back from Redis (redis_scripts.UNCOMMIT) before it is refused.
The records are the journal's, byte for byte
(journal_file.encode_record of commit.py's and snapshot.py's records), under the keys
context_keys.py lays out. A context's log is folded into its snapshot once it outweighs both
cluster.compact_after_bytes and the context itself, so Redis holds at most about twice each
context plus that much (docs/CLUSTER.md: the memory bound).

Redis unreachable, or over its maxmemory: the change is refused (UNAVAILABLE, or STORAGE_FULL,
with retry_after_ms) and the store undoes it in the cache and the journal, so no reply names a
version Redis lacks. With cluster.when_redis_down = "journal" an unreachable Redis is noted
instead: the node goes on with its journal alone, and the scheduler's tick writes each context
Redis missed, whole, in the order they fell behind, once Redis answers (catch_up).

Redis ahead of this node's copy means another node committed: the change is refused with
CONFLICT and the store forgets its copy, so the next request restores the context from Redis.
Redis behind it (it lost writes, or this node restarted while still catching up) gets the whole
context again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager

import redis

from mcpd.cluster import redis_scripts
from mcpd.cluster.context_keys import keys_of
from mcpd.cluster.redis_client import REDIS_ERRORS, connect
from mcpd.cluster.script_call import ScriptCall
from mcpd.config import ClusterConfig
from mcpd.contexts import journal_file, snapshot
from mcpd.contexts.context import Context
from mcpd.contexts.record import Record
from mcpd.contexts.replay import Replay
from mcpd.contexts.store import StaleCopy, storage_full
from mcpd.daemon.child_stats import RedisContextStats
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

# Redis restarts or fails over within a second or two: a client told to wait that long retries
# into a live one rather than spinning on a dead one.
REDIS_RETRY_MS = 1000


class RedisContexts:
    def __init__(self, config: ClusterConfig, log: logging.Logger, sync_locally: Callable[[], None] = lambda: None):
        self.redis = connect(config)
        self.commit_script = self.redis.register_script(redis_scripts.COMMIT)
        self.uncommit_script = self.redis.register_script(redis_scripts.UNCOMMIT)
        # The journal's fsync, run between sending a commit to Redis and reading its answer.
        self.sync_locally = sync_locally
        self.snapshot_script = self.redis.register_script(redis_scripts.SNAPSHOT)
        self.compact_after_bytes = config.compact_after_bytes
        self.journal_alone = config.when_redis_down == "journal"
        # Contexts whose newest version Redis lacks (on the journal alone), in the order they fell behind.
        self.behind: dict[tuple[str, str], Context] = {}
        self.next_catch_up = 0.0
        self.log = log
        self.loaded = 0      # contexts restored from Redis
        self.folded = 0      # logs folded into snapshots
        self.refused = 0     # changes refused because Redis could not take them

    def check_eviction_policy(self) -> None:
        """Say so in the log when Redis may evict keys: an evicted context is an acknowledged one lost."""
        try:
            policy = self.redis.config_get("maxmemory-policy").get("maxmemory-policy")
        except REDIS_ERRORS as e:   # down for now, or CONFIG renamed away (managed Redis)
            self.log.warning("could not read Redis's maxmemory-policy (%s): it must be noeviction", e)
            return
        if policy != "noeviction":
            self.log.error("Redis runs with maxmemory-policy %s: at its maxmemory it may evict acknowledged "
                           "contexts; set it to noeviction (docs/CLUSTER.md)", policy)

    # -- StoreListener --------------------------------------------------------------------------

    def opened(self, context: Context) -> None:
        self.adopted(context)

    def adopted(self, context: Context) -> None:
        """Hold the context whole, unless Redis holds it at this version or newer already."""
        if self._noted_behind(context):
            return
        with self._refusing("keep the context", context):
            self._write_snapshot(context, "adopt")

    def committed(self, context: Context, record: Record) -> None:
        """Send the commit to Redis, make the journal durable while Redis takes it (their fsyncs
        overlap), then wait for Redis's answer."""
        if self._noted_behind(context):
            self.sync_locally()
            return
        keys = keys_of(context.owner, context.id)
        data = journal_file.encode_record("commit", record)
        sending = ScriptCall(self.redis, self.commit_script, [keys.meta, keys.log], [context.version, data])
        try:
            self.sync_locally()
        except MCPDError:
            self._take_back(sending, context, data)
            raise
        with self._refusing("commit the change", context):
            appended, figure = sending.result()
            if appended:
                if figure > max(self.compact_after_bytes, context.nbytes):   # the log's bytes
                    self._fold(context)
            elif figure < context.version - 1:
                self._repair(context, figure)
            else:
                raise StaleCopy(f"context {context.id!r} is at version {figure} in the cluster, not "
                                f"{context.version - 1}: another node changed it; fetch it again and retry")

    def _take_back(self, sending: ScriptCall, context: Context, data: bytes) -> None:
        """The journal refused the commit Redis is taking: once Redis answers, take it back there
        too. When Redis cannot, it keeps a version the client was refused, as when the reply to a
        commit is lost: sent again, the change counts once; a different one is refused CONFLICT."""
        keys = keys_of(context.owner, context.id)
        try:
            if sending.result()[0]:
                self.uncommit_script(keys=[keys.meta, keys.log], args=[context.version, data])
        except REDIS_ERRORS as e:
            self.log.error("context %s/%s: the journal refused version %d but Redis may hold it (%s)",
                           context.owner, context.id, context.version, e)

    def dropped(self, context: Context) -> None:
        keys = keys_of(context.owner, context.id)
        with self._refusing("drop the context"):   # never on the journal alone: a drop Redis missed would come back
            self.redis.delete(*keys)
        self.behind.pop((context.owner, context.id), None)

    # -- on the journal alone -------------------------------------------------------------------

    def _noted_behind(self, context: Context) -> bool:
        """Whether Redis lacks an earlier version of this context: then this one waits its turn too."""
        key = (context.owner, context.id)
        if key in self.behind:
            self.behind[key] = context
            return True
        return False

    def catch_up(self, now: float) -> None:
        """Write each context Redis missed while it was down, as it is now, in the order they fell
        behind; stop at the first failure and try again REDIS_RETRY_MS later."""
        if not self.behind or now < self.next_catch_up:
            return
        while self.behind:
            key, context = next(iter(self.behind.items()))
            try:
                self._write_snapshot(context, "adopt")
            except REDIS_ERRORS:
                self.next_catch_up = now + REDIS_RETRY_MS / 1000
                return
            del self.behind[key]
        self.log.info("Redis holds every context again")

    def _repair(self, context: Context, held: int) -> None:
        """Redis is behind this node's copy (it lost writes, or missed them while this node ran on
        its journal alone and restarted since): write the whole context."""
        self.log.warning("context %s/%s is at version %d in Redis, behind this node's %d: written again whole",
                         context.owner, context.id, held, context.version)
        self._write_snapshot(context, "adopt")

    # -- restore --------------------------------------------------------------------------------

    def load(self, owner: str, context_id: str) -> Context | None:
        """The context as Redis last holds it, or None when Redis holds none of that name."""
        context = self.read(owner, context_id)
        self.loaded += context is not None
        return context

    def read(self, owner: str, context_id: str) -> Context | None:
        """As load, uncounted: safe from a thread of its own (prefetch.py)."""
        keys = keys_of(owner, context_id)
        with self._refusing("read the context"):
            with self.redis.pipeline(transaction=True) as reading:   # the snapshot and its log as of one moment
                snap, log = reading.get(keys.snap).lrange(keys.log, 0, -1).execute()
        if snap is None:
            return None
        replay = Replay()
        for data in [snap, *log]:
            record = journal_file.decode(data)
            if record is None or (record.get("owner"), record.get("id")) != (owner, context_id):
                replay.unusable += 1   # damaged in Redis, or not this context's: its later versions cannot apply
                break
            replay.apply(record)
        context = replay.contexts.get((owner, context_id))
        if replay.unusable or replay.lost:
            self.log.error("context %s/%s in Redis has %d unusable record(s): restored at version %s",
                           owner, context_id, replay.unusable, context.version if context else "none")
        return context

    # -- inside ---------------------------------------------------------------------------------

    def _fold(self, context: Context) -> None:
        """Replace the context's snapshot and log by a snapshot of this version. A failure costs
        nothing but Redis memory: the log still holds every version, and the next commit retries."""
        try:
            self.folded += self._write_snapshot(context, "fold")
        except REDIS_ERRORS as e:
            self.log.warning("folding context %s/%s in Redis failed (%s); retried at its next commit",
                             context.owner, context.id, e)

    def _write_snapshot(self, context: Context, mode: str) -> int:
        keys = keys_of(context.owner, context.id)
        data = journal_file.encode_record("context", snapshot.encode(context))
        return self.snapshot_script(keys=[keys.meta, keys.snap, keys.log], args=[context.version, data, mode])

    @contextmanager
    def _refusing(self, what: str, context: Context | None = None):
        """Turn a Redis failure into the refusal the client is told to retry, or, on the journal
        alone, note that Redis lacks this version of `context`."""
        try:
            yield
        except redis.OutOfMemoryError:
            self.refused += 1
            raise storage_full(f"the cluster's Redis is at its maxmemory and cannot {what}; nothing changed: "
                               "retry later") from None
        except REDIS_ERRORS as e:
            if self.journal_alone and context is not None:
                if not self.behind:
                    self.log.error("the cluster's Redis cannot %s (%s): going on with the journal alone, caught "
                                   "up when Redis answers again", what, e)
                self.behind[(context.owner, context.id)] = context
                return
            self.refused += 1
            raise MCPDError(codes.UNAVAILABLE, f"the cluster's Redis cannot {what} ({e}); nothing changed: retry",
                            retry_after_ms=REDIS_RETRY_MS) from None

    def stats(self) -> RedisContextStats:
        return RedisContextStats(self.loaded, self.folded, self.refused, len(self.behind))
