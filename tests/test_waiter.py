"""sockets.Waiter over real ZeroMQ sockets on ipc (each message crosses both I/O threads): it names
the sockets that hold a message and the watched descriptors that are readable, and nothing else."""
import os
import tempfile

import pytest
import zmq

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
