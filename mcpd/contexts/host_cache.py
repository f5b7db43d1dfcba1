"""Committed contexts in the host shared-memory cache: a store listener that writes every
committed version there, and the loader a (re)started scheduler restores them from.

One entry per context, keyed by a digest of (owner, id), rewritten whole at every commit and
replaced only once the new version is fully written (ShmArena.put with replace), so a crash at
any moment leaves the last published version. Whole rather than per field: a context is then
always one consistent version, at the cost of copying all of it per commit (memcpy speed, a few
ms per 10 MB); per-field entries would save that for large fields that rarely change.

Entry layout: u32 length of a msgpack map, the map (id, owner, version, the per-field version
bookkeeping `changes_since` needs, and each field's type and shape), then each field's bytes in
order. Arrays come back with their dtype (byte order included), shape and bytes, bit-identical.

Why contexts are never evicted, and a commit that does not fit is refused: a context is state a
client was told is committed (its version), not a cache of something recomputable. Evicting it
would lose it at the next scheduler restart without telling anyone. So context entries are pinned,
KV blocks make room for them, and when even that is not enough the listener raises TOO_LARGE,
which ContextService turns into a refusal of the commit before any reply says it happened.
"""
from __future__ import annotations

import hashlib
import struct

import msgpack
import numpy as np

from mcpd.contexts.context import Context
from mcpd.memory.host_segment import CONTEXT
from mcpd.memory.shm_arena import ArenaFull, ShmArena
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.delta import FieldDelta

_LENGTH = struct.Struct("<I")


class ContextCache:
    """A StoreListener: keeps each context's latest committed version in the arena."""

    def __init__(self, arena: ShmArena):
        self.arena = arena

    def committed(self, context: Context, _changes: list[FieldDelta]) -> None:
        try:
            self.arena.put(CONTEXT, _key(context.owner, context.id), encode(context), pinned=True, replace=True)
        except ArenaFull as e:
            raise MCPDError(codes.TOO_LARGE, f"the host context cache cannot hold context {context.id!r} "
                                             f"at {context.nbytes} bytes ({e}); raise cache.bytes") from None

    def dropped(self, context: Context) -> None:
        self.arena.delete(CONTEXT, _key(context.owner, context.id))

    def load(self) -> list[Context]:
        """Every context in the cache, as last committed."""
        blobs = (self.arena.get(CONTEXT, key) for key in self.arena.keys(CONTEXT))
        return [decode(blob) for blob in blobs if blob is not None]


def _key(owner: str, context_id: str) -> bytes:
    return hashlib.blake2b(msgpack.packb([owner, context_id]), digest_size=32, person=b"mcpd-context").digest()


def encode(context: Context) -> list:
    """The entry's parts: length, map, then the fields' bytes (arrays as they are: no copy)."""
    described, payloads = [], []
    for name, value in context.fields.items():
        kind, info, payload = _describe(value)
        described.append([name, kind, info, len(payload)])
        payloads.append(payload)
    meta = msgpack.packb({
        "id": context.id, "owner": context.owner, "version": context.version,
        "changed_at": context.changed_at, "deleted_at": context.deleted_at,
        "token_count_at": list(context.token_count_at.items()),
        "tokens_rewritten_at": context.tokens_rewritten_at, "fields": described})
    return [_LENGTH.pack(len(meta)), meta, *payloads]


def decode(blob: bytearray) -> Context:
    (length,) = _LENGTH.unpack_from(blob)
    meta = msgpack.unpackb(blob[_LENGTH.size:_LENGTH.size + length], raw=False)
    at = _LENGTH.size + length
    fields = {}
    for name, kind, info, nbytes in meta["fields"]:
        fields[name] = _value(kind, info, memoryview(blob)[at:at + nbytes])
        at += nbytes
    return Context(meta["id"], meta["owner"], meta["version"], fields, meta["changed_at"], meta["deleted_at"],
                   dict(map(tuple, meta["token_count_at"])), meta["tokens_rewritten_at"])


def _describe(value) -> tuple[str, object, memoryview | bytes]:
    if isinstance(value, np.ndarray):
        return "array", [value.dtype.str, list(value.shape)], memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    if isinstance(value, bytes):
        return "bytes", None, value
    if isinstance(value, str):
        return "str", None, value.encode()
    return "scalar", value, b""


def _value(kind: str, info, payload: memoryview):
    if kind == "array":
        dtype, shape = info
        # A copy the context owns, writable like every array the store holds.
        return np.frombuffer(payload, np.dtype(dtype)).reshape(shape).copy()
    if kind == "bytes":
        return bytes(payload)
    if kind == "str":
        return str(payload, "utf-8")
    return info
