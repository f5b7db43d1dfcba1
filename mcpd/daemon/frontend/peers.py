"""Which connection each client (ZeroMQ routing id) speaks through, so that when a connection
closes the front-end can cancel that client's work instead of running it for nobody.

libzmq's own disconnect notice (ZMQ_ROUTER_NOTIFY) is a draft API the shipped libzmq lacks, so:
every message tells the file descriptor it came through (ZMQ_SRCFD), and the ROUTER's monitor
reports when a descriptor is disconnected. Descriptors are reused, so two cases need care:
- a client with a fixed routing id that reconnects speaks through a new descriptor; the old one's
  disconnect then concerns nobody (its owner has moved on);
- a closed descriptor can carry a new client before the monitor's report of the close is read;
  the old owner is gone then and there, and the late report must not touch the new owner.
"""
from __future__ import annotations


class PeerTracker:
    def __init__(self):
        self.owner: dict[int, bytes] = {}    # descriptor -> the routing id last seen on it
        self.fd_of: dict[bytes, int] = {}    # routing id -> its current descriptor
        self.late: dict[int, int] = {}       # descriptor -> disconnect reports that concern no one now

    def seen(self, identity: bytes, fd: int) -> bytes | None:
        """Note a message; returns a routing id this shows to be gone, if any."""
        if self.fd_of.get(identity) == fd:
            return None
        previous = self.owner.get(fd)
        gone = None
        if previous is not None and previous != identity:   # fd closed and reused: report pending
            self.late[fd] = self.late.get(fd, 0) + 1
            gone = self._release(previous, fd)
        self.owner[fd], self.fd_of[identity] = identity, fd
        return gone

    def disconnected(self, fd: int) -> bytes | None:
        """The monitor reported fd closed; returns the routing id that went with it, if any."""
        if self.late.get(fd):
            self.late[fd] -= 1
            return None
        previous = self.owner.pop(fd, None)
        return None if previous is None else self._release(previous, fd)

    def _release(self, identity: bytes, fd: int) -> bytes | None:
        if self.fd_of.get(identity) != fd:
            return None   # it reconnected through another descriptor: still here
        del self.fd_of[identity]
        return identity
