"""HTTP refusals in OpenAI's error shape, and the daemon's error codes as HTTP statuses.

OpenAI's body is `{"error": {"message", "type", "param", "code"}}`; `code` carries mcpd's stable
code (docs/PROTOCOL.md section 5) so a client can tell OVERLOADED from RATE_LIMITED. Codes that
suggest a retry keep their hint as a `Retry-After` header (whole seconds, at least 1).
"""
from __future__ import annotations

import json
import math

from mcpd.protocol import codes
from mcpd.protocol.error import ErrorReply

STATUS_OF = {
    codes.BAD_REQUEST: 400, codes.UNSUPPORTED_VERSION: 500, codes.UNKNOWN_OP: 500, codes.TOO_LARGE: 413,
    codes.RATE_LIMITED: 429, codes.OVERLOADED: 429, codes.DEADLINE_EXCEEDED: 504, codes.CONFLICT: 409,
    codes.NOT_FOUND: 404, codes.CANCELLED: 499, codes.UNAUTHORIZED: 401, codes.UNAVAILABLE: 503,
    codes.WORKER_LOST: 500, codes.STORAGE_FULL: 507, codes.UNKNOWN_MODEL: 404, codes.BAD_INPUT: 400,
    codes.INTERNAL: 500, codes.TIMEOUT: 504,
}
TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
           408: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
           429: "rate_limit_error"}


class HttpError(Exception):
    """A refusal of the listener itself (before the daemon saw the request)."""

    def __init__(self, status: int, message: str, code: str = codes.BAD_REQUEST, param: str | None = None,
                 retry_after_ms: int | None = None, closes: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after_ms = status, message, code, param, retry_after_ms
        self.closes = closes or status in (408, 413)   # a body not read to its end: the connection cannot go on

    @classmethod
    def of(cls, error: ErrorReply) -> "HttpError":
        """The daemon's error as OpenAI shapes it, its code's status from STATUS_OF."""
        return cls(STATUS_OF.get(error.code, 500), error.message, error.code, retry_after_ms=error.retry_after_ms)

    def body(self) -> dict:
        kind = TYPE_OF.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        if self.retry_after_ms is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000)))}


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, codes.BAD_REQUEST, param)
