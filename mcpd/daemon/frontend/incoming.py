"""What clients have begun to send and libzmq holds until their last frame: bounded.

libzmq delivers a multipart message only once its last frame has arrived, and keeps every frame
before that in memory. ZMQ_MAXMSGSIZE caps one frame, but nothing caps the frames of a message,
nor how many connections may be half-way through one: a peer trickling one huge message, or many
peers each beginning one and never ending it, made the front-end hold gigabytes before any check
could see a byte. No socket option reaches into libzmq's pipes, so this watches from
outside, per TCP connection: the kernel counts the bytes received (TCP_INFO tcpi_bytes_received)
and those still unread in its buffer (FIONREAD); the front-end counts the bytes of the messages
delivered on it (each message names its descriptor, ZMQ_SRCFD). What is left is held by libzmq
for messages not delivered yet.

- A connection holding more than a whole request may carry (limits.max_message_bytes) is sending
  a message that would be refused anyway: it is cut. shutdown(2) on libzmq's descriptor makes
  libzmq see the connection end, drop the partial message and free it, as when a frame exceeds
  ZMQ_MAXMSGSIZE; the client's own libzmq reconnects.
- All connections together may hold limits.max_incoming_bytes; past that, those holding most are
  cut until the rest fit.

A scan costs a few system calls per connection, so it runs when the process grew by SCAN_GROWTH
bytes since the last one (a fast sender), and at least every SCAN_S (a slow one).

Not covered: the ipc endpoint (no such counters for Unix sockets; its peers are local users the
kernel names, `uid:<n>`), and the bytes of a message begun in the moment between a connection's
accept and the front-end hearing of it. A client's ZMTP heartbeats (off unless it asks) count as
held, about ten bytes each: months before they matter.
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from dataclasses import dataclass

from mcpd.daemon.frontend import descriptor

SCAN_S = 0.5
SCAN_GROWTH = 8 << 20
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
    process kept the peak of every half-sent message (16 slow senders: 75 MiB where 40 were held)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:
        pass   # not glibc: its allocator decides


@dataclass
class Connection:
    counted_from: int     # bytes received before we heard of the connection (not ours to judge)
    delivered: int = 0    # wire bytes of the messages delivered on it since


class IncomingBytes:
    def __init__(self, per_connection: int, total: int, curve: bool, log: logging.Logger):
        self.per_connection, self.total, self.curve, self.log = per_connection, total, curve, log
        self.connections: dict[int, Connection] = {}
        self.cut = 0   # connections cut since start
        self.statm = os.open("/proc/self/statm", os.O_RDONLY)   # read every GUARD_S: one pread
        self.last_scan, self.rss_at_scan = 0.0, self._rss()

    def accepted(self, fd: int, endpoint: bytes) -> None:
        if not endpoint.startswith(b"tcp://"):
            return
        counters = _counters(fd)
        if counters is not None:
            received, unread = counters
            self.connections[fd] = Connection(received - unread)

    def disconnected(self, fd: int) -> None:
        self.connections.pop(fd, None)

    def delivered(self, fd: int, frame_sizes: list[int]) -> None:
        connection = self.connections.get(fd)
        if connection is not None:
            connection.delivered += sum(self._wire_bytes(size) for size in frame_sizes)

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
        held = {fd: self._held(fd, connection) for fd, connection in self.connections.items()}
        for fd in [fd for fd, nbytes in held.items() if nbytes > self.per_connection + SLACK]:
            self._cut(fd, held.pop(fd), f"more than limits.max_message_bytes ({self.per_connection})")
        for fd in sorted(held, key=held.get, reverse=True):
            if sum(held.values()) <= self.total:
                break
            self._cut(fd, held.pop(fd), f"all connections over limits.max_incoming_bytes ({self.total})")

    def stats(self) -> dict:
        return {"connections": len(self.connections), "cut": self.cut}

    def _held(self, fd: int, connection: Connection) -> int:
        counters = _counters(fd)
        if counters is None:
            return 0
        received, unread = counters
        return max(0, received - unread - connection.counted_from - connection.delivered)

    def _cut(self, fd: int, nbytes: int, why: str) -> None:
        self.log.warning("cut a client connection holding %d bytes of unfinished messages: %s", nbytes, why)
        self.cut += 1
        del self.connections[fd]   # its disconnect report follows
        descriptor.shut_down(fd)

    def _rss(self) -> int:
        return int(os.pread(self.statm, 128, 0).split()[1]) * PAGE_BYTES

    def _wire_bytes(self, size: int) -> int:
        """A frame's bytes on the wire: its ZMTP header (1 flags byte, 1 or 8 size bytes), inside
        a CURVE MESSAGE command when CURVE is on."""
        if self.curve:
            size += CURVE_MESSAGE_BYTES
        return size + (2 if size <= 255 else 9)


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

