"""The `keys.*` control ops (what `mcpctl keys allow/revoke/list` send to the supervisor).

They run in the supervisor, as the daemon's user, after the peer check (they are privileged):
`mcpctl` never needs write access to the keys directory itself. The front-end notices a change
by the allowed/ directory's mtime (see authenticator.py), so no message to it is needed.
Refusals: a bad name or key (not Z85, or not decoding to 32 bytes) is BAD_REQUEST; a key that is
already allowed under another name is CONFLICT.
"""
from __future__ import annotations

from mcpd.daemon.refusal import StartRefused
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.security.keys import BadKey, KeyConflict, KeyStore

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
    except KeyConflict as e:
        raise MCPDError(codes.CONFLICT, str(e)) from None
    except BadKey as e:
        raise MCPDError(codes.BAD_REQUEST, str(e)) from None
    except (OSError, StartRefused) as e:   # the keys directory; never let it take the supervisor down
        raise MCPDError(codes.INTERNAL, f"keys directory {keys.directory}: {e}") from None
    raise MCPDError(codes.UNKNOWN_OP, f"unknown control op {op!r}; known: keys.list, keys.allow, keys.revoke")


def _list(keys: KeyStore, curve: bool) -> dict:
    server = keys.directory / "server.key"
    return {"curve": curve, "keys_dir": str(keys.directory),
            "server_public_key": keys.server_public() if server.exists() else None,
            "allowed": [{"name": name, "public_key": key} for key, name in sorted(keys.allowed().items(),
                                                                                  key=lambda item: item[1])]}
