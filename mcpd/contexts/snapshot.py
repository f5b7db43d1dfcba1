"""A whole context as one host cache entry: what a chain of delta entries starts from.

The map holds id, owner, version, the per-field version bookkeeping `changes_since` needs, and
each field's type and shape; the payloads are the fields' bytes in order. Arrays come back with
their dtype (byte order included), shape and bytes, bit-identical.
"""
from __future__ import annotations

import numpy as np

from mcpd.contexts import cache_entry
from mcpd.contexts.context import Context


def encode(context: Context) -> list:
    """The entry's parts (arrays as they are: no copy)."""
    described, payloads = [], []
    for name, value in context.fields.items():
        if type(value) in _SCALARS:   # most fields of a context of many: no payload to describe
            described.append([name, "scalar", value, 0])
            continue
        kind, info, payload = _describe(value)
        described.append([name, kind, info, len(payload)])
        payloads.append(payload)
    return cache_entry.pack({
        "id": context.id, "owner": context.owner, "version": context.version,
        "changed_at": context.changed_at, "deleted_at": context.deleted_at,
        "token_count_at": list(context.token_count_at.items()),
        "tokens_rewritten_at": context.tokens_rewritten_at, "fields": described}, payloads)


_SCALARS = (int, float, bool, type(None))


def decode(blob: bytearray) -> Context:
    meta, payloads = cache_entry.unpack(blob, lambda m: [nbytes for *_, nbytes in m["fields"]])
    fields = {name: _value(kind, info, payload) for (name, kind, info, _), payload in zip(meta["fields"], payloads)}
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
