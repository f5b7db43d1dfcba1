"""CURVE keys for a client: the server's public key and the client's own key pair.

    keys = CurveKeys.from_files("server.key", "alice.key_secret")
    client = Client("tcp://gpu-node:7070", curve=keys)

The daemon knows the client by its public key (allowed with `mcpctl keys allow NAME KEY`); the
key's NAME becomes the tenant of every request on the connection.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq

from mcpd.security import keys


@dataclass(frozen=True)
class CurveKeys:
    server_public: str   # Z85, 40 characters
    public: str
    secret: str

    @classmethod
    def from_files(cls, server_key: str | Path, client_secret: str | Path) -> "CurveKeys":
        """From the server's `server.key` and the client's `NAME.key_secret` (`mcpctl keys generate`)."""
        client_secret = Path(client_secret)
        return cls(keys.read_public(Path(server_key)), keys.read_public(client_secret),
                   keys.read_secret(client_secret))

    def apply(self, sock: zmq.Socket) -> None:
        """Set the socket's CURVE options; call before connect."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()
