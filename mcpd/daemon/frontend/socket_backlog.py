"""A backlog in the front-end's own client sockets, found while it builds.

The scheduler's check (scheduler/edge_shedding.py) times a request from the front-end's read, so
it cannot see a wait before that read: under a flood the front-end itself is the slowest reader,
and the requests wait in libzmq's pipes and the kernel's buffers, where a high request's client
starves for the cores the flood's requests take. So, while the front-end reads without finding
its client socket empty, it looks now and then: the bytes its clients' TCP connections received
that it has not taken yet (incoming.py counts both), over the bytes a second it took since the
socket was last empty, is how long a request arriving now waits before it is read. Past
scheduler.shed_wait_ms that is a backlog, and the front-end starts the edge-shedding lease itself.
A pipelined burst the front-end reads within shed_wait_ms has left little behind by the first
look, so it trips nothing; only arrivals that outrun the reading do.
"""
from __future__ import annotations

import time
from typing import Callable

LOOK_S = 0.002     # between looks while reading
SETTLE_S = 1.0     # between settles when reading ends: off a request's path, a heartbeat's bytes a second apart
LOOK_SHARE = 0.05  # of the reading's time, looks take at most this (a look is a system call per connection)


class SocketBacklog:
    def __init__(self, taken: Callable[[], int], waiting: Callable[[], int], settle: Callable[[], None],
                 clock=time.monotonic):
        self.taken = taken       # wire bytes taken from the client connections so far
        self.waiting = waiting   # wire bytes of requests received on the connections read since its last call, not yet taken
        self.settle = settle     # all was taken: what those connections received beyond is no request (incoming.py)
        self.clock = clock
        self.began: float | None = None   # when the reading began, the socket last found empty before it
        self.taken_then = 0
        self.next_look = 0.0
        self.next_settle = 0.0
        self.inside = False   # the last look found a backlog
        self.found = 0        # backlogs found since start (status)

    def reading(self) -> None:
        """A turn of reading the clients begins."""
        if self.began is None:
            self.began, self.taken_then = self.clock(), self.taken()
            self.next_look = self.began + LOOK_S

    def emptied(self) -> None:
        """The turn found the client socket empty: whatever waited has been read."""
        self.began, self.inside = None, False
        now = self.clock()
        if now >= self.next_settle:
            self.settle()
            self.next_settle = now + max(SETTLE_S, (self.clock() - now) / LOOK_SHARE)

    def look(self, shed_wait_ms: float) -> bool:
        """After a turn that left requests waiting: whether a request arriving now would wait past
        shed_wait_ms before it is read (0: never looked for)."""
        now = self.clock()
        if not shed_wait_ms or self.began is None or now < self.next_look:
            return False
        taken = self.taken() - self.taken_then
        if taken <= 0:
            return False
        wait_s = self.waiting() * (now - self.began) / taken
        self.next_look = now + max(LOOK_S, (self.clock() - now) / LOOK_SHARE)
        was_inside, self.inside = self.inside, wait_s * 1000 > shed_wait_ms
        self.found += self.inside and not was_inside
        return self.inside
