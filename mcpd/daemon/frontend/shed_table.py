"""The classes the scheduler asked the front-end to shed (scheduler/edge_shedding.py says when),
or the front-end's own look at its client socket did (socket_backlog.py), and how many generate and infer requests of each class are in flight here. While the lease lasts,
one of a shed class past its `in_flight` is refused at once, OVERLOADED with the scheduler's
retry_after_ms, and never forwarded: the FIFO to the scheduler that high requests share holds no
more of them than that, and that many are still served. Each refusal holds the lease (demand
still outruns what the workers finish), for HOLD_S past the last word (the scheduler's or that look's) at most: a
stream of more than `in_flight` that the workers would keep up with is capped no longer. A lease
not held ends, and a lost scheduler clears it. Nothing shed: a request pays one truth test of
`classes` (the caller's), and a generate or infer a count up and one down.
"""
from __future__ import annotations

from collections import defaultdict

from mcpd.daemon import messages
from mcpd.protocol import codes
from mcpd.protocol.error import ErrorReply

SHED_OPS = frozenset({"generate", "infer"})
HOLD_S = 5.0   # under a flood a backlog rebuilds once per HOLD_S, not once per lease; a capped stream waits no longer


class ShedTable:
    def __init__(self):
        self.classes: frozenset[str] = frozenset()
        self.retry_after_ms = 0
        self.lease_s = 0.0
        self.until = 0.0
        self.held_until = 0.0   # refusals hold the lease to here at most
        self.kept = 0   # of each shed class, the requests in flight past which new ones are refused
        self.in_flight: dict[str, int] = defaultdict(int)   # admitted generate and infer by class label, unanswered
        self.refusals: dict[str, ErrorReply] = {}   # by class, built once a lease: under a flood most requests get one

    def update(self, shed: messages.Shed, now: float) -> None:
        self.classes, self.retry_after_ms, self.kept = frozenset(shed.classes), shed.retry_after_ms, shed.in_flight
        self.lease_s = shed.lease_ms / 1000
        self.until, self.held_until = now + self.lease_s, now + HOLD_S
        self.refusals = {}

    def clear(self) -> None:
        self.classes = frozenset()

    def refuses(self, op: str, class_name: str, now: float) -> bool:
        """Whether a generate or infer of a shed class with `kept` in flight is refused: while the
        lease lasts, which a refusal holds for as long again (up to held_until)."""
        if now >= self.until:
            self.classes = frozenset()
            return False
        if class_name in self.classes and op in SHED_OPS and self.in_flight[class_name] >= self.kept:
            self.until = max(self.until, min(now + self.lease_s, self.held_until))
            return True
        return False

    def refusal(self, class_name: str) -> ErrorReply:
        refusal = self.refusals.get(class_name)
        if refusal is None:
            refusal = self.refusals[class_name] = ErrorReply(
                codes.OVERLOADED, f"overloaded: class {class_name!r} is shed for now (requests wait on their way "
                "to the scheduler)", self.retry_after_ms)
        return refusal

    def admitted(self, op: str, class_name: str) -> None:
        if op in SHED_OPS:
            self.in_flight[class_name] += 1

    def answered(self, op: str, class_name: str) -> None:
        if op in SHED_OPS:
            self.in_flight[class_name] -= 1
