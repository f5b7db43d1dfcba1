"""The ZAP handler: decides, for each new client connection, whether it may talk and as whom.

It runs on the front-end's event loop (an inproc REP socket polled with the client sockets), not
in a thread: no lock around the allowed set, and no thread that could die and leave connections
hanging. Fail closed at every step:
- the client socket sets a ZAP domain and ZMQ_ZAP_ENFORCE_DOMAIN, so if this handler is not
  bound (or not in the same zmq context) libzmq refuses every handshake instead of letting
  anyone in (without the flag, CURVE with no handler accepts any client key);
- a request that is malformed, for another domain, or with an unexpected mechanism is refused,
  and a bug while deciding is answered 500 (refused), never left unanswered or allowed.

A connection's identity is the key it authenticated with, not a name: the reply's User-Id is
"<name> <z85 key>" for CURVE (names hold no space or ':', Z85 no space) and "uid:<uid>" for ipc
(from the kernel's SO_PEERCRED, which libzmq passes as the request's address). Every message
of a CURVE connection is served only while that exact key is still allowed under that name
(`tenant`): replacing a name's key, or revoking it and allowing the name again with another key,
shuts out the old key's open connections; they are never served as whoever holds the name now.

Live reload: the allowed set is re-read when the allowed/ directory's mtime changes, checked on
every ZAP request (a new connection) and at most every RELOAD_CHECK_S by `tenant`, which the
front-end asks for every message. So a revoked key cannot open a new connection at once, and
the connections it already has are refused (UNAUTHORIZED) from their next message on, within
RELOAD_CHECK_S; they are not closed (ZeroMQ cannot drop one peer of a ROUTER). A change in the
same clock tick as a read leaves the mtime as it was, so an mtime is trusted only once it is
older than SETTLED_NS (git's "racy" rule); until then every check reads the keys again (at most
every RELOAD_MIN_S, so a burst of handshakes cannot turn into a burst of directory reads).
A bad entry on disk is skipped with a log line (keys.py); it never breaks the others.
"""
from __future__ import annotations

import logging
import re
import time

import zmq
from zmq.utils import z85

from mcpd import sockets
from mcpd.security.keys import KeyStore
from mcpd.security.peer import parse_peer_address

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # fixed by the ZAP spec (RFC 27)
IPC_DOMAIN = "mcpd-ipc"
CURVE_DOMAIN = "mcpd-curve"
IPC_TENANT = re.compile(r"uid:[0-9]+")
RELOAD_CHECK_S = 0.5
RELOAD_MIN_S = 0.02
SETTLED_NS = 1_000_000_000   # older than any filesystem's timestamp tick (ext4: 4 ms; ext3: 1 s)
log = logging.getLogger("mcpd.security")


class Authenticator:
    def __init__(self, context: zmq.Context, keys: KeyStore):
        self.keys = keys
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.name_of: dict[str, str] = {}   # Z85 public key -> the tenant it is allowed as
        self.seen_mtime = -1   # the mtime the allowed set is known to match; -1: not yet settled
        self.read_mtime = -1   # the mtime at the last read
        self.next_check = 0.0
        self.last_read = -RELOAD_MIN_S
        self.refused = 0
        self.reload()
        self._log_allowed()

    def serve(self) -> int:
        """Answer every waiting ZAP request; returns how many."""
        return sockets.drain(self.socket, self._on_request)

    def tenant(self, user_id: str) -> str | None:
        """The tenant of a connection whose handshake returned `user_id`, or None if its key is no
        longer allowed under the name it had (asked for every message)."""
        if IPC_TENANT.fullmatch(user_id):
            return user_id
        if time.monotonic() >= self.next_check:
            self.reload()
        name, _, key = user_id.partition(" ")
        return name if name and self.name_of.get(key) == name else None

    def reload(self, force: bool = False) -> None:
        """Read the allowed set if the directory may have changed since the last read. The
        RELOAD_MIN_S guard only spaces re-reads of an unsettled mtime already read; a new mtime
        is always read (a key allowed just after a read must not wait, or its first handshake
        is refused and the client never retries), and `force` reads an unsettled one anyway."""
        now = time.monotonic()
        self.next_check = now + RELOAD_CHECK_S
        mtime = self.keys.mtime_ns()
        if mtime == self.seen_mtime:
            return
        if not force and mtime == self.read_mtime and now - self.last_read < RELOAD_MIN_S:
            return
        self.last_read, self.read_mtime = now, mtime
        name_of = self.keys.allowed()
        changed = name_of != self.name_of
        self.name_of = name_of
        # A change within the same timestamp tick as this read would leave mtime as it is now.
        self.seen_mtime = mtime if time.time_ns() - mtime > SETTLED_NS else -1
        if changed:
            self._log_allowed()

    def _log_allowed(self) -> None:
        names = sorted(self.name_of.values())
        log.info("allowed client keys: %d (%s)", len(names), ", ".join(names) or "none")

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
        """The User-Id for this handshake (see the module docstring), or None to refuse it."""
        if len(frames) < 6 or frames[0] != b"1.0":
            return None
        domain, address, mechanism = frames[2].decode(errors="replace"), frames[3].decode(errors="replace"), frames[5]
        if domain == IPC_DOMAIN and mechanism == b"NULL":
            peer = parse_peer_address(address)
            return f"uid:{peer.uid}" if peer else None
        if domain == CURVE_DOMAIN and mechanism == b"CURVE" and len(frames) == 7 and len(frames[6]) == 32:
            self.reload()
            key = z85.encode(frames[6]).decode()
            name = self.name_of.get(key)
            if name is None and self.seen_mtime == -1:
                # Changed within a timestamp tick of the last read: a key allowed in that tick has
                # the same mtime. An unknown key is worth one more read, only in that second.
                self.reload(force=True)
                name = self.name_of.get(key)
            if name is None:
                log.debug("refused CURVE key %s from %s", key, address)
                return None
            return f"{name} {key}"
        return None
