"""Where mcpd's sockets live and how every process reads them: the ipc endpoint names in the
runtime directory, binding one with an exact mode, and draining a socket without blocking.

Neutral ground: the daemon's processes, the security gate, `mcpctl` and tests all use these, so
they sit outside mcpd.daemon (whose channels.py adds the internal message tags on top).
"""
from __future__ import annotations

import ctypes
import math
import os
import select
from pathlib import Path

import zmq

CLIENT_IPC = "client.ipc"      # clients (the front-end's ROUTER)
CONTROL_IPC = "control.ipc"    # mcpctl (the supervisor's ROUTER)
# The internal ones (daemon/channels.py draws who talks to whom on each).
EVENTS_IPC, SCHED_IPC, FRONTEND_IPC, WORKERS_IPC = "events.ipc", "sched.ipc", "frontend.ipc", "workers.ipc"
# Every socket file in the runtime directory. A Unix socket's path takes at most 107 bytes, so the
# directory's may take that less "/" and the longest name.
RUNTIME_SOCKETS = (CLIENT_IPC, CONTROL_IPC, EVENTS_IPC, SCHED_IPC, FRONTEND_IPC, WORKERS_IPC)
UNIX_PATH_MAX = 107
RUNTIME_DIR_MAX_BYTES = UNIX_PATH_MAX - 1 - max(len(name) for name in RUNTIME_SOCKETS)
# Plain ints: pyzmq's enum flags cost a Flag construction per `&` or `|`.
POLLIN, NOBLOCK, SNDMORE = (int(flag) for flag in (zmq.POLLIN, zmq.NOBLOCK, zmq.SNDMORE))
# But the option that socket.get takes stays the enum's member: get turns what it is given into a
# SocketOption, and from a member that is a type check, from an int a costlier lookup.
EVENTS = zmq.SocketOption.EVENTS
# pyzmq's own send and recv, under its Python conveniences (routing ids, type checks, enum flags):
# send_multipart and recv_multipart cost about twice what the frames' own calls do.
_send, _recv, _get = zmq.backend.Socket.send, zmq.backend.Socket.recv, zmq.backend.Socket.get


def endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}"


def client_endpoint(runtime_dir: Path) -> str:
    return endpoint(runtime_dir, CLIENT_IPC)


def control_endpoint(runtime_dir: Path) -> str:
    return endpoint(runtime_dir, CONTROL_IPC)


def bind_ipc(sock: zmq.Socket, path: Path, mode: int) -> None:
    """Bind an ipc endpoint and give its socket file exactly `mode` (connecting needs write
    permission on it). The runtime dir is the daemon's alone (trusted_path.py), so the path
    cannot be swapped between the bind and the chmod."""
    sock.bind(f"ipc://{path}")
    os.chmod(path, mode)


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
    """send_multipart, cheaper: every internal message and every reply goes through here."""
    more = SNDMORE | flags
    for frame in frames[:-1]:
        _send(sock, frame, more)
    _send(sock, frames[-1], flags)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """recv_multipart(NOBLOCK), cheaper: a zmq.Frame carries its RCVMORE, read in C, where asking
    the socket for it builds an option enum and calls into libzmq once per frame."""
    frame = _recv(sock, NOBLOCK, False)
    frames = [frame.bytes]
    while frame.more:
        frame = _recv(sock, NOBLOCK, False)
        frames.append(frame.bytes)
    return frames


def with_ipv6(sock: zmq.Socket) -> zmq.Socket:
    """A TCP socket that takes IPv6 endpoints too (tcp://[::1]:7070): libzmq's sockets are IPv4
    only by default, and fail to bind or connect to one with "No such device"."""
    sock.setsockopt(zmq.IPV6, 1)
    return sock


def router(context: zmq.Context) -> zmq.Socket:
    """A ROUTER whose names for clients that set no routing id cannot be guessed. libzmq takes
    them from a counter that starts at libc's rand(), which nothing seeds: 00 6b 8b 45 67, then
    68, ... in every process. A client may take one of those for its own (libzmq accepts a routing
    id that begins with a zero byte from a peer), and when the counter reaches it libzmq asserts
    and the process aborts: one DEALER naming itself 00 6b 8b 45 68 is enough, and the second
    anonymous connection after it aborts the ROUTER's process. rand() seeded from the OS first, the
    counter's start is a guess in 2**32 (a libzmq bug; bench/redteam.py's claimed_routing_ids plays it)."""
    try:
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))
    except OSError:
        pass   # no C library to reach: libzmq's ids stay predictable
    return with_ipv6(context.socket(zmq.ROUTER))


