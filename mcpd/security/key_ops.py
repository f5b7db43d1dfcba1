"""The `keys.*` control ops (what `mcpctl keys allow/revoke/list` send to the supervisor).

They run in the supervisor, as the daemon's user, after the peer check (they are privileged):
`mcpctl` never needs write access to the keys directory itself. The front-end notices a change
by the allowed/ directory's mtime (see authenticator.py), so no message to it is needed.
Refusals: a bad name or key (not Z85, or not decoding to 32 bytes) is BAD_REQUEST; a key that is
already allowed under another name is CONFLICT.
"""
from __future__ import annotations

import functools

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.refusal import StartRefused
from mcpd.security.api_keys import ApiKeys
from mcpd.security.keys import BadKey, KeyConflict, KeyStore


def _refusals_as_codes(op):
    """The key store's refusals as the protocol's error codes."""
    @functools.wraps(op)
    def answered(keys: KeyStore, *args) -> dict:
        try:
            return op(keys, *args)
        except KeyConflict as e:
            raise MCPDError(codes.CONFLICT, str(e)) from None
        except BadKey as e:
            raise MCPDError(codes.BAD_REQUEST, str(e)) from None
        except (OSError, StartRefused) as e:   # the keys directory; never let it take the supervisor down
            raise MCPDError(codes.INTERNAL, f"keys directory {keys.directory}: {e}") from None
    return answered


@_refusals_as_codes
def list_keys(keys: KeyStore, curve: bool) -> dict:
    server = keys.directory / "server.key"
    return {"curve": curve, "keys_dir": str(keys.directory),
            "server_public_key": keys.server_public() if server.exists() else None,
            "allowed": [{"name": name, "public_key": key} for key, name in sorted(keys.allowed().items(),
                                                                                  key=lambda item: item[1])],
            "api_keys": ApiKeys(keys.directory).names()}


@_refusals_as_codes
def allow(keys: KeyStore, name: str, public_key: str) -> dict:
    keys.allow(name, public_key)
    return {"allowed": name}


@_refusals_as_codes
def revoke(keys: KeyStore, name: str) -> dict:
    return {"revoked": keys.revoke(name)}


@_refusals_as_codes
def api_add(keys: KeyStore, name: str) -> dict:
    return {"name": name, "api_key": ApiKeys(keys.directory).add(name)}


@_refusals_as_codes
def api_revoke(keys: KeyStore, name: str) -> dict:
    return {"revoked": ApiKeys(keys.directory).revoke(name)}
