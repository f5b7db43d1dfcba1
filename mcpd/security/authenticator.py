"""The ZAP handler: decides, for each new client connection, whether it may talk and as whom.

It runs on the front-end's event loop (an inproc REP socket polled with the client sockets), not
in a thread: no lock around the allowed set, and no thread that could die and leave connections
hanging. Fail closed at every step:
- the client socket sets a ZAP domain and ZMQ_ZAP_ENFORCE_DOMAIN, so if this handler is not
  bound (or not in the same zmq context) libzmq refuses every handshake instead of letting
  anyone in (without the flag, CURVE with no handler accepts any client key);
- a request that is malformed, for another domain, or with an unexpected mechanism is refused,
  and a bug while deciding is answered 500 (refused), never left unanswered or allowed.

The reply's User-Id is the tenant: the allowed key's name (CURVE on tcp) or "uid:<uid>" (ipc,
from the kernel's SO_PEERCRED, which libzmq passes as the request's address).

Live reload: the allowed set is re-read when the allowed/ directory's mtime changes, checked on
every ZAP request (a new connection) and at most every RELOAD_CHECK_S by `allows`, which the
front-end asks for every message. So a revoked key cannot open a new connection at once, and
the connections it already has are refused (UNAUTHORIZED) from their next message on, within
RELOAD_CHECK_S; they are not closed (ZeroMQ cannot drop one peer of a ROUTER).
"""
from __future__ import annotations

import logging
import time

import zmq
from zmq.utils import z85

from mcpd.daemon import channels
from mcpd.security.keys import KeyStore
from mcpd.security.peer import parse_peer_address

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # fixed by the ZAP spec (RFC 27)
IPC_DOMAIN = "mcpd-ipc"
CURVE_DOMAIN = "mcpd-curve"
IPC_TENANT_PREFIX = "uid:"
RELOAD_CHECK_S = 0.5
log = logging.getLogger("mcpd.security")


class Authenticator:
    def __init__(self, context: zmq.Context, keys: KeyStore):
        self.keys = keys
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.names_of: dict[bytes, str] = {}   # raw 32-byte public key -> tenant name
        self.names: frozenset[str] = frozenset()
        self.seen_mtime = -1
        self.next_check = 0.0
        self.refused = 0
        self.reload()

    def serve(self) -> int:
        """Answer every waiting ZAP request; returns how many."""
        return channels.drain(self.socket, self._on_request)

    def allows(self, tenant: str) -> bool:
        """Whether messages from a connection authenticated as `tenant` are still welcome."""
        if tenant.startswith(IPC_TENANT_PREFIX):
            return True
        if time.monotonic() >= self.next_check:
            self.reload()
        return tenant in self.names

    def reload(self) -> None:
        self.next_check = time.monotonic() + RELOAD_CHECK_S
        mtime = self.keys.mtime_ns()
        if mtime == self.seen_mtime:
            return
        self.names_of = {z85.decode(key): name for key, name in self.keys.allowed().items()}
        self.names = frozenset(self.names_of.values())
        self.seen_mtime = mtime   # only once loaded: a failed load is retried on the next check
        log.info("allowed client keys: %d (%s)", len(self.names), ", ".join(sorted(self.names)) or "none")

    def _on_request(self, frames: list[bytes]) -> None:
        request_id = frames[1] if len(frames) > 1 else b""
        try:
            user = self._decide(frames)
        except Exception:   # noqa: BLE001 - a bug refuses the connection; it never lets it in
            log.exception("ZAP request failed; refusing the connection")
            user = None
        if user is None:
            self.refused += 1
        status = (b"200", b"OK") if user else (b"400", b"not allowed")
        self.socket.send_multipart([b"1.0", request_id, *status, (user or "").encode(), b""])

    def _decide(self, frames: list[bytes]) -> str | None:
        """The tenant for this handshake, or None to refuse it."""
        if len(frames) < 6 or frames[0] != b"1.0":
            return None
        domain, address, mechanism = frames[2].decode(errors="replace"), frames[3].decode(errors="replace"), frames[5]
        if domain == IPC_DOMAIN and mechanism == b"NULL":
            peer = parse_peer_address(address)
            return f"{IPC_TENANT_PREFIX}{peer.uid}" if peer else None
        if domain == CURVE_DOMAIN and mechanism == b"CURVE" and len(frames) == 7:
            self.reload()
            name = self.names_of.get(frames[6])
            if name is None:
                log.debug("refused CURVE key %s from %s", z85.encode(frames[6]).decode(), address)
            return name
        return None
