"""Committed contexts in the host shared-memory cache: a store listener that writes every
committed version there, and the loader a (re)started scheduler restores them from.

Each context is a snapshot (the whole context at some version, snapshot.py) plus a chain of
delta entries, one per later version, each holding the deltas that commit made (commit.py), both
records laid out as cache_entry.py says:
a commit writes what it changed, not the whole context (a 1%-changed sync of a 64 MB field
writes ~1 MB, not 64). When the chain grows heavy or long (cache_chain.py) the commit writes a
fresh snapshot instead and then deletes the chain it supersedes.

Keys: the snapshot's is a digest of (owner, id); a delta's a digest of that key and the version
it produces, so committing a version again (after a refusal) replaces its entry. Each entry is
published whole by ShmArena.put, so a crash at any moment leaves the last committed version
restorable. A crash between a new snapshot and the deletion of the old chain leaves deltas at or
below the snapshot's version, and one in the middle of a drop leaves deltas with no snapshot;
load() deletes both. It replays each snapshot's deltas in version order (replay.replay_chain),
which rebuilds the per-field version bookkeeping `changes_since` needs exactly, and stops at a
gap (deleting what follows: nothing can reach it).

Why contexts are never evicted, and a commit that does not fit is refused: a context is state a
client was told is committed (its version), not a cache of something recomputable. Evicting it
would lose it at the next scheduler restart without telling anyone. So context entries, deltas
included, are pinned, KV blocks make room for them, and a commit that cannot be held is refused
before anything changes (put raises ArenaFull before it publishes), which the store turns into
a refusal of the commit before any reply says it happened.

Room for every tenant: otherwise one tenant's many small contexts could fill the cache and
every other tenant's open, update and chat turn would be refused. Each tenant is charged what
its entries really occupy (ShmArena.footprint: block or pages, and slot), and may occupy at most
cache.max_owner_fraction of the cache's bytes and of its entry slots; past that its commit is
TOO_LARGE (its own limit: drop contexts), and a delta that would pass it is written as a snapshot
instead when that fits. The rest stays for the others. When the cache is full anyway (tenants'
shares together exceed it), a commit is STORAGE_FULL with retry_after_ms: not the client's fault,
and it may pass once others drop contexts.
"""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass

import msgpack

from mcpd.contexts import cache_entry, commit, snapshot
from mcpd.contexts.cache_chain import CacheChain, weight
from mcpd.contexts.commit import Commit
from mcpd.contexts.context import Context
from mcpd.contexts.record import Record
from mcpd.contexts.replay import replay_chain
from mcpd.contexts.store import storage_full
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA
from mcpd.memory.shm_arena import ArenaFull, ShmArena
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

log = logging.getLogger("mcpd.context_cache")


@dataclass
class Usage:
    """What one tenant's context entries occupy of the arena."""
    bytes: int = 0
    entries: int = 0


