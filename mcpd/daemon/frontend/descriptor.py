"""libzmq's TCP connection descriptors, handled from Python: the front-end learns them from
ZMQ_SRCFD and the monitor's reports, never owns them (libzmq closes them), and must expect any
of them to be closed by the time it looks: the monitor reports an accept after the connection
may have ended.
"""
from __future__ import annotations

import socket


def wrap(fd: int) -> socket.socket | None:
    """The descriptor as a Python socket (detach() it after: it stays libzmq's); None when it is
    closed already (Python checks it: EBADF would leave the loop and lose the client message
    whose reading had drained the reports). Its family is the descriptor's own: an IPv6
    connection's address read as IPv4 comes out as other bytes each time."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def shut_down(fd: int) -> None:
    """End the connection: libzmq sees it end, drops what it held of it and closes the descriptor,
    as when a frame exceeds ZMQ_MAXMSGSIZE; the client's own libzmq reconnects."""
    sock = wrap(fd)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # it closed meanwhile
    finally:
        sock.detach()


def peer_host(fd: int) -> str | None:
    """The address of the connection's other end (IPv4 or IPv6, no port); None when closed, or
    when it is no TCP connection (a unix socket's peer has no address)."""
    sock = wrap(fd)
    if sock is None:
        return None
    try:
        peer = sock.getpeername()
        return peer[0] if isinstance(peer, tuple) else None
    except OSError:
        return None
    finally:
        sock.detach()
