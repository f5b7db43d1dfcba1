"""The front-end's look for a backlog in its own client sockets (socket_backlog.py) in-process:
the bytes taken and waiting are numbers the test sets, the clock is the test's. What crosses
processes (real connections, the kernel's counters) is test_socket_backlog.py's."""
import pytest

from mcpd.daemon.frontend.socket_backlog import LOOK_S, SocketBacklog

REQUEST_BYTES = 100
SHED_WAIT_MS = 10.0


class Sockets:
    """The client connections as counts: bytes the front-end took so far, bytes waiting, and how
    often the waiting bytes were asked for (a look's system calls)."""

    def __init__(self):
        self.taken_bytes, self.waiting_bytes, self.asked = 0, 0, 0

    def taken(self) -> int:
        return self.taken_bytes

    def waiting(self) -> int:
        self.asked += 1
        return self.waiting_bytes


@pytest.fixture
def sockets():
    return Sockets()


def read(backlog: SocketBacklog, sockets: Sockets, now: float, requests: int, left: int) -> None:
    """One turn that began at `now` and took `requests`, leaving `left` waiting."""
    backlog.reading(now)
    sockets.taken_bytes += requests * REQUEST_BYTES
    sockets.waiting_bytes = left * REQUEST_BYTES


def test_a_pipeline_read_within_shed_wait_ms_leaves_too_little_behind_to_be_a_backlog(sockets):
    backlog = SocketBacklog(sockets.taken, sockets.waiting)
    read(backlog, sockets, 0.0, 256, left=2)   # 257 pipelined: all but two taken in 5 ms
    assert not backlog.look(0.005, SHED_WAIT_MS)
    backlog.emptied()
    assert backlog.found == 0


def test_arrivals_that_outrun_the_reading_are_a_backlog_found_once_per_stretch(sockets):
    backlog = SocketBacklog(sockets.taken, sockets.waiting)
    read(backlog, sockets, 0.0, 256, left=1000)   # 256 in 10 ms, 1000 waiting: 39 ms for the next arrival
    assert backlog.look(0.010, SHED_WAIT_MS)
    read(backlog, sockets, 0.010, 256, left=1200)
    assert backlog.look(0.020, SHED_WAIT_MS)   # still inside the same backlog: found once
    assert backlog.found == 1
    backlog.emptied()   # the socket found empty: the next stretch is timed from its own start
    read(backlog, sockets, 1.0, 256, left=100)   # 4 ms behind
    assert not backlog.look(1.010, SHED_WAIT_MS)
    read(backlog, sockets, 1.010, 256, left=800)
    assert backlog.look(1.020, SHED_WAIT_MS)
    assert backlog.found == 2


def test_it_looks_at_most_every_look_s_and_never_with_shed_wait_ms_off(sockets):
    backlog = SocketBacklog(sockets.taken, sockets.waiting)
    read(backlog, sockets, 0.0, 256, left=10_000)
    assert not backlog.look(LOOK_S / 2, SHED_WAIT_MS) and sockets.asked == 0
    assert not backlog.look(LOOK_S, 0.0) and sockets.asked == 0
    assert backlog.look(LOOK_S, SHED_WAIT_MS) and sockets.asked == 1
    assert not backlog.look(1.5 * LOOK_S, SHED_WAIT_MS) and sockets.asked == 1
