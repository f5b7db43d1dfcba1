"""Stable error codes carried in error replies, and the exception that carries one.

Codes are part of the wire contract (docs/PROTOCOL.md): never rename one, only add.
"""
from __future__ import annotations

BAD_REQUEST = "BAD_REQUEST"                  # malformed frame, wrong type, bad value
UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"  # header "v" is not a protocol version we speak
UNKNOWN_OP = "UNKNOWN_OP"                    # header "op" names no operation
TOO_LARGE = "TOO_LARGE"                      # a frame, header or request over a configured limit
RATE_LIMITED = "RATE_LIMITED"                # client over its rate limit; retry_after_ms says when
OVERLOADED = "OVERLOADED"                    # queue full; retry_after_ms says when
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"      # timeout_ms passed before the request finished
CONFLICT = "CONFLICT"                        # stale base version, duplicate request id
NOT_FOUND = "NOT_FOUND"                      # no such request / context
CANCELLED = "CANCELLED"                      # the client cancelled the request
UNAUTHORIZED = "UNAUTHORIZED"                # not allowed for this client
UNAVAILABLE = "UNAVAILABLE"                  # daemon draining or stopping
WORKER_LOST = "WORKER_LOST"                  # the worker running the request died mid-way
STORAGE_FULL = "STORAGE_FULL"                # no room to keep a change (disk, host cache): nothing changed; retry_after_ms
UNKNOWN_MODEL = "UNKNOWN_MODEL"              # the request names a model or version not served now (unknown, unloaded)
BAD_INPUT = "BAD_INPUT"                      # an infer input's datatype, shape, bytes or name is not what the model takes
INTERNAL = "INTERNAL"                        # a bug on our side; the message says what
TIMEOUT = "TIMEOUT"                          # client side only: no reply within the client's timeout

ALL = (BAD_REQUEST, UNSUPPORTED_VERSION, UNKNOWN_OP, TOO_LARGE, RATE_LIMITED, OVERLOADED,
       DEADLINE_EXCEEDED, CONFLICT, NOT_FOUND, CANCELLED, UNAUTHORIZED, UNAVAILABLE, WORKER_LOST,
       STORAGE_FULL, UNKNOWN_MODEL, BAD_INPUT, INTERNAL, TIMEOUT)


class MCPDError(Exception):
    """An error reply (or a client-side failure) with its stable code."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.request_id = None   # set by the daemon when the failing request's id is known
