"""Edge shedding on a real daemon: low requests held up on their way to the scheduler (it is
stopped while they arrive, so each waits past shed_wait_ms by construction) are a backlog; past
its first MIN_LATE they are refused at once, and a high request among them still goes first. A
low sent after them is kept (fewer than scheduler.shed_in_flight lows in flight) and served.

One worker seats one sequence and takes one request per class rank at a time, and a long high
stream holds it (test_overload.py's Blocker): everything else waits in the scheduler's queue, so
the test arranges order by that, not by timing. Finals are read in the order they arrive on one
raw DEALER."""
import os
import signal
import time

import pytest
import zmq

from mcpd.daemon.scheduler.edge_shedding import MIN_LATE
from mcpd.protocol import codes, wire
from test_overload import BLOCKER_TOKENS, Blocker

# Far above a hop under a loaded CI box: the fresh low below must reach the scheduler on time.
SHED_WAIT_MS = 200.0
LOWS = 2 * MIN_LATE   # before the high request, and as many after it
HIGH = LOWS + 1


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(scheduler={"max_inflight_per_worker": 1, "shed_wait_ms": SHED_WAIT_MS,
                                    "shed_in_flight": MIN_LATE},
                         engine={"max_num_seqs": 1, "pool_bytes": 256 << 20},
                         model={"max_model_len": BLOCKER_TOKENS + 64}, limits={"max_new_tokens": BLOCKER_TOKENS})


def finals(sock: zmq.Socket, count: int) -> list[dict]:
    return [wire.decode_reply(sock.recv()) for _ in range(count) if sock.poll(60000)]


def test_a_backlog_of_lows_on_the_way_to_the_scheduler_is_shed_a_high_among_them_goes_first_and_a_fresh_low_is_kept(d):
    blocker = Blocker(d)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    args = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    order = [*range(1, HIGH), HIGH, *range(HIGH + 1, HIGH + 1 + LOWS)]
    scheduler = d.pid_of("scheduler")
    os.kill(scheduler, signal.SIGSTOP)
    try:
        for rid in order:
            sock.send(wire.encode_request("generate", rid, {"prompt": f"r{rid}", **args},
                                          priority="high" if rid == HIGH else "low"))
        d.wait_until(lambda: d.control("status")["queue"]["inflight"] == 1 + len(order), 30,
                     "the front-end holds every request")
        time.sleep(2 * SHED_WAIT_MS / 1000)   # a wait past shed_wait_ms on the way, for every one of them
    finally:
        os.kill(scheduler, signal.SIGCONT)
    # Found on the MIN_LATE-th late request in a row at the latest (the blocker, read late on a
    # loaded machine, may have begun the row): the lows from there on are refused at once, while
    # the blocker still runs, and those before it wait in the queue.
    first = finals(sock, 1)[0]
    assert first["id"] <= MIN_LATE
    admitted_lows = list(range(1, first["id"]))
    shed = [rid for rid in order if rid != HIGH and rid not in admitted_lows]
    refused = [first, *finals(sock, len(shed) - 1)]
    assert [(r["id"], r["code"]) for r in refused] == [(rid, codes.OVERLOADED) for rid in shed]
    # Sent on time with fewer than shed_in_flight lows in flight (the blocker still runs): the
    # front-end forwards it and the scheduler queues it, behind the lows it kept, lease or not.
    fresh = HIGH + 1 + LOWS
    sock.send(wire.encode_request("generate", fresh, {"prompt": "fresh", **args}, priority="low"))
    blocker.release()
    served = finals(sock, 2 + len(admitted_lows))
    sock.close()
    assert [(r["id"], r["kind"]) for r in served] == [(rid, "ok") for rid in (HIGH, *admitted_lows, fresh)]
    assert d.status()["scheduler"]["edge_shed"]["entered"] == 1
