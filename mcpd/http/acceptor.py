"""The HTTP listener's listening socket and its accepts, owned here rather than by the event loop.

uvloop's server, when an accept fails for want of descriptors (EMFILE, ENFILE), either accepts and
drops every waiting connection (libuv's reserved-descriptor trick: legitimate clients reset) or,
once that descriptor is gone too, closes the listening server for good. Owning the accept, such a
failure stops accepting for PAUSE_S and leaves the waiting connections in the kernel's backlog,
as asyncio's own loop does. Each accepted connection goes to `on_accepted`, which decides whether
it is served (connections.py).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Callable

PAUSE_S = 1.0   # asyncio's own pause after such a failure
# A network error of a connection that ended while it waited (accept(2) on Linux): try the next.
ENDED_WHILE_WAITING = frozenset((errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
                                 errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                                 errno.ENETUNREACH, errno.EINTR))
BACKLOG = 1024   # the kernel queues this many before a client's connect waits on SYN retries
# Accepts per wake: then the loop runs, serving others and closing the connections shed for these.
ACCEPTS_PER_WAKE = 64


class Acceptor:
    def __init__(self, sock: socket.socket, on_accepted: Callable[[socket.socket, str], None],
                 log: logging.Logger):
        sock.setblocking(False)
        sock.listen(BACKLOG)
        self.sock, self.on_accepted, self.log = sock, on_accepted, log
        self.loop = asyncio.get_running_loop()
        self.resume: asyncio.TimerHandle | None = None
        self.pauses = 0   # accepts stopped for PAUSE_S since start

    def start(self) -> None:
        self.resume = None
        self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self.resume is not None:
            self.resume.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, peer = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in ENDED_WHILE_WAITING:
                    continue
                self._pause(e)   # no descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): retrying spins
                return
            self.on_accepted(conn, peer[0])

    def _pause(self, error: OSError) -> None:
        if not self.pauses:
            self.log.warning("HTTP accepts paused for %.0f s: %s (the front-end's descriptor limit?)", PAUSE_S,
                             error.strerror)
        self.pauses += 1
        self.loop.remove_reader(self.sock.fileno())
        self.resume = self.loop.call_later(PAUSE_S, self.start)
