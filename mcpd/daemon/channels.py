"""The internal sockets between mcpd's processes and the tags of the messages on them.

All of them are ipc sockets in the runtime directory, each mode 0600 (whatever the umask): only
the daemon's uid (and root) can connect, so internal messages are trusted: the front-end has
already validated what came from clients. The supervisor runs every process under umask 0077, so
a socket file is born owner-only and then given its mode; there is no moment others could
connect. The client and control sockets have their own, deliberate modes (gate.py, peer.py).

    client ─ROUTER(client.ipc, tcp)─▶ front-end ─PUSH(sched.ipc)─▶ scheduler ─ROUTER(workers.ipc)─▶ worker
    front-end ◀─PULL(frontend.ipc)──────────────────────────────────────────────────── worker (PUSH)
    every child ─PUSH(events.ipc)─▶ supervisor (ready, stats)       mcpctl ─(control.ipc)─▶ supervisor

Replies go from the worker straight to the front-end: the scheduler is off the reply path (one
hop fewer per request) and learns what finished from DONE notes, batched per worker loop turn.

Message layouts (frames):
    front-end → scheduler   [REQUEST, rid, header, *payload]   [CANCEL, rid, code] (the client's cancel or
                            its disconnect: CANCELLED; a client not reading its replies: OVERLOADED)
    supervisor → scheduler  [WORKER_LOST, msgpack {"index", "pid"}]
                            [ADMIN, msgpack {"token", "op", "args"}]   (mcpctl's context ops)
                            [RELOAD, msgpack {"token", "config"}]      (config as Config.to_dict())
    scheduler → worker      [worker identity, REQUEST, rid, dispatch, header, *payload]   [.., CANCEL, rid, code]
                            (dispatch: msgpack {"priority": int, the engine priority; "max_tokens":
                            int|None, a degradation cap}; code: the final's error code, one of
                            CANCEL_REASONS)
                            [.., RELOAD, msgpack {"token", "config"}]   (passed on from the supervisor)
    worker → scheduler      [HELLO, info]   [STARTED, rid]   [DONE, rid, rid, ...]   [STATS, stats]
                            [CHUNK, rid, reply header]   [FINAL, rid, reply header, appended token ids]
                            (context turns only, relayed in order: the scheduler commits the
                            turn before it answers the front-end)
                            [FAILED, reason, rid, rid, ...] (an engine step raised: these requests
                            were aborted unanswered; the scheduler retries or answers each)
    worker → front-end      [CHUNK|FINAL, rid, reply header, *payload]
    scheduler → front-end   [FINAL, rid, reply header]   (errors it decides: OVERLOADED, RATE_LIMITED, DEADLINE_EXCEEDED, WORKER_LOST, ...)
    supervisor → front-end  [DRAIN]   [SCHEDULER_LOST] (answer everything in flight: nobody else will)
                            [RESUME] (admit work again after a drain)   [RELOAD, msgpack {"token", "config"}]
    child → supervisor      [msgpack {"role", "index", "pid", "event": "ready"|"stats"|"drained", ...}]
                            event "admin": {"token", "result"} or {"token", "code", "message"}: the
                            scheduler's answer to ADMIN; event "reloaded": {"token", "applied": [keys]}
                            from every process that got RELOAD. The supervisor matches both by token.
STARTED says a stream sent its first chunk, so the request is no longer safe to retry elsewhere.
`rid` is the front-end's 8-byte internal request number, unique for the daemon's lifetime.
"""
from __future__ import annotations

import struct
from pathlib import Path

import zmq

from mcpd.protocol import codes
# The socket helpers live in mcpd.sockets (cli and security use them too); re-exported for the processes.
from mcpd.sockets import bind_ipc, client_endpoint, drain, endpoint, frames_of  # noqa: F401

REQUEST = b"REQ"
CANCEL = b"CANCEL"
CHUNK = b"CHUNK"
FINAL = b"FINAL"
HELLO = b"HELLO"
STARTED = b"STARTED"
DONE = b"DONE"
STATS = b"STATS"
FAILED = b"FAILED"
WORKER_LOST = b"LOST"
DRAIN = b"DRAIN"
SCHEDULER_LOST = b"SCHED_LOST"
ADMIN = b"ADMIN"
RELOAD = b"RELOAD"
RESUME = b"RESUME"

INTERNAL_SOCKET_MODE = 0o600

# The codes a CANCEL carries, and what the final reply then says.
CANCEL_REASONS = {
    codes.CANCELLED: "cancelled by the client",
    codes.DEADLINE_EXCEEDED: "deadline passed",
    codes.OVERLOADED: "ended: the client does not read its replies (limits.max_client_backlog_bytes)",
}

_RID = struct.Struct(">Q")
pack_rid = _RID.pack


def unpack_rid(raw: bytes) -> int:
    return _RID.unpack(raw)[0]


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
