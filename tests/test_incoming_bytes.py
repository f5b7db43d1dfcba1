"""The front-end's watch on unfinished messages (incoming.py), in-process on real sockets."""
import logging
import os
import resource
import socket

import pytest

from mcpd.daemon.frontend.incoming import IncomingBytes


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
