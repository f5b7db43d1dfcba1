"""What clients have begun to send and libzmq holds until their last frame: bounded.

libzmq delivers a multipart message only once its last frame has arrived, and keeps every frame
before that in memory. ZMQ_MAXMSGSIZE caps one frame, but nothing caps the frames of a message,
nor how many connections may be half-way through one: a peer trickling one huge message, or many
peers each beginning one and never ending it, made the front-end hold gigabytes before any check
could see a byte. No socket option reaches into libzmq's pipes, so this watches from
outside, per TCP connection: the kernel counts the bytes received (TCP_INFO tcpi_bytes_received)
and those still unread in its buffer (FIONREAD); the front-end counts the bytes of the messages
delivered on it (each message names its descriptor, ZMQ_SRCFD). What is left is held by libzmq
for messages not delivered yet. A connection is counted from its first byte (its handshake is
well under SLACK), so what libzmq read before the front-end heard of the accept counts too.

- A connection holding more than a whole request may carry (limits.max_message_bytes) is sending
  a message that would be refused anyway: it is cut. shutdown(2) on libzmq's descriptor makes
  libzmq see the connection end, drop the partial message and free it, as when a frame exceeds
  ZMQ_MAXMSGSIZE; the client's own libzmq reconnects.
- All connections together may hold limits.max_incoming_bytes; past that, those holding most are
  cut until the rest fit.

libzmq's I/O thread reads as fast as the peer sends, whatever the front-end's loop is doing, so
a check on a timer lets a fast sender past the limit by whatever arrives between two checks
(tens of MiB at loopback speed). The first rule is therefore checked as bytes arrive: an
edge-triggered epoll over libzmq's TCP descriptors (`arrivals`) wakes the loop when any of them
receives, and those are looked at. The kernel reports an arrival only while its bytes are still
unread, and libzmq may read them first, so a connection found part-way through a message (more
than SLACK held) is looked at again every LOOK_S until it finishes or is cut, arrivals reported
or not. After each look the loop stops listening for LOOK_S, so that small requests cost one
look per LOOK_S, not one each. Nothing makes libzmq wait for a look, so a sender still gets past
the limit by what libzmq reads between two (about LOOK_S once it is part-way, and the pause
before); one whose first arrivals all go unseen is left to the scan below.

The scan applies both rules to every connection, a few system calls each, so it runs when the
process grew by SCAN_GROWTH bytes since the last one (a fast sender), and at least every SCAN_S
(a slow one).

Not covered: the ipc endpoint (no such counters for Unix sockets; its peers are local users the
kernel names, `uid:<n>`). A client's ZMTP heartbeats (off unless it asks) count as held, about
ten bytes each: months before they matter.
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import os
import select
import socket
import struct
import termios
import time
from dataclasses import dataclass

from mcpd.daemon.frontend import descriptor

SCAN_S = 0.5
SCAN_GROWTH = 8 << 20
LOOK_S = 0.002
HANDSHAKE_BYTES = 1024   # a connection's ZMTP greeting and handshake (about 100 bytes; CURVE's about 600)
SLACK = 64 << 10   # handshake and frame headers: a connection may hold a whole request and this
TCPI_BYTES_RECEIVED = 128      # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)
TCP_INFO_BYTES = TCPI_BYTES_RECEIVED + 8
CURVE_MESSAGE_BYTES = 33       # a CURVE MESSAGE command adds its name, nonce, flags and MAC per frame
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def give_large_buffers_back() -> None:
    """Make glibc map every buffer of a MiB or more on its own, and unmap it when freed. By default
    the threshold rises to the largest buffer freed so far (up to 32 MiB), after which frame
    buffers come from the heap, and a cut connection's frames stay resident once freed: the
    process would keep the peak of every half-sent message."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:
        pass   # not glibc: its allocator decides


@dataclass
class Connection:
    delivered: int = 0    # wire bytes of the messages delivered on it
    # Received bytes no message delivered accounts for (its handshake, heartbeats, a message under
    # way), as of the last time the front-end had taken all it could of it: not waiting to be read.
    unmatched: int = HANDSHAKE_BYTES


