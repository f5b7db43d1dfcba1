"""Requests known to break workers, remembered for a while so that sending one again is refused at
once instead of taking the node down again.

A request lands here when it failed twice (its worker died, or the engine raised), the second time
running alone on its worker, so it is the cause and not a bystander of its batch. Without this, a
client that resends it (a retry loop, or an attacker once a second) kills a worker twice per
request and keeps the node restarting with growing backoff. A request is known by its tenant, op
and arguments: the same request from another tenant is not refused (that would tell one tenant
what another sent), and a changed argument makes a new request. Entries expire after TTL_S and the
table holds at most CAPACITY of them (the oldest go first), so it costs bounded memory.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgspec

from mcpd.daemon.messages import Request

TTL_S = 600.0
CAPACITY = 1024


def fingerprint(request: Request, payload=()) -> bytes:
    """What identifies a request across resends: not its id, deadline or class, which a resend
    changes. The typed args name their op and hold every default, so leaving an argument out and
    sending its default are the same request; an infer's inputs are its payload frames."""
    body = msgspec.msgpack.encode((request.tenant, request.args, list(payload)))
    return hashlib.blake2b(body, digest_size=16).digest()


class PoisonList:
    def __init__(self, ttl_s: float = TTL_S, capacity: int = CAPACITY):
        self.ttl_s, self.capacity = ttl_s, capacity
        self.expiry: OrderedDict[bytes, float] = OrderedDict()   # fingerprint -> when it is forgotten

    def __len__(self) -> int:
        return len(self.expiry)

    def add(self, request: Request, now: float, payload=()) -> None:
        key = fingerprint(request, payload)
        self.expiry.pop(key, None)
        self.expiry[key] = now + self.ttl_s
        while len(self.expiry) > self.capacity:
            self.expiry.popitem(last=False)

    def holds(self, request: Request, now: float, payload=()) -> bool:
        if not self.expiry:   # the common case costs no hashing
            return False
        while self.expiry and next(iter(self.expiry.values())) <= now:
            self.expiry.popitem(last=False)
        return fingerprint(request, payload) in self.expiry
