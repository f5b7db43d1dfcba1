"""The bytes of request bodies the HTTP listener holds while they arrive, all connections
together: held to limits.max_incoming_bytes, as the ZeroMQ clients' unfinished messages are
(daemon/frontend/incoming.py), with a budget of its own.

Each body takes its room before a byte of it is read: its Content-Length, or http.max_body_bytes
for a chunked one (what it may grow to). A body that does not fit is refused at once, unread;
without this, connections each beginning a body just under http.max_body_bytes and stalling held
that much each until http.body_timeout_s, gigabytes from a few hundred connections.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from mcpd.http.errors import HttpError
from mcpd.protocol import codes

RETRY_AFTER_MS = 1000   # about when stalled bodies time out and others finish arriving


class BodyBudget:
    def __init__(self, total: int):
        self.total, self.held = total, 0

    @contextmanager
    def room(self, size: int) -> Iterator[None]:
        """Hold `size` bytes while the body arrives; 429 OVERLOADED (closing) if they do not fit."""
        if self.held + size > self.total:
            raise HttpError(429, f"the bodies arriving on all connections fill limits.max_incoming_bytes "
                                 f"({self.total} bytes); a body of {size} bytes does not fit now",
                            codes.OVERLOADED, retry_after_ms=RETRY_AFTER_MS, closes=True)
        self.held += size
        try:
            yield
        finally:
            self.held -= size
