"""How many TCP connections one address may hold open to the front-end (limits.
max_connections_per_address). Without a cap, one client opening connections and never closing
them would take the front-end's descriptors (systemd's default soft limit is 1,024; our unit sets
65,536): every other client would then wait until they closed (bench/redteam.py connection_flood
plays it). And
connections are what a client that takes libzmq's next routing ids for its own needs many of
(sockets.router). A connection past the cap is cut as soon as its accept is reported, before it
is served; the ipc endpoint is not capped (its peers are local users the kernel names). One count
per address covers both the ZeroMQ endpoint and the HTTP listener (mcpd/http/connections.py), as a
setting named per address promises."""
from __future__ import annotations

import ipaddress
import logging
from collections import Counter

from mcpd.daemon.frontend import descriptor


class AddressCap:
    def __init__(self, limit: int, log: logging.Logger):
        self.limit, self.log = limit, log
        self.address_of: dict[int, str] = {}   # descriptor -> its peer's address, while counted
        self.held: Counter[str] = Counter()
        self.cutting: set[str] = set()         # addresses cut since they last held fewer: logged once
        self.cut = 0                           # connections cut since start

    def accepted(self, fd: int, endpoint: bytes) -> None:
        """A connection on fd was accepted; cut it if its address holds `limit` already."""
        if not endpoint.startswith(b"tcp://"):
            return
        address = descriptor.peer_host(fd)
        if address is None:
            return   # closed already
        if self.admits(address):
            self.address_of[fd] = address
        else:
            descriptor.shut_down(fd)

    def disconnected(self, fd: int) -> None:
        address = self.address_of.pop(fd, None)
        if address is not None:
            self.released(address)

    def admits(self, address: str) -> bool:
        """Count a new connection from address, or refuse it (False) when the address holds `limit`."""
        address = host_of(address)
        if self.held[address] < self.limit:
            self.held[address] += 1
            return True
        if address not in self.cutting:
            self.cutting.add(address)
            self.log.warning("cutting new connections from %s: it holds limits.max_connections_per_address (%d)",
                             address, self.limit)
        self.cut += 1
        return False

    def released(self, address: str) -> None:
        """A connection admits() counted has closed."""
        address = host_of(address)
        self.held[address] -= 1
        self.cutting.discard(address)
        if not self.held[address]:
            del self.held[address]

    def stats(self) -> dict:
        return {"addresses": len(self.held), "cut_over_address_cap": self.cut}


def host_of(address: str) -> str:
    """The one name of a host: an IPv4 client that reaches a socket open to IPv6 as well comes as
    ::ffff:127.0.0.1, and must share its count with the same client reaching an IPv4 socket."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped else str(ip)
