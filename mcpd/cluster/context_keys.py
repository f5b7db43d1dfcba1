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

PREFIX = "mcpd:ctx:"
_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D", ":": "%3A"})


class ContextKeys(NamedTuple):
    meta: str
    snap: str
    log: str


def keys_of(owner: str, context_id: str) -> ContextKeys:
    tagged = f"{PREFIX}{{{owner.translate(_ESCAPES)}:{context_id.translate(_ESCAPES)}}}:"
    return ContextKeys(tagged + "meta", tagged + "snap", tagged + "log")
