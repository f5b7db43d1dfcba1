"""Where contexts outlive the scheduler and the daemon: the one place that builds the store's
listeners, in their required order, and restores the store from them, once, at start.

Two keep a copy of every committed version: the host cache (shared memory: it outlives a
scheduler restart, not the daemon) and the journal (disk: it outlives both). Their order:
- the cache hears an open or a commit first: when it refuses (the cache is full, or the tenant's
  share is used up), no other listener has recorded it;
- the journal after it: drops go to the listeners last to first, so the journal, which can
  refuse a drop (a full disk), hears it before the cache deletes anything;
- in a cluster, Redis last (mcpd/cluster/redis_contexts.py): a version reaches it once this
  node holds it, and a context this node lacks is restored from it at first use. It fsyncs the
  journal's commit records itself, while Redis takes the same commit.
Restore takes each context's newest version from either. The cache is ahead of the journal only
when a crash came between their writes (a version no reply named yet); the journal then writes a
snapshot at start, so what the store holds is on disk again before any change is acknowledged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcpd.config import Config
from mcpd.contexts.context import Context
from mcpd.contexts.host_cache import ContextCache
from mcpd.contexts.journal import Journal
from mcpd.contexts.store import ContextStore
from mcpd.memory.shm_arena import ShmArena

if TYPE_CHECKING:
    from mcpd.cluster.redis_contexts import RedisContexts


@dataclass
class Persistence:
    store: ContextStore
    cache: ContextCache | None   # None without a host cache
    journal: Journal             # closed (writes nothing, says so) with persistence off
    shared: RedisContexts | None = None   # the cluster's copy in Redis, when [cluster] is on


def open_store(config: Config, arena: ShmArena | None, log: logging.Logger) -> Persistence:
    """The scheduler's context store, restored from the host cache (when `arena`) and the journal
    (when persistence is on), with them listening from now on."""
    store = ContextStore(config.contexts)
    cache = ContextCache(arena, config.cache.max_owner_fraction) if arena is not None else None
    journal = Journal(config, log)
    if cache is not None and arena.num_slots < config.contexts.max_contexts:
        log.warning("the host cache holds at most %d entries (one per 2 KiB of cache.bytes): fewer than "
                    "contexts.max_contexts = %d; raise cache.bytes or lower contexts.max_contexts",
                    arena.num_slots, config.contexts.max_contexts)
    cached = cache.load() if cache is not None else []
    on_disk = journal.recover() if config.persistence.enabled else []
    newest, journal.restored, behind = _newest(cached, on_disk)
    for context in newest:
        store.restore(context)
    if cache is not None:
        store.listeners.append(cache)
    if config.persistence.enabled:
        journal.start(store, behind)
        store.listeners.append(journal)
    shared = _shared(config, store, journal, log) if config.cluster.enabled else None
    return Persistence(store, cache, journal, shared)


def _shared(config: Config, store: ContextStore, journal: Journal, log: logging.Logger) -> RedisContexts:
    """Redis as the store's last listener and its shared copy."""
    from mcpd.cluster.redis_contexts import RedisContexts   # the Redis client loads only where a cluster is on
    from mcpd.cluster.redis_url import redacted

    journal.sync_commits = False
    shared = RedisContexts(config.cluster, log, sync_locally=journal.sync_commit)
    shared.check_eviction_policy()
    store.listeners.append(shared)
    store.shared = shared
    log.info("cluster node %r: contexts kept in Redis at %s", config.cluster.node_name, redacted(config.cluster.redis))
    return shared


def _newest(cached: list[Context], on_disk: list[Context]) -> tuple[list[Context], int, bool]:
    """Each context at the newest version either copy holds (the cache's on a tie), how many of
    those the disk gave, and whether the cache holds a version the disk lacks."""
    newest = {(context.owner, context.id): context for context in cached}
    disk_versions, from_disk = {}, 0
    for context in on_disk:
        key = (context.owner, context.id)
        disk_versions[key] = context.version
        if key not in newest or context.version > newest[key].version:
            newest[key] = context
            from_disk += 1
    behind = any(context.version > disk_versions.get((context.owner, context.id), -1) for context in cached)
    return list(newest.values()), from_disk, behind
