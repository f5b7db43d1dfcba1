"""Where mcpd's sockets live and how every process reads them: the ipc endpoint names in the
runtime directory, binding one with an exact mode, and draining a socket without blocking.

Neutral ground: the daemon's processes, the security gate, `mcpctl` and tests all use these, so
they sit outside mcpd.daemon (whose channels.py adds the internal message tags on top).
"""
from __future__ import annotations

import os
from pathlib import Path

import zmq

CLIENT_IPC = "client.ipc"      # clients (the front-end's ROUTER)
CONTROL_IPC = "control.ipc"    # mcpctl (the supervisor's ROUTER)
# Plain ints: pyzmq's enum flags cost a Flag construction per `&` (2 µs a drain check, py-spy'd).
EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


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


def drain(sock: zmq.Socket, handle, limit: int = 1 << 30, receive=None) -> int:
    """Hand every message waiting on `sock` (up to `limit`) to `handle`; never blocks.
    `receive(sock)` takes one message (default: recv_multipart without blocking).

    Asking EVENTS is cheaper than letting recv raise zmq.Again, and it also re-arms the
    edge-triggered FD that event loops wait on. Returns how many messages were handled.
    """
    taken = 0
    while taken < limit and sock.getsockopt(EVENTS) & POLLIN:
        handle(receive(sock) if receive else sock.recv_multipart(NOBLOCK))
        taken += 1
    return taken


def frames_of(sock: zmq.Socket) -> list[zmq.Frame]:
    """A `receive` for drain: the message as zmq.Frame objects, whose properties (User-Id,
    Peer-Address, SRCFD) can be read."""
    return sock.recv_multipart(zmq.NOBLOCK, copy=False)
