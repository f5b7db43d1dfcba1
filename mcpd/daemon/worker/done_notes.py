"""The Done notes a worker owes the scheduler: the rids it answered, sent together.

They are held up to DONE_FLUSH_S (or DONE_FLUSH_COUNT of them) and sent as one: the scheduler's
load counts lag by at most that, and a busy worker saves it one wake-up per request. A worker that
has just run out of work says so at once: the scheduler must not take an idle node for a busy one
(it would hold the next request open for a batching window). A ping is no such work (the
scheduler's hold does not count it, scheduler/dispatch.py), so the notes of pings alone wait for
company: a client pinging in a loop costs the scheduler one wake-up per DONE_FLUSH_S, not two per ping.
"""
from __future__ import annotations

from mcpd.daemon import messages

DONE_FLUSH_S = 0.002
DONE_FLUSH_COUNT = 64


class DoneNotes:
    def __init__(self, clock):
        self.clock = clock
        self.rids: list[int] = []
        self.due = 0.0
        self.work = False   # a request that was work is among them: said at once when idle

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, rid: int, work: bool = True) -> None:
        if not self.rids:
            self.due = self.clock() + DONE_FLUSH_S
        self.rids.append(rid)
        self.work = self.work or work

    def wait_ms(self) -> float | None:
        """How long until the held note is due; None when none is held."""
        return max(0.0, (self.due - self.clock()) * 1e3) if self.rids else None

    def take(self, idle: bool) -> messages.Done | None:
        """The note to send now, if it is due: full, held long enough, or the worker `idle` with work among it."""
        if self.rids and (len(self.rids) >= DONE_FLUSH_COUNT or self.clock() >= self.due or idle and self.work):
            note = messages.Done(self.rids)
            self.rids, self.work = [], False
            return note
        return None
