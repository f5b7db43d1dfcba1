"""The front-end's look for a backlog in its own client sockets (socket_backlog.py) in-process:
the bytes taken and waiting are numbers the test sets, the clock is the test's. What crosses
processes (real connections, the kernel's counters) is test_socket_backlog.py's."""
import pytest

from mcpd.daemon.frontend.socket_backlog import LOOK_S, LOOK_SHARE, SETTLE_S, SocketBacklog
from fakes import Clock

REQUEST_BYTES = 100
SHED_WAIT_MS = 10.0


class Sockets:
    """The client connections as counts on the test's clock: bytes the front-end took so far,
    bytes waiting, how often the waiting bytes were asked for, and how long each asking takes
    (a look's system calls)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.taken_bytes, self.waiting_bytes, self.asked, self.ask_s, self.settled = 0, 0, 0, 0.0, 0

    def taken(self) -> int:
        return self.taken_bytes

    def waiting(self) -> int:
        self.asked += 1
        self.clock.now += self.ask_s
        return self.waiting_bytes

    def settle(self) -> None:
        self.settled += 1


@pytest.fixture
def sockets():
    return Sockets(Clock())


@pytest.fixture
def backlog(sockets):
    return SocketBacklog(sockets.taken, sockets.waiting, sockets.settle, sockets.clock)


def turn(backlog: SocketBacklog, sockets: Sockets, seconds: float, requests: int, left: int) -> None:
    """One turn of `seconds` that took `requests`, leaving `left` waiting."""
    backlog.reading()
    sockets.clock.now += seconds
    sockets.taken_bytes += requests * REQUEST_BYTES
    sockets.waiting_bytes = left * REQUEST_BYTES


def test_a_pipeline_read_within_shed_wait_ms_leaves_too_little_behind_to_be_a_backlog(backlog, sockets):
    turn(backlog, sockets, 0.005, 256, left=2)   # 257 pipelined: all but two taken in 5 ms
    assert not backlog.look(SHED_WAIT_MS)
    backlog.emptied()
    assert backlog.found == 0


def test_arrivals_that_outrun_the_reading_are_a_backlog_found_once_per_stretch(backlog, sockets):
    turn(backlog, sockets, 0.010, 256, left=1000)   # 256 in 10 ms, 1000 waiting: 39 ms for the next arrival
    assert backlog.look(SHED_WAIT_MS)
    turn(backlog, sockets, 0.010, 256, left=1200)
    assert backlog.look(SHED_WAIT_MS)   # still inside the same backlog: found once
    assert backlog.found == 1
    backlog.emptied()   # the socket found empty: the next stretch is timed from its own start
    sockets.clock.now += 1.0
    turn(backlog, sockets, 0.010, 256, left=100)   # 4 ms behind
    assert not backlog.look(SHED_WAIT_MS)
    turn(backlog, sockets, 0.010, 256, left=800)
    assert backlog.look(SHED_WAIT_MS)
    assert backlog.found == 2


def test_it_looks_at_most_every_look_s_and_never_with_shed_wait_ms_off(backlog, sockets):
    turn(backlog, sockets, LOOK_S / 2, 256, left=10_000)
    assert not backlog.look(SHED_WAIT_MS) and sockets.asked == 0
    turn(backlog, sockets, LOOK_S / 2, 256, left=10_000)
    assert not backlog.look(0.0) and sockets.asked == 0
    assert backlog.look(SHED_WAIT_MS) and sockets.asked == 1
    turn(backlog, sockets, LOOK_S / 2, 256, left=10_000)
    assert not backlog.look(SHED_WAIT_MS) and sockets.asked == 1


def test_looks_that_cost_more_are_spaced_out_to_a_small_share_of_the_reading(backlog, sockets):
    """Many connections read from make a look many system calls: it waits for LOOK_SHARE of the time."""
    sockets.ask_s = LOOK_S   # a look as long as the interval between two
    turn(backlog, sockets, LOOK_S, 256, left=10_000)
    assert backlog.look(SHED_WAIT_MS) and sockets.asked == 1
    turn(backlog, sockets, LOOK_S / LOOK_SHARE - 2 * LOOK_S, 256, left=10_000)
    assert not backlog.look(SHED_WAIT_MS) and sockets.asked == 1
    turn(backlog, sockets, LOOK_S, 256, left=10_000)
    assert backlog.look(SHED_WAIT_MS) and sockets.asked == 2


def test_reading_found_done_settles_the_connections_counts_at_most_every_settle_s(backlog, sockets):
    """Off a request's path: a lone request's turn ends in an empty socket every time."""
    for _ in range(3):
        turn(backlog, sockets, 0.001, 1, left=0)
        backlog.emptied()
    assert sockets.settled == 1
    sockets.clock.now += SETTLE_S
    turn(backlog, sockets, 0.001, 1, left=0)
    backlog.emptied()
    assert sockets.settled == 2
