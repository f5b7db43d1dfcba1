"""sockets.Waiter over real ZeroMQ sockets on ipc (each message crosses both I/O threads): it names
the sockets that hold a message and the watched descriptors that are readable, and nothing else."""
import os
import select
import tempfile

import pytest
import zmq

from mcpd import sockets
from mcpd.sockets import Waiter, drain

LONG_MS = 30_000   # a bound for a wait that ends when the message arrives, never reached


@pytest.fixture
def pulls():
    """Two PULL sockets, each reached by its own PUSH over ipc, connected."""
    context = zmq.Context()
    directory = tempfile.mkdtemp(prefix="mcpd-w-", dir="/tmp")
    pairs = []
    for name in ("a", "b"):
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.setsockopt(zmq.LINGER, 0)
        pull.bind(f"ipc://{directory}/{name}")
        push.connect(f"ipc://{directory}/{name}")
        push.send(b"hello")   # connected: no command of the connection's setup is still on its way
        assert pull.recv() == b"hello" and taken(pull) == []
        pairs.append((pull, push))
    yield pairs
    context.destroy(linger=0)
    for name in os.listdir(directory):
        os.unlink(f"{directory}/{name}")
    os.rmdir(directory)


def taken(sock: zmq.Socket) -> list[list[bytes]]:
    found = []
    drain(sock, found.append)
    return found


def test_ready_names_only_the_socket_a_message_reached(pulls):
    (a, push_a), (b, push_b) = pulls
    waiter = Waiter(a, b)
    assert waiter.ready(0) == []
    push_b.send(b"to b")
    assert waiter.ready(LONG_MS) == [b]
    assert taken(b) == [[b"to b"]]
    push_a.send(b"to a")
    assert waiter.ready(LONG_MS) == [a]
    assert taken(a) == [[b"to a"]] and taken(b) == []
    assert waiter.ready(0) == []


def test_a_message_left_unread_is_named_again_without_waiting(pulls):
    """Its command was taken by the first ask, so its descriptor stays quiet: EVENTS says it."""
    (a, push_a), (b, _) = pulls
    waiter = Waiter(a, b)
    push_a.send(b"left")
    assert waiter.ready(LONG_MS) == [a]
    assert waiter.ready(0) == [a]
    assert waiter.wait(0)
    assert taken(a) == [[b"left"]]
    assert not waiter.wait(0)


def test_a_watched_descriptor_is_named_when_readable_and_none_once_the_time_passed(pulls):
    (a, _), (b, _) = pulls
    waiter = Waiter(a, b)
    read_end, write_end = os.pipe()
    try:
        waiter.watch(read_end)
        assert waiter.ready(10) == []
        os.write(write_end, b"x")
        assert waiter.ready(LONG_MS) == [read_end]
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.fixture
def events_asked(monkeypatch):
    """How many times each socket was asked EVENTS (the real ask, counted on its way through)."""
    counts = {}
    real = sockets._get

    def counted(sock, option):
        if option == sockets.EVENTS:
            counts[sock] = counts.get(sock, 0) + 1
        return real(sock, option)
    monkeypatch.setattr(sockets, "_get", counted)
    return counts


def test_a_socket_the_waiter_emptied_is_not_asked_again_and_still_wakes_it(pulls, events_asked):
    (a, push_a), (b, _) = pulls
    waiter = Waiter(a, b)
    push_a.send(b"first")
    assert waiter.ready(LONG_MS) == [a]
    found = []
    assert waiter.drain(a, found.append) == 1 and found == [[b"first"]]
    events_asked.clear()
    assert waiter.ready(0) == []
    assert events_asked == {b: 1}   # a is quiet: its descriptor alone is polled
    push_a.send(b"second")
    assert waiter.ready(LONG_MS) == [a]
    assert taken(a) == [[b"second"]]


def test_a_send_on_a_quiet_socket_makes_the_waiter_ask_it_again(events_asked):
    """A send processes the socket's commands, and may take the one a message's arrival left on its
    descriptor: only EVENTS can say that message is there."""
    context = zmq.Context()
    directory = tempfile.mkdtemp(prefix="mcpd-w-", dir="/tmp")
    try:
        mine, peer = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        mine.bind(f"ipc://{directory}/pair")
        peer.connect(f"ipc://{directory}/pair")
        waiter = Waiter(mine)
        peer.send(b"hello")
        assert mine.recv() == b"hello"   # connected: no command of the connection's setup is still on its way
        assert waiter.drain(mine, [].append) == 0 and mine in waiter.quiet
        peer.send(b"meanwhile")
        waiter.send_frames(mine, [b"to the peer"])
        assert peer.recv() == b"to the peer"
        events_asked.clear()
        assert waiter.ready(LONG_MS) == [mine]
        assert events_asked == {mine: 1}
        assert taken(mine) == [[b"meanwhile"]]
    finally:
        context.destroy(linger=0)
        for name in os.listdir(directory):
            os.unlink(f"{directory}/{name}")
        os.rmdir(directory)


def test_a_quiet_socket_with_a_message_is_named_beside_a_busy_one(pulls):
    """A loop that takes the named sockets only would otherwise leave the quiet one waiting for as
    long as the other has messages."""
    (a, push_a), (b, push_b) = pulls
    waiter = Waiter(a, b)
    waiter.drain(a, [].append)
    push_a.send(b"to a")
    push_b.send(b"to b")
    for sock in (a, b):   # both arrived: their descriptors say so (asking EVENTS would take a's command)
        assert select.select([sock.getsockopt(zmq.FD)], [], [], LONG_MS / 1000)[0]
    assert waiter.ready(LONG_MS) == [b, a]
    assert taken(a) == [[b"to a"]] and taken(b) == [[b"to b"]]


def test_a_socket_added_later_wakes_the_waiter_and_is_quiet_once_emptied(pulls, events_asked):
    """The scheduler adds the cluster's wake-up socket to the waiter its sockets made."""
    (a, _), (b, push_b) = pulls
    waiter = Waiter(a)
    waiter.add(b)
    push_b.send(b"to b")
    assert waiter.ready(LONG_MS) == [b]
    assert waiter.drain(b, [].append) == 1 and b in waiter.quiet
    waiter.drain(a, [].append)
    events_asked.clear()
    assert waiter.ready(0) == [] and events_asked == {}   # both quiet: their descriptors alone are polled
    push_b.send(b"again")
    assert waiter.ready(LONG_MS) == [b]
