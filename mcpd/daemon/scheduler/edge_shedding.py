"""Edge shedding: under a flood the backlog builds before the class queues, not in them: in the
front-end's pipe and the scheduler's inbox, FIFOs where a high request waits behind every low
one. The front-end stamps each request when it reads it; the scheduler notes how long each it
reads waited on the way. Once MIN_LATE requests in a row waited past scheduler.shed_wait_ms,
those behind them waited longer still: the FIFO holds a backlog. Then, for a lease, the classes
marked `shed` (by default only low) are refused OVERLOADED: here those that waited past
shed_wait_ms (the backlog; one read on time found the FIFO clear), and at the front-end, told at
once, every new one past scheduler.shed_in_flight of its class in flight, so that they stop
filling the FIFO while that many are still served. A class not marked `shed` is never refused here.
A backlog before the front-end's read, which no stamp times, the front-end finds itself and starts
the same lease there (frontend/socket_backlog.py).

The scheduler renews the lease while reads still find a backlog, the front-end while it still
refuses (demand beyond what it keeps in flight; frontend/shed_table.py bounds how long); otherwise
it ends by itself: a scheduler gone or restarted never leaves a class shed.
"""
from __future__ import annotations

from mcpd.config import PriorityClass, SchedulerConfig
from mcpd.daemon import messages
from mcpd.daemon.child_stats import EdgeShedState

MIN_LATE = 64   # fewer late in a row may be one burst met by a scheduler descheduled a moment, not a backlog
LEASE_S = 1.0


def lease(config: SchedulerConfig) -> messages.Shed | None:
    """The front-end's lease on the classes marked `shed`; None when none is."""
    classes = sorted(name for name, cls in config.classes.items() if cls.shed)
    if not classes:
        return None
    return messages.Shed(classes, config.overloaded_retry_ms, round(LEASE_S * 1000), config.shed_in_flight)


class EdgeShedding:
    def __init__(self):
        self.late = 0        # requests in a row that waited past shed_wait_ms on their way here
        self.until = 0.0     # the shed classes are refused until then
        self.tell = False    # the front-end is yet to hear of the lease
        self.entered = 0     # backlogs found (status)

    def arrived(self, waited_s: float, shed_wait_ms: float, now: float) -> None:
        """A request read, after `waited_s` on its way: a backlog found starts the lease at once (or
        renews it, past its half), so the requests read after it are judged by it."""
        if not shed_wait_ms or waited_s * 1000 <= shed_wait_ms:
            self.late = 0
            return
        self.late += 1
        if self.late >= MIN_LATE and now >= self.until - LEASE_S / 2:
            self.entered += now >= self.until
            self.until, self.tell = now + LEASE_S, True

    def look(self, config: SchedulerConfig) -> messages.Shed | None:
        """After a read: the front-end's Shed when a lease started or was renewed in it."""
        if not self.tell:
            return None
        self.tell = False
        return lease(config)

    def sheds(self, cls: PriorityClass, waited_s: float, shed_wait_ms: float, now: float) -> bool:
        """Whether a request of `cls` that waited `waited_s` on its way here is refused: only one
        of the backlog; one the front-end admitted under its cap arrives on time and is served."""
        return cls.shed and now < self.until and waited_s * 1000 > shed_wait_ms

    def describe(self, now: float) -> EdgeShedState:
        return EdgeShedState(now < self.until, self.entered)
