"""A backlog in the front-end's own client sockets, on a real daemon: the front-end is stopped
while a client pipelines thousands of lows, so when it resumes they wait in the kernel's buffer
and libzmq's pipe, before its read, where the scheduler's check (it times a request from that
read) cannot see them. The front-end's first look finds that a request arriving then would wait
past shed_wait_ms and starts the edge-shedding lease itself: the lows it reads after that are
refused at the door, a high request from another connection is served, every request is answered.

One worker seats one sequence and a long high stream holds it (test_overload.py's Blocker), so the
lows admitted stay in flight and the door's shed_in_flight cap refuses the rest whatever the pace."""
import os
import signal

import pytest
import zmq

from mcpd.protocol import codes, wire
from test_overload import BLOCKER_TOKENS, Blocker

LOWS = 4000
# The front-end takes tens of µs a request: the first look finds hundreds waiting, tens of ms of reading.
SHED_WAIT_MS = 2.0
HIGH_ID = LOWS + 1


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(scheduler={"max_inflight_per_worker": 1, "shed_wait_ms": SHED_WAIT_MS, "shed_in_flight": 4},
                         engine={"max_num_seqs": 1, "pool_bytes": 256 << 20},
                         model={"max_model_len": BLOCKER_TOKENS + 64}, limits={"max_new_tokens": BLOCKER_TOKENS})


def dealer(d) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)   # the whole pipeline queues here while the front-end is stopped
    sock.connect(d.endpoint)
    return sock


def finals(sock: zmq.Socket, count: int) -> list[dict]:
    return [wire.decode_reply(sock.recv()) for _ in range(count) if sock.poll(60000)]


def test_lows_waiting_in_the_front_ends_socket_start_the_lease_there_and_a_high_from_another_client_is_served(d):
    blocker = Blocker(d)
    lows, premium = dealer(d), dealer(d)
    args = {"prompt": "r", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    frontend = d.pid_of("frontend")
    os.kill(frontend, signal.SIGSTOP)
    try:
        for rid in range(1, LOWS + 1):
            lows.send(wire.encode_request("generate", rid, args, priority="low"))
    finally:
        os.kill(frontend, signal.SIGCONT)
    premium.send(wire.encode_request("generate", HIGH_ID, args, priority="high"))
    # Every low read: answered (refused at the door, or by the scheduler) or in flight behind the blocker.
    answered = []

    def every_low_read() -> bool:
        while lows.poll(0):
            answered.append(wire.decode_reply(lows.recv()))
        return len(answered) + d.control("status")["queue"]["inflight"] - 2 == LOWS   # less the blocker and the high

    d.wait_until(every_low_read, 60, "the front-end read every low")
    refused = [r for r in answered if r["kind"] == "error"]
    assert len(refused) >= LOWS // 2
    assert {(r["code"], "shed for now" in r["message"]) for r in refused} == {(codes.OVERLOADED, True)}
    assert d.status()["requests"]["incoming"].get("backlogs", 0) >= 1
    blocker.release()
    low_finals = answered + finals(lows, LOWS - len(answered))
    high = finals(premium, 1)
    lows.close()
    premium.close()
    assert [(r["id"], r["kind"]) for r in high] == [(HIGH_ID, "ok")]
    assert sorted(r["id"] for r in low_finals) == list(range(1, LOWS + 1))
    assert all(r["kind"] == "ok" for r in low_finals if r not in refused)
