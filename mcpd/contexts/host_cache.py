"""Committed contexts in the host shared-memory cache: a store listener that writes every
committed version there, and the loader a (re)started scheduler restores them from.

Each context is a snapshot (the whole context at some version, snapshot.py) plus a chain of
delta entries, one per later version, each holding the deltas that commit made (cached_delta.py):
a commit writes what it changed, not the whole context (a 1%-changed sync of a 64 MB field
writes ~1 MB, not 64). When the chain grows heavy or long (cache_chain.py) the commit writes a
fresh snapshot instead and then deletes the chain it supersedes.

Keys: the snapshot's is a digest of (owner, id); a delta's a digest of that key and the version
it produces, so committing a version again (after a refusal) replaces its entry. Each entry is
published whole by ShmArena.put, so a crash at any moment leaves the last committed version
restorable. A crash between a new snapshot and the deletion of the old chain leaves deltas at or
below the snapshot's version, and one in the middle of a drop leaves deltas with no snapshot;
load() deletes both. It replays each snapshot's deltas in version order through Context.commit,
which rebuilds the per-field version bookkeeping `changes_since` needs exactly, and stops at a
gap (deleting what follows: nothing can reach it).

Why contexts are never evicted, and a commit that does not fit is refused: a context is state a
client was told is committed (its version), not a cache of something recomputable. Evicting it
would lose it at the next scheduler restart without telling anyone. So context entries, deltas
included, are pinned, KV blocks make room for them, and when even that is not enough the
listener raises TOO_LARGE before changing anything (put raises ArenaFull before it publishes),
which ContextService turns into a refusal of the commit before any reply says it happened.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict

import msgpack

from mcpd.contexts import cached_delta, snapshot
from mcpd.contexts.cache_chain import CacheChain
from mcpd.contexts.cached_delta import CachedDelta
from mcpd.contexts.context import Context
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA
from mcpd.memory.shm_arena import ArenaFull, ShmArena
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.delta import FieldDelta


class ContextCache:
    """A StoreListener: keeps each context's committed versions in the arena."""

    def __init__(self, arena: ShmArena):
        self.arena = arena
        self.chains: dict[bytes, CacheChain] = {}   # by context key: what the arena holds of each

    def opened(self, context: Context) -> None:
        self.committed(context, [])   # version 0: its first snapshot

    def committed(self, context: Context, changes: list[FieldDelta]) -> None:
        key = _key(context.owner, context.id)
        parts, weight = cached_delta.encode(context, changes)
        chain = self.chains.get(key)
        if chain is None or chain.wants_snapshot(weight, context.nbytes):
            self._snapshot(key, context, chain)
            return
        self._put(CONTEXT_DELTA, _delta_key(key, context.version), parts, context)
        chain.deltas[context.version] = weight

    def dropped(self, context: Context) -> None:
        key = _key(context.owner, context.id)
        # The snapshot first: a crash before its deltas are gone leaves orphans, which load() deletes.
        self.arena.delete(CONTEXT, key)
        chain = self.chains.pop(key, None)
        if chain is not None:
            self._delete_deltas(key, chain.deltas)

    def load(self) -> list[Context]:
        """Every context in the cache, as last committed; rebuilds the chains."""
        contexts = {key: snapshot.decode(blob) for key, blob in self._entries(CONTEXT)}
        deltas = defaultdict(list)
        for _, blob in self._entries(CONTEXT_DELTA):
            delta = cached_delta.decode(blob)
            deltas[_key(delta.owner, delta.context_id)].append(delta)
        self.chains = {key: self._replay(key, context, deltas.pop(key, [])) for key, context in contexts.items()}
        for key, orphans in deltas.items():
            self._delete_deltas(key, [delta.version for delta in orphans])
        return list(contexts.values())

    def _snapshot(self, key: bytes, context: Context, old: CacheChain | None) -> None:
        self._put(CONTEXT, key, snapshot.encode(context), context)
        self.chains[key] = CacheChain(context.version)
        if old is not None:
            self._delete_deltas(key, old.deltas)

    def _replay(self, key: bytes, context: Context, deltas: list[CachedDelta]) -> CacheChain:
        """Bring the snapshot's context up to its last delta; delete deltas it cannot use."""
        chain, unusable = CacheChain(context.version), []
        for delta in sorted(deltas, key=lambda d: d.version):
            if delta.version == context.version + 1:   # in ascending order, nothing past a gap matches
                delta.replay(context)
                chain.deltas[delta.version] = delta.weight
            else:   # at or below the snapshot (left by a crash before the chain was deleted), or past a gap
                unusable.append(delta.version)
        self._delete_deltas(key, unusable)
        return chain

    def _put(self, kind: int, key: bytes, parts: list, context: Context) -> None:
        try:
            self.arena.put(kind, key, parts, pinned=True, replace=True)
        except ArenaFull as e:
            raise MCPDError(codes.TOO_LARGE, f"the host context cache cannot hold context {context.id!r} "
                                             f"at {context.nbytes} bytes ({e}); raise cache.bytes") from None

    def _delete_deltas(self, key: bytes, versions) -> None:
        for version in versions:
            self.arena.delete(CONTEXT_DELTA, _delta_key(key, version))

    def _entries(self, kind: int):
        blobs = ((key, self.arena.get(kind, key)) for key in self.arena.keys(kind))
        return [(key, blob) for key, blob in blobs if blob is not None]


def _key(owner: str, context_id: str) -> bytes:
    return hashlib.blake2b(msgpack.packb([owner, context_id]), digest_size=32, person=b"mcpd-context").digest()


def _delta_key(context_key: bytes, version: int) -> bytes:
    return hashlib.blake2b(context_key + version.to_bytes(8, "little"), digest_size=32,
                           person=b"mcpd-ctx-delta").digest()
