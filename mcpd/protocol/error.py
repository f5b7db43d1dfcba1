"""An error as a value: the fields an error reply carries (docs/PROTOCOL.md section 5).

The process that refuses a request builds one (`of` an MCPDError, or `internal` for a bug);
wire.error_reply alone encodes it into a reply header; a client reads it back from one (`read`)
and the HTTP listener maps its code to a status (http/errors.py). The wire shape stays the flat
header clients already read: "code", "message" and, when set, "retry_after_ms".
"""
from __future__ import annotations

import msgspec

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


class ErrorReply(msgspec.Struct, frozen=True):
    code: str                          # one of codes.ALL
    message: str
    retry_after_ms: int | None = None   # OVERLOADED, RATE_LIMITED, STORAGE_FULL: when to try again

    @classmethod
    def of(cls, error: MCPDError) -> ErrorReply:
        return cls(error.code, error.message, error.retry_after_ms)

    @classmethod
    def internal(cls, error: Exception) -> ErrorReply:
        """A bug on our side, named by the exception that showed it."""
        return cls(codes.INTERNAL, f"{type(error).__name__}: {error}")

    @classmethod
    def read(cls, reply: dict) -> ErrorReply:
        """Client side: the error of an error reply's header (the daemon is trusted less than fully:
        one that does not decode is INTERNAL, saying so)."""
        try:
            return msgspec.convert(reply, cls)
        except msgspec.ValidationError as e:
            return cls(codes.INTERNAL, f"the daemon's error reply does not decode: {e}")

    def exception(self) -> MCPDError:
        return MCPDError(self.code, self.message, self.retry_after_ms)