class IncomingBytes:
    def __init__(self, per_connection: int, total: int, curve: bool, log: logging.Logger):
        self.per_connection, self.total, self.curve, self.log = per_connection, total, curve, log
        self.connections: dict[int, Connection] = {}
        self.arrivals = select.epoll()   # readable when a watched connection received bytes
        self.under_way: set[int] = set()   # connections part-way through a message at the last look
        self.cut = 0   # connections cut since start
        self.taken = 0   # wire bytes of the messages delivered on all of them (socket_backlog.py)
        self.recent: set[int] = set()   # connections delivered on since the last waiting() or settle()
        self.statm = os.open("/proc/self/statm", os.O_RDONLY)   # read every GUARD_S: one pread
        self.last_scan, self.rss_at_scan = 0.0, self._rss()

    def accepted(self, fd: int, endpoint: bytes) -> None:
        if not endpoint.startswith(b"tcp://"):
            return
        try:
            self.arrivals.register(fd, select.EPOLLIN | select.EPOLLET)
        except OSError:
            return   # closed already: its disconnect report follows
        self.connections[fd] = Connection()

    def disconnected(self, fd: int) -> None:
        self.under_way.discard(fd)
        if self.connections.pop(fd, None) is not None:
            try:
                self.arrivals.unregister(fd)
            except OSError:
                pass   # closed: the kernel has unregistered it (a descriptor reused since is not registered yet)

    def delivered(self, fd: int, frame_sizes: list[int]) -> None:
        connection = self.connections.get(fd)
        if connection is not None:
            nbytes = self._wire_bytes(frame_sizes)
            connection.delivered += nbytes
            self.taken += nbytes
            self.recent.add(fd)

    def waiting(self) -> int:
        """Bytes of requests the connections delivered on since the last call (or settle) received
        and the front-end has not taken yet (in the kernel's buffer or libzmq's pipe): one with a
        backlog is among them, as libzmq takes from every connection with a message in turn."""
        total = 0
        for connection, received in self._recent_received():
            total += max(0, received - connection.delivered - connection.unmatched)
        return total

    def settle(self) -> None:
        """The client socket was found empty: every whole message of the connections delivered on
        since the last call (or waiting) has been taken, so what they received beyond is not a request."""
        for connection, received in self._recent_received():
            connection.unmatched = received - connection.delivered

    def _recent_received(self) -> list[tuple[Connection, int]]:
        found = [(self.connections[fd], _received(fd)) for fd in self.recent if fd in self.connections]
        self.recent.clear()
        return [(connection, received) for connection, received in found if received is not None]

    def look(self, before_scan) -> None:
        """Apply the first rule to the connections reported receiving since the last look and to
        those under way then (see the module's doc); `under_way` says which are now."""
        fds = self.under_way.union(fd for fd, _ in self.arrivals.poll(0))
        held = self._held_of(fds)
        if any(nbytes > self.per_connection + SLACK for nbytes in held.values()):
            before_scan()   # takes every complete message: what libzmq still holds is unfinished
            held = self._held_of(fds)
            self._cut_over_message_limit(held)
        self.under_way = {fd for fd, nbytes in held.items() if nbytes > SLACK}

    def check(self, before_scan) -> None:
        """Cut whatever connections hold too much (see the module's doc); cheap unless it scans.
        `before_scan()` takes every complete message libzmq has, so what it still holds then is
        only what is unfinished."""
        now, rss = time.monotonic(), self._rss()
        self.rss_at_scan = min(self.rss_at_scan, rss)   # follow the process down as memory is freed
        if rss - self.rss_at_scan < SCAN_GROWTH and now - self.last_scan < SCAN_S:
            return
        before_scan()
        self.last_scan, self.rss_at_scan = now, rss
        held = self._held_of(self.connections)
        self._cut_over_message_limit(held)
        self.under_way.update(fd for fd, nbytes in held.items() if nbytes > SLACK)
        for fd in sorted(held, key=held.get, reverse=True):
            if sum(held.values()) <= self.total:
                break
            self._cut(fd, held.pop(fd), f"all connections over limits.max_incoming_bytes ({self.total})")

    def stats(self) -> dict:
        return {"connections": len(self.connections), "cut": self.cut}

    def _held_of(self, fds) -> dict[int, int]:
        """What libzmq holds of each connection still watched (a pump before may have ended some)."""
        return {fd: self._held(fd, self.connections[fd]) for fd in list(fds) if fd in self.connections}

    def _cut_over_message_limit(self, held: dict[int, int]) -> None:
        """Cut the connections in `held` past the first rule, and leave the rest in it."""
        for fd in [fd for fd, nbytes in held.items() if nbytes > self.per_connection + SLACK]:
            self._cut(fd, held.pop(fd), f"more than limits.max_message_bytes ({self.per_connection})")

    def _held(self, fd: int, connection: Connection) -> int:
        counters = _counters(fd)
        if counters is None:
            return 0
        received, unread = counters
        return max(0, received - unread - connection.delivered)

    def _cut(self, fd: int, nbytes: int, why: str) -> None:
        self.log.warning("cut a client connection holding %d bytes of unfinished messages: %s", nbytes, why)
        self.cut += 1
        self.disconnected(fd)   # libzmq's disconnect report follows
        descriptor.shut_down(fd)

    def _rss(self) -> int:
        return int(os.pread(self.statm, 128, 0).split()[1]) * PAGE_BYTES

    def _wire_bytes(self, frame_sizes: list[int]) -> int:
        """The frames' bytes on the wire: each with its ZMTP header (1 flags byte, 1 or 8 size
        bytes), inside a CURVE MESSAGE command when CURVE is on. One loop, no call per frame:
        it runs for every message a client sends."""
        wrapping = CURVE_MESSAGE_BYTES if self.curve else 0
        total = 0
        for size in frame_sizes:
            size += wrapping
            total += size + (2 if size <= 255 else 9)
        return total


_LIBC = ctypes.CDLL(None, use_errno=True)
_TCP_INFO = ctypes.create_string_buffer(TCP_INFO_BYTES)
_TCP_INFO_LENGTH = ctypes.c_uint32()


def _received(fd: int) -> int | None:
    """Bytes the kernel received on this TCP socket; None when it is closed or the kernel does not
    count them. getsockopt(2) straight on the descriptor: a look runs it for every connection read
    from, while the front-end is busiest, and a Python socket around it costs more than the call."""
    _TCP_INFO_LENGTH.value = TCP_INFO_BYTES
    if _LIBC.getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO, ctypes.byref(_TCP_INFO_LENGTH)) != 0:
        return None
    if _TCP_INFO_LENGTH.value < TCP_INFO_BYTES:
        return None   # a kernel older than 4.1 does not count received bytes
    return struct.unpack_from("=Q", _TCP_INFO, TCPI_BYTES_RECEIVED)[0]


def _counters(fd: int) -> tuple[int, int] | None:
    """(bytes the kernel received on this TCP socket, bytes of them not read yet), or None."""
    sock = descriptor.wrap(fd)
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        unread = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, unread)
    except OSError:
        return None   # closed meanwhile
    finally:
        sock.detach()
    if len(info) < TCP_INFO_BYTES:
        return None   # a kernel older than 4.1 does not count received bytes
    return struct.unpack_from("=Q", info, TCPI_BYTES_RECEIVED)[0], unread[0]

