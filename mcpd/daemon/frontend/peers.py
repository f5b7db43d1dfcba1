"""Which connection each client (ZeroMQ routing id) speaks through, so that when a connection
closes the front-end can cancel that client's work instead of running it for nobody.

libzmq's own disconnect notice (ZMQ_ROUTER_NOTIFY) is a draft API the shipped libzmq lacks, so:
every message tells the file descriptor it came through (ZMQ_SRCFD), and the ROUTER's monitor
reports, in order, each descriptor's accepts and disconnects. Descriptors are reused, and the
monitor is a socket of its own, read apart from the clients' messages: a report of a close may
be read after the next client on that descriptor has spoken. So a connection is named by its
descriptor and its generation (how many accepts on that descriptor the monitor has reported),
and a client is filed under the connection it speaks through only after every report waiting
then has been read (`knows` says when the front-end must read them first). libzmq's I/O thread
reports an accept before the connection carries a byte, so the client's own accept has been read
by then: the descriptor's latest generation is the client's connection, or a later one when the
client's closed and the descriptor went to another before its message was read. A report ends
the clients filed under its connection, never a live client on a later one (a connection that
never spoke and closed must not cost the next client on its descriptor its request).

- A client whose connection closed before its message was read is gone already: `seen` says so.
- A client with a fixed routing id that reconnects is filed under its new connection; the old
  one's close then concerns nobody.
- A connection libzmq ends itself (a routing id already in use) is not reported closed; the next
  accept on its descriptor ends its clients.
"""
from __future__ import annotations

Connection = tuple[int, int]   # (descriptor, generation)


class PeerTracker:
    def __init__(self):
        self.generation: dict[int, int] = {}             # descriptor -> accepts reported on it
        self.open: set[int] = set()                      # descriptors whose latest connection is open
        self.connection_of: dict[bytes, Connection] = {}
        self.clients: dict[Connection, dict[bytes, None]] = {}   # insertion-ordered: cancels in order

    def knows(self, identity: bytes, fd: int) -> bool:
        """Whether a message tells nothing new: false for a client not filed under this descriptor
        yet, and for a fixed routing id (it may have reconnected through the same descriptor
        number); then read the monitor's reports before `seen`. Routing ids libzmq makes (a zero
        byte first) name one connection for good. A client may set such an id itself (libzmq
        accepts it: sockets.router), and then misleads the tracker about its own work only."""
        filed = self.connection_of.get(identity)
        return filed is not None and filed[0] == fd and identity[:1] == b"\0"

    def seen(self, identity: bytes, fd: int) -> bool:
        """File a client under the connection its message came through; False when that
        connection has closed already (nobody will read a reply)."""
        latest = (fd, self.generation.get(fd, 0))
        filed = self.connection_of.get(identity)
        if filed != latest:
            if filed is not None:
                del self.clients[filed][identity]
            self.connection_of[identity] = latest
            self.clients.setdefault(latest, {})[identity] = None
        if latest[1] and fd not in self.open:   # no generation: the monitor never saw it; keep it
            self._end(latest)
            return False
        return True

    def accepted(self, fd: int) -> list[bytes]:
        """A new connection on fd; returns the clients of one before it that was never reported
        closed (see the module's doc)."""
        gone = self._end((fd, self.generation.get(fd, 0)))
        self.generation[fd] = self.generation.get(fd, 0) + 1
        self.open.add(fd)
        return gone

    def disconnected(self, fd: int) -> list[bytes]:
        """The monitor reported fd's latest connection closed; returns the clients it carried."""
        self.open.discard(fd)
        return self._end((fd, self.generation.get(fd, 0)))

    def _end(self, connection: Connection) -> list[bytes]:
        gone = list(self.clients.pop(connection, ()))
        for identity in gone:
            del self.connection_of[identity]
        return gone
