"""The front door's security: how the client endpoints are bound, and who sent each message.

With CURVE off (loopback development) nothing changes: the header's "tenant" names the owner.
With CURVE on, the ipc endpoint is bound first with the NULL mechanism and the ipc ZAP domain,
then CURVE is switched on and the tcp endpoint bound (libzmq copies socket options into each
listener when it binds, so the two endpoints keep their own mechanism). Every handshake goes
through the Authenticator, and every message carries the User-Id it returned.

A request's tenant is then that User-Id, never what the client wrote: the front-end re-packs the
header with it before anything else sees the request, so the scheduler, contexts, prefix cache,
rate limits and metrics all key on the authenticated identity. A header that names a different
tenant gets UNAUTHORIZED rather than being silently re-labelled: a client configured for one
tenant and holding another's key should hear about it, not write into the wrong namespace.
Reading User-Id needs the routing-id frame as a zmq.Frame (copy=False), which the front-end
reads that way anyway for its descriptor (bench/overhead.py measures the CURVE cost).
"""
from __future__ import annotations

import dataclasses

import msgpack
import zmq

from mcpd.config import Config
from mcpd.daemon import channels
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.security.authenticator import CURVE_DOMAIN, IPC_DOMAIN, Authenticator
from mcpd.security.keys import KeyStore


class Gate:
    def __init__(self, config: Config, context: zmq.Context):
        self.config = config
        self.auth = config.curve
        self.keys = KeyStore(config.keys_dir)
        # Bound before any client endpoint, so no handshake can arrive while there is no handler.
        self.authenticator = Authenticator(context, self.keys) if self.auth else None
        self.sockets = (self.authenticator.socket,) if self.auth else ()

    def bind(self, sock: zmq.Socket) -> None:
        if self.auth:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.zap_domain = IPC_DOMAIN.encode()
        sock.bind(channels.client_endpoint(self.config.runtime_dir))
        if not self.config.server.tcp:
            return
        if self.auth:
            sock.zap_domain = CURVE_DOMAIN.encode()
            sock.curve_server = True
            sock.curve_secretkey = self.keys.server_secret().encode()
        sock.bind(self.config.server.tcp)

    def serve(self) -> int:
        """Answer waiting ZAP requests; returns how many (0 with CURVE off)."""
        return self.authenticator.serve() if self.auth else 0

    def tenant_of(self, frame: zmq.Frame) -> str | None:
        """The tenant of the connection a frame came from; None with CURVE off."""
        if not self.auth:
            return None
        try:
            return frame.get("User-Id")
        except zmq.ZMQError:   # no User-Id: cannot happen past ZAP, and must not pass if it does
            return ""

    def stamp(self, request: wire.Request, tenant: str | None) -> wire.Request:
        """The request with its header's tenant set to the authenticated one (as is with CURVE off)."""
        if tenant is None:
            return request
        claimed = request.header.get("tenant")
        if not tenant or not self.authenticator.allows(tenant):
            raise _unauthorized(request, "this connection's key is not (or no longer) allowed")
        if claimed is not None and claimed != tenant:
            raise _unauthorized(request, f'header "tenant" is {claimed!r} but this connection authenticated '
                                         f'as {tenant!r}; leave "tenant" out or make them match')
        header = {**request.header, "tenant": tenant}
        return dataclasses.replace(request, header=header, header_bytes=msgpack.packb(header))


def _unauthorized(request: wire.Request, message: str) -> MCPDError:
    error = MCPDError(codes.UNAUTHORIZED, message)
    error.request_id = request.request_id
    return error
