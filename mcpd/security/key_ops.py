"""The `keys.*` control ops (what `mcpctl keys allow/revoke/list` send to the supervisor).

They run in the supervisor, as the daemon's user, after the peer check (they are privileged):
`mcpctl` never needs write access to the keys directory itself. The front-end notices a change
by the allowed/ directory's mtime (see authenticator.py), so no message to it is needed.
"""
from __future__ import annotations

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.security.keys import BadKey, KeyStore

PREFIX = "keys."


def run(keys: KeyStore, curve: bool, op: str, args: dict) -> dict:
    try:
        if op == "keys.list":
            return _list(keys, curve)
        if op == "keys.allow":
            keys.allow(args.get("name"), args.get("public_key"))
            return {"allowed": args["name"]}
        if op == "keys.revoke":
            return {"revoked": keys.revoke(args.get("name"))}
    except BadKey as e:
        raise MCPDError(codes.BAD_REQUEST, str(e)) from None
    raise MCPDError(codes.UNKNOWN_OP, f"unknown control op {op!r}; known: keys.list, keys.allow, keys.revoke")


def _list(keys: KeyStore, curve: bool) -> dict:
    server = keys.directory / "server.key"
    return {"curve": curve, "keys_dir": str(keys.directory),
            "server_public_key": keys.server_public() if server.exists() else None,
            "allowed": [{"name": name, "public_key": key} for key, name in sorted(keys.allowed().items(),
                                                                                  key=lambda item: item[1])]}
