"""The classes the scheduler asked the front-end to shed (scheduler/edge_shedding.py says when): a
generate or infer of one is refused at once, OVERLOADED with the scheduler's retry_after_ms, and
never forwarded, so it neither waits in nor lengthens the FIFO to the scheduler that high requests
share. Only until the lease ends unless renewed, and a lost scheduler clears it. Nothing shed: a
request pays one truth test of `classes` (the caller's).
"""
from __future__ import annotations

from mcpd.daemon import messages
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

SHED_OPS = frozenset({"generate", "infer"})


class ShedTable:
    def __init__(self):
        self.classes: frozenset[str] = frozenset()
        self.retry_after_ms = 0
        self.until = 0.0

    def update(self, shed: messages.Shed, now: float) -> None:
        self.classes, self.retry_after_ms = frozenset(shed.classes), shed.retry_after_ms
        self.until = now + shed.lease_ms / 1000

    def clear(self) -> None:
        self.classes = frozenset()

    def check(self, op: str, class_name: str, now: float) -> None:
        """Raises OVERLOADED for a generate or infer of a shed class while the lease lasts."""
        if now >= self.until:
            self.classes = frozenset()
        elif class_name in self.classes and op in SHED_OPS:
            raise MCPDError(codes.OVERLOADED, f"overloaded: class {class_name!r} is shed for now (requests wait "
                            "on their way to the scheduler)", self.retry_after_ms)
