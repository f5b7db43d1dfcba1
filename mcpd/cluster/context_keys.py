"""Where one context lives in Redis: three keys named after its tenant and id.

    mcpd:ctx:{<tenant>:<id>}:meta   hash: version (the newest committed), log_bytes
    mcpd:ctx:{<tenant>:<id>}:snap   the whole context at one version (a journal "context" record)
    mcpd:ctx:{<tenant>:<id>}:log    list: the commit records after that snapshot, in version order

The braces are a Redis Cluster hash tag: a context's three keys hash to one slot, so the scripts
that change them together run on one shard. Tenants and ids may hold any character; "%", "{",
"}" and ":" are escaped so that no tenant can end the tag early or name another tenant's keys.
"""
from __future__ import annotations

from typing import NamedTuple
from urllib.parse import unquote

from mcpd.protocol.ops import MAX_CONTEXT_ID_CHARS
from mcpd.protocol.wire import MAX_ID_CHARS

PREFIX = "mcpd:ctx:"
_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D", ":": "%3A"})
MAX_TAG_BYTES = 3 * 4 * (MAX_ID_CHARS + MAX_CONTEXT_ID_CHARS) + 1   # every character escaped and 4 bytes long


class ContextKeys(NamedTuple):
    meta: str
    snap: str
    log: str


def tag_of(owner: str, context_id: str) -> str:
    """The context's hash tag, without its braces: "<tenant>:<id>", escaped."""
    return f"{owner.translate(_ESCAPES)}:{context_id.translate(_ESCAPES)}"


def keys_of(owner: str, context_id: str) -> ContextKeys:
    tagged = f"{PREFIX}{{{tag_of(owner, context_id)}}}:"
    return ContextKeys(tagged + "meta", tagged + "snap", tagged + "log")


def parse_tag(raw: bytes) -> tuple[str, str] | None:
    """The (tenant, id) a tag read back from Redis names; None for anything tag_of could not have
    written (whoever wrote it): not UTF-8, not one colon, a name out of the protocol's bounds, or
    an escape tag_of would not make."""
    if len(raw) > MAX_TAG_BYTES:
        return None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    parts = text.split(":")
    if len(parts) != 2:
        return None
    owner, context_id = (unquote(part) for part in parts)   # a bad escape comes back unlike the tag: refused below
    if not (0 < len(owner) <= MAX_ID_CHARS and 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS):
        return None
    return (owner, context_id) if tag_of(owner, context_id) == text else None