def drain(sock: zmq.Socket, handle, limit: int = 1 << 30, receive=None) -> int:
    """Hand every message waiting on `sock` (up to `limit`) to `handle`; never blocks.
    `receive(sock)` takes one message (default: recv_frames).

    Asking EVENTS is cheaper than letting recv raise zmq.Again, and it also re-arms the
    edge-triggered FD that event loops wait on. Returns how many messages were handled.
    """
    receive = receive or recv_frames
    taken = 0
    while taken < limit and _get(sock, EVENTS) & POLLIN:
        handle(receive(sock))
        taken += 1
    return taken


class Waiter:
    """Blocks until one of its sockets has a message, as zmq.Poller does, in fewer system calls: a
    zmq_poll polls every descriptor twice and asks EVENTS of every socket twice (each a poll and
    a getpid inside libzmq), several microseconds apiece on a VM. EVENTS first: it processes the
    socket's pending commands, after which the descriptor is readable only when a new one arrives.

    A socket drained here until EVENTS said it holds nothing is quiet: its descriptor alone says
    when a message comes, so it is not asked again (pyzmq builds an option enum on each ask too).
    A send on it may take that message's command, so it is quiet no more once sent on here."""

    def __init__(self, *socks: zmq.Socket):
        self.socks: tuple[zmq.Socket, ...] = ()
        self.fd = select.poll()
        self.socket_of: dict[int, zmq.Socket] = {}
        self.quiet: set[zmq.Socket] = set()
        for sock in socks:
            self.add(sock)

    def add(self, sock: zmq.Socket) -> None:
        """Also wait for `sock` (one its owner made after the waiter)."""
        fd = sock.getsockopt(zmq.FD)
        self.fd.register(fd, select.POLLIN)
        self.socket_of[fd] = sock
        self.socks += (sock,)

    def watch(self, fd: int) -> None:
        """Also wake when `fd` is readable (a thread's note that its work is done)."""
        self.fd.register(fd, select.POLLIN)

    def drain(self, sock: zmq.Socket, handle, limit: int = 1 << 30) -> int:
        """`drain` (below); a socket it emptied is quiet."""
        taken = drain(sock, handle, limit)
        if taken < limit:
            self.quiet.add(sock)
        return taken

    def send_frames(self, sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
        """`send_frames` (below) on one of the sockets, which may take its commands: not quiet."""
        self.quiet.discard(sock)
        send_frames(sock, frames, flags)

    def wait(self, timeout_ms: float) -> bool:
        """True when a message may wait (drain says for sure), within `timeout_ms`."""
        return bool(self.ready(timeout_ms))

    def ready(self, timeout_ms: float) -> list:
        """The sockets that may hold a message (drain says for sure) and the watched descriptors
        that are readable, as soon as there is one; none once `timeout_ms` passed. A socket not
        named has no message. Quiet sockets are named by their descriptors, also beside others
        found (one poll): a busy socket must not keep a quiet one waiting."""
        found = [sock for sock in self.socks if sock not in self.quiet and _get(sock, EVENTS) & POLLIN]
        if not self.quiet and (found or timeout_ms <= 0):
            return found
        timeout = 0 if found else math.ceil(max(0.0, timeout_ms))
        woke = [self.socket_of.get(fd, fd) for fd, _ in self.fd.poll(timeout)]
        self.quiet.difference_update(woke)   # their drain takes the command that woke the descriptor
        return found + [each for each in woke if each not in found] if found else woke


def frames_of(sock: zmq.Socket) -> list[zmq.Frame]:
    """A `receive` for drain: the message as zmq.Frame objects, whose properties (User-Id,
    Peer-Address, SRCFD) can be read."""
    return sock.recv_multipart(zmq.NOBLOCK, copy=False)
