"""W3C Trace Context's `traceparent` (https://www.w3.org/TR/trace-context/): read from clients,
written on the messages between mcpd's processes. No OpenTelemetry import: the front-end reads
clients' values with this alone.

A client's value is hostile: anything but the exact form is ignored (the request is traced as if
it had sent none), never refused, and its length is checked before anything else looks at it.
"""
from __future__ import annotations

import re
from typing import NamedTuple

MAX_CHARS = 256   # version 00 is 55 characters; a later version may append fields, within reason
_FORM = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?")
SAMPLED = 0x01


class Parent(NamedTuple):
    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse(value) -> Parent | None:
    """The parent a traceparent names, or None for anything malformed (of any type)."""
    if not isinstance(value, str) or len(value) > MAX_CHARS:
        return None
    match = _FORM.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    # ff is forbidden; version 00 has exactly four fields; an all-zero id names nothing.
    if version == "ff" or (version == "00" and rest is not None):
        return None
    parent = Parent(int(trace_id, 16), int(span_id, 16), int(flags, 16))
    return parent if parent.trace_id and parent.span_id else None


def encode(trace_id: int, span_id: int, flags: int = SAMPLED) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
