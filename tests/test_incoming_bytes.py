"""The front-end's watch on unfinished messages (incoming.py), in-process on real sockets."""
import logging
import os
import resource
import socket

import pytest

from mcpd.daemon.frontend.incoming import HANDSHAKE_BYTES, SLACK, IncomingBytes


def closed_descriptor() -> int:
    """A descriptor number nothing holds: the highest this process may have (descriptors are
    given lowest first, so no thread of an earlier test takes it meanwhile)."""
    fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
    with pytest.raises(OSError):
        os.fstat(fd)
    return fd


def test_an_accept_reported_after_the_connection_closed_is_noted_without_raising():
    """The monitor reports an accept after the connection may have ended. Raising there (Python's
    socket() checks the descriptor: EBADF) lost the client message whose reading drained the
    reports (seen with the front-end out of descriptors)."""
    incoming = IncomingBytes(1 << 20, 1 << 24, False, logging.getLogger("test"))
    fd = closed_descriptor()
    incoming.accepted(fd, b"tcp://127.0.0.1:1")
    assert fd not in incoming.connections
    incoming.disconnected(fd)


def test_an_open_connection_is_watched():
    incoming = IncomingBytes(1 << 20, 1 << 24, False, logging.getLogger("test"))
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        incoming.accepted(server.fileno(), b"tcp://127.0.0.1:1")
        assert server.fileno() in incoming.connections
    finally:
        for sock in (client, server, listener):
            sock.close()


LIMIT = 1 << 20


class Connection:
    """A loopback TCP connection whose server end this process reads as libzmq would: what it
    has read and not delivered is what the watch counts as held."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(self.listener.getsockname())
        self.server, _ = self.listener.accept()
        self.fd = self.server.fileno()

    def carry(self, nbytes: int, unread: int = 0) -> None:
        """`nbytes` sent and read; `unread` more sent and left in the kernel (bytes arriving)."""
        self.client.sendall(b"x" * (nbytes + unread))
        got = 0
        while got < nbytes:
            got += len(self.server.recv(nbytes - got))

    def cut(self) -> bool:
        """Whether the server end was shut down (the client reads the end of the stream)."""
        self.client.settimeout(5)
        return self.client.recv(1 << 20) == b""

    def close(self) -> None:
        for sock in (self.client, self.server, self.listener):
            sock.close()


@pytest.fixture
def connection():
    made = Connection()
    yield made
    made.close()


def watch(connection: Connection) -> IncomingBytes:
    incoming = IncomingBytes(LIMIT, 1 << 30, False, logging.getLogger("test"))
    incoming.accepted(connection.fd, b"tcp://127.0.0.1:1")
    return incoming


def nothing() -> None:
    """A before_scan with no complete message to take."""


def test_a_connection_past_the_limit_is_cut_at_the_first_look_after_its_bytes_arrive(connection):
    incoming = watch(connection)
    connection.carry(LIMIT + SLACK + 1, unread=1)
    incoming.look(before_scan=nothing)
    assert incoming.cut == 1 and connection.fd not in incoming.connections
    assert connection.cut()


def test_a_connection_under_way_is_looked_at_again_though_its_next_bytes_were_read_unreported(connection):
    """libzmq reads what arrives at once, often before the loop's look: the kernel then reports
    nothing, and only the connection's being under way gets it looked at."""
    incoming = watch(connection)
    connection.carry(SLACK + 1, unread=1)
    incoming.look(before_scan=nothing)
    assert incoming.under_way == {connection.fd} and incoming.cut == 0
    connection.carry(LIMIT + 1)
    incoming.look(before_scan=nothing)
    assert incoming.cut == 1 and incoming.under_way == set()
    assert connection.cut()


def test_complete_messages_taken_before_the_cut_are_not_held(connection):
    """Past the limit, the loop first takes every complete message libzmq has (before_scan):
    a client sending fast is not cut for the messages the front-end had not read yet."""
    incoming = watch(connection)
    sizes = [LIMIT // 2 - 9] * 3   # three frames with their 9-byte headers: 1.5 MiB on the wire
    connection.carry(sum(size + 9 for size in sizes), unread=1)
    incoming.look(before_scan=lambda: incoming.delivered(connection.fd, sizes))
    assert incoming.cut == 0 and incoming.under_way == set()


def test_bytes_read_before_the_accept_was_reported_count(connection):
    """libzmq reads a connection before the front-end hears of its accept; those bytes are held too."""
    connection.carry(LIMIT + SLACK + 1)
    incoming = watch(connection)
    incoming.check(before_scan=nothing)
    assert incoming.cut == 1
    assert connection.cut()


def test_bytes_received_and_not_taken_are_waiting_beyond_what_no_message_accounts_for(connection):
    """socket_backlog.py's count: a connection's requests received (read by "libzmq" or still in
    the kernel) and not yet delivered, less its handshake or heartbeats, which a settle measures
    once everything whole was taken."""
    incoming = watch(connection)
    connection.carry(HANDSHAKE_BYTES)   # fewer than that unaccounted for: not counted before a settle
    incoming.delivered(connection.fd, [7])   # a 7-byte request taken (9 bytes on the wire)
    assert incoming.taken == 9 and incoming.waiting() == 0
    incoming.delivered(connection.fd, [7])
    incoming.settle()   # all whole messages taken: the rest is the handshake and the like
    connection.carry(900, unread=100)   # 1,000 bytes of requests arrive
    incoming.delivered(connection.fd, [91])   # one 93-byte request taken of them
    assert incoming.waiting() == 1000 - 93
    assert incoming.waiting() == 0   # only connections delivered on since the last call are asked
