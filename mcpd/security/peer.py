"""Who is at the other end of an ipc socket, and what the control socket lets them do.

libzmq reads the peer's credentials with SO_PEERCRED when an ipc connection is accepted and
reports them as the message property "Peer-Address" = "<host>:<uid>:<gid>:<pid>" (and as the
ZAP request's address). The kernel fills them in at connect time, so a peer cannot forge them.

The control socket is owner-only (0600), or 0660 with `security.admin_group` as its group, and
on top of that every op except those the control-op table opens to anyone (protocol/control_ops.py)
needs the daemon's uid, root, or the admin group: if the file's mode is ever loosened, the check
still holds.
"""
from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

import zmq

from mcpd.protocol import codes, control_ops
from mcpd.protocol.codes import MCPDError

CONTROL_SOCKET_MODE = 0o600
CONTROL_SOCKET_GROUP_MODE = 0o660


@dataclass(frozen=True)
class PeerCred:
    uid: int
    gid: int
    pid: int


def parse_peer_address(address: str) -> PeerCred | None:
    """PeerCred from "<host>:<uid>:<gid>:<pid>"; None for a tcp peer's address (an IPv6 one has
    colons and digits too, but then its host part still holds a colon)."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or ":" in parts[0] or not all(p.isdigit() for p in parts[1:]):
        return None
    return PeerCred(int(parts[1]), int(parts[2]), int(parts[3]))


def peer_of(frame: zmq.Frame) -> PeerCred | None:
    try:
        return parse_peer_address(frame.get("Peer-Address"))
    except zmq.ZMQError:   # no such property: not a socket peer
        return None


def admin_gid(group: str) -> int | None:
    return grp.getgrnam(group).gr_gid if group else None


def is_admin(peer: PeerCred | None, daemon_uid: int, group_gid: int | None) -> bool:
    """The daemon's own user, root, or a member of the admin group (primary or listed in it)."""
    if peer is None:
        return False
    if peer.uid in (daemon_uid, 0):
        return True
    return group_gid is not None and (peer.gid == group_gid or _listed_member(peer.uid, group_gid))


def _listed_member(uid: int, gid: int) -> bool:
    try:
        return pwd.getpwuid(uid).pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:   # a uid or gid with no name: not a member
        return False


def authorize_control(op: str, peer: PeerCred | None, group_gid: int | None) -> None:
    """Raise UNAUTHORIZED unless `peer` may run control op `op`."""
    if not control_ops.open_to_anyone(op) and not is_admin(peer, os.getuid(), group_gid):
        who = f"uid {peer.uid}" if peer else "an unidentified peer"
        raise MCPDError(codes.UNAUTHORIZED, f"control op {op!r} needs the daemon's user or its admin group; "
                                            f"{who} is neither")


def restrict_control_socket(path: Path, group_gid: int | None) -> None:
    """Owner-only, or owner and admin group (bound owner-only first: sockets.bind_ipc)."""
    if group_gid is not None:
        os.chown(path, -1, group_gid)
        os.chmod(path, CONTROL_SOCKET_GROUP_MODE)