class ContextCache:
    """A StoreListener: keeps each context's committed versions in the arena."""

    def __init__(self, arena: ShmArena, max_owner_fraction: float = 1.0):
        self.arena = arena
        self.chains: dict[bytes, CacheChain] = {}   # by context key: what the arena holds of each
        self.usage: dict[str, Usage] = {}   # by owner
        self.share = Usage(int(max_owner_fraction * arena.capacity_bytes), int(max_owner_fraction * arena.num_slots))

    def opened(self, context: Context) -> None:
        key = _key(context.owner, context.id)
        self._snapshot(key, context, self.chains.get(key))   # version 0: its first snapshot

    def adopted(self, context: Context) -> None:
        """A whole context from elsewhere (the cluster's copy): its snapshot, as an open writes one."""
        self.opened(context)

    def committed(self, context: Context, record: Record) -> None:
        key = _key(context.owner, context.id)
        parts = cache_entry.pack(record)
        chain, stored = self.chains.get(key), _size(parts)
        footprint, weighs = self.arena.footprint(stored), weight(record, stored)
        if chain is not None and self._worth_a_delta(chain, footprint) and not chain.wants_snapshot(weighs, context.nbytes):
            if self._within_share(context.owner, Usage(footprint, 1)):
                self._put(CONTEXT_DELTA, _delta_key(key, context.version), parts)
                chain.deltas[context.version] = (weighs, footprint)
                self._charge(context.owner, footprint, 1)
                return
        self._snapshot(key, context, chain)   # a snapshot frees the chain: it may fit where a delta did not

    def reverted(self, context: Context) -> None:
        """Go back to the context's version: a later listener refused the one after it. Never
        raises: if the older version cannot be written back, the context leaves the cache (a
        restarted scheduler then takes it from the journal) rather than keep a refused version."""
        key = _key(context.owner, context.id)
        chain = self.chains.get(key)
        refused = context.version + 1
        if chain is None:
            return
        if refused in chain.deltas:
            self._delete_deltas(context.owner, key, chain, [refused])
            return
        try:
            self._snapshot(key, context, chain)
        except MCPDError as e:
            log.warning("context %s/%s leaves the host cache: its version %d cannot be written back (%s)",
                        context.owner, context.id, context.version, e.message)
            self.dropped(context)

    def dropped(self, context: Context) -> None:
        key = _key(context.owner, context.id)
        # The snapshot first: a crash before its deltas are gone leaves orphans, which load() deletes.
        self.arena.delete(CONTEXT, key)
        chain = self.chains.pop(key, None)
        if chain is not None:
            self._charge(context.owner, -chain.snapshot_footprint, -1)
            self._delete_deltas(context.owner, key, chain, list(chain.deltas))

    def load(self) -> list[Context]:
        """Every context in the cache, as last committed; rebuilds the chains and the usage."""
        contexts, footprints = {}, {}
        for key, context, footprint in self._entries(CONTEXT, _snapshot_of):
            contexts[key], footprints[key] = context, footprint
        deltas = defaultdict(list)
        for _, (made, weighs), footprint in self._entries(CONTEXT_DELTA, _weighed_commit):
            deltas[_key(made.owner, made.context_id)].append((made, weighs, footprint))
        for key, context in contexts.items():
            self.chains[key] = CacheChain(context.version, footprints[key])
            self._charge(context.owner, footprints[key], 1)
            self._replay(key, context, deltas.pop(key, []))
        for key, orphans in deltas.items():   # their snapshot is gone (a drop cut short by a crash)
            for made, *_ in orphans:
                self.arena.delete(CONTEXT_DELTA, _delta_key(key, made.version))
        return list(contexts.values())

    def stats(self) -> dict:
        largest = max(self.usage.values(), key=lambda u: u.bytes, default=Usage())
        return {"cache_bytes": sum(u.bytes for u in self.usage.values()),
                "cache_entries": sum(u.entries for u in self.usage.values()),
                "cache_tenant_share_bytes": self.share.bytes, "cache_largest_tenant_bytes": largest.bytes}

    def _snapshot(self, key: bytes, context: Context, old: CacheChain | None) -> None:
        parts = cache_entry.pack(snapshot.encode(context))
        footprint = self.arena.footprint(_size(parts))
        freed = Usage(old.footprint, old.entries) if old is not None else Usage()
        if not self._within_share(context.owner, Usage(footprint, 1), freed):
            usage = self.usage.get(context.owner, Usage())
            raise MCPDError(codes.TOO_LARGE, f"the tenant's contexts would occupy {usage.bytes - freed.bytes + footprint} "
                                             f"bytes and {usage.entries - freed.entries + 1} entries of the host cache; "
                                             f"its share is {self.share.bytes} bytes and {self.share.entries} entries "
                                             "(cache.max_owner_fraction)")
        self._put(CONTEXT, key, parts)
        self.chains[key] = CacheChain(context.version, footprint)
        self._charge(context.owner, footprint - (old.snapshot_footprint if old is not None else 0), 0 if old else 1)
        if old is not None:
            self._delete_deltas(context.owner, key, old, list(old.deltas))

    def _replay(self, key: bytes, context: Context, deltas: list[tuple[Commit, int, int]]) -> None:
        """Bring the snapshot's context up to its last delta; delete deltas it cannot use."""
        chain, held = self.chains[key], {made.version: (weighs, footprint) for made, weighs, footprint in deltas}
        for made in replay_chain(context, [made for made, *_ in deltas]):
            chain.deltas[made.version] = held.pop(made.version)
            self._charge(context.owner, chain.deltas[made.version][1], 1)
        for version in held:
            self.arena.delete(CONTEXT_DELTA, _delta_key(key, version))

    def _worth_a_delta(self, chain: CacheChain, footprint: int) -> bool:
        """Deltas pay for contexts whose snapshot takes whole pages. A smaller one is rewritten
        whole at each commit (at most half a page): it stays one entry, in the block a delta
        would have taken anyway."""
        return chain.snapshot_footprint > max(footprint, self.arena.footprint(self.arena.page_bytes // 2))

    def _within_share(self, owner: str, added: Usage, freed: Usage = Usage()) -> bool:
        usage = self.usage.get(owner, Usage())
        return (usage.bytes - freed.bytes + added.bytes <= self.share.bytes
                and usage.entries - freed.entries + added.entries <= self.share.entries)

    def _charge(self, owner: str, nbytes: int, entries: int) -> None:
        usage = self.usage.setdefault(owner, Usage())
        usage.bytes += nbytes
        usage.entries += entries
        if not usage.entries:
            del self.usage[owner]

    def _put(self, kind: int, key: bytes, parts: list) -> None:
        try:
            self.arena.put(kind, key, parts, pinned=True, replace=True)
        except ArenaFull as e:
            raise storage_full(f"the host context cache is full ({e}); other tenants' contexts hold it: "
                               "retry later, or raise cache.bytes") from None

    def _delete_deltas(self, owner: str, key: bytes, chain: CacheChain, versions: list[int]) -> None:
        for version in versions:
            self.arena.delete(CONTEXT_DELTA, _delta_key(key, version))
            _, footprint = chain.deltas.pop(version)
            self._charge(owner, -footprint, -1)

    def _entries(self, kind: int, decode):
        """(key, decode(record, its stored bytes), footprint) of every entry of the kind; one that
        does not decode (a bug, or memory damage) is deleted and logged: the journal still has its
        context."""
        for key in self.arena.keys(kind):
            blob = self.arena.get(kind, key)
            if blob is None:
                continue
            try:
                yield key, decode(cache_entry.unpack(blob), len(blob)), self.arena.footprint(len(blob))
            except Exception as e:   # noqa: BLE001 - any undecodable entry: skip it, never crash-loop
                log.error("host cache entry %s of kind %d does not decode (%s: %s); deleted", key.hex()[:16], kind,
                          type(e).__name__, e)
                self.arena.delete(kind, key)


def _snapshot_of(record: Record, _stored: int) -> Context:
    return snapshot.decode(record)


def _weighed_commit(record: Record, stored: int) -> tuple[Commit, int]:
    return commit.decode(record), weight(record, stored)


def _size(parts: list) -> int:
    return sum(memoryview(part).nbytes for part in parts)


def _key(owner: str, context_id: str) -> bytes:
    return hashlib.blake2b(msgpack.packb([owner, context_id]), digest_size=32, person=b"mcpd-context").digest()


def _delta_key(context_key: bytes, version: int) -> bytes:
    return hashlib.blake2b(context_key + version.to_bytes(8, "little"), digest_size=32,
                           person=b"mcpd-ctx-delta").digest()
