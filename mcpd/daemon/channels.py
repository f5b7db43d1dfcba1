"""The internal sockets between mcpd's processes, and which messages go where.

All of them are ipc sockets in the runtime directory, each mode 0600 (whatever the umask): only
the daemon's uid (and root) can connect, so internal messages are trusted: the front-end has
already validated what came from clients. The supervisor runs every process under umask 0077, so
a socket file is born owner-only and then given its mode; there is no moment others could
connect. The client and control sockets have their own, deliberate modes (gate.py, peer.py).

    client ─ROUTER(client.ipc, tcp)─▶ front-end ─PUSH(sched.ipc)─▶ scheduler ─ROUTER(workers.ipc)─▶ worker
    front-end ◀─PULL(frontend.ipc)──────────────────────────────────────────────────── worker (PUSH)
    scheduler ─PUSH(frontend.ipc)─▶ front-end (errors it decides, status, context ops, turns)
    every child ─PUSH(events.ipc)─▶ supervisor (ready, stats)       mcpctl ─(control.ipc)─▶ supervisor

Replies go from the worker straight to the front-end: the scheduler is off the reply path (one
hop fewer per request) and learns what finished from Done notes, batched per worker loop turn.
A context turn is the exception, named in its Dispatch: its replies go through the scheduler,
which commits the turn before the client hears of it.

What one turn of a process's loop sends on one of these sockets goes as one ZeroMQ message, a
batch (batch.py); the scheduler's dispatches go as one batch per group it hands a worker, sent at
once, since what a full worker queue refused must stay queued for the next turn. Receivers take
batches and lone messages alike.

The messages on these sockets, and their one encoding, are declared in messages.py: every
one, the children's events to the supervisor (Ready, Report with typed stats, Drained, Refused,
AdminAnswer, Reloaded: each names its sender) and the supervisor's Admin and Reload included.
The supervisor matches an AdminAnswer or a Reloaded to its op by token.
`rid` is the front-end's internal request number, unique for the daemon's lifetime.
"""
from __future__ import annotations

from pathlib import Path

import zmq

from mcpd.protocol import codes
# The socket helpers live in mcpd.sockets (cli and security use them too); re-exported for the processes.
from mcpd.sockets import (NOBLOCK, Waiter, bind_ipc, client_endpoint, drain, endpoint, frames_of,  # noqa: F401
                          send_frames)

INTERNAL_SOCKET_MODE = 0o600

# The codes a CANCEL carries, and what the final reply then says.
CANCEL_REASONS = {
    codes.CANCELLED: "cancelled by the client",
    codes.DEADLINE_EXCEEDED: "deadline passed",
    codes.OVERLOADED: "ended: the client does not read its replies (limits.max_client_backlog_bytes)",
}


def internal_socket(context: zmq.Context, runtime_dir: Path, kind: int, name: str, bind: bool) -> zmq.Socket:
    """A socket on one of the ipc endpoints above, bound or connected, that drops what it could
    not send when closed (a dead peer must not hold a restarting process up)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        bind_ipc(sock, runtime_dir / name, INTERNAL_SOCKET_MODE)
    else:
        sock.connect(endpoint(runtime_dir, name))
    return sock


def worker_identity(index: int) -> bytes:
    return b"w%d" % index
