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
reads that way anyway for its descriptor (bench/overhead.py measures the CURVE cost). The
User-Id names the key as well as the tenant, and every message is checked against the allowed
set (authenticator.py): a connection is served only while its own key is allowed under its name.

The ipc socket file's mode is deliberate: 0666 with CURVE on, where every local user may connect
and is the tenant "uid:<uid>" the kernel vouches for; 0600 with CURVE off, where the header
names the tenant, so only the daemon's own user (and root) may use it. A client endpoint that
cannot be bound (tcp port taken, address not on this host) stops the daemon with the reason
(child.refuse_start) rather than restarting the front-end forever.
"""
from __future__ import annotations

import errno

import msgspec
import zmq

from mcpd import sockets
from mcpd.config import Config
from mcpd.daemon import channels, child
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.refusal import InUse, StartRefused
from mcpd.security.authenticator import CURVE_DOMAIN, IPC_DOMAIN, Authenticator
from mcpd.security.keys import KeyStore

CLIENT_IPC_MODE = 0o666   # CURVE on: any local user, as the tenant "uid:<uid>"
OWNER_ONLY = 0o600        # CURVE off: the header names the tenant, so only the daemon's user


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
        ipc = self.config.runtime_dir / sockets.CLIENT_IPC
        mode = CLIENT_IPC_MODE if self.auth else OWNER_ONLY
        self._bind(f"ipc://{ipc} (server.runtime_dir)", lambda: channels.bind_ipc(sock, ipc, mode))
        if not self.config.server.tcp:
            return
        if self.auth:
            sock.zap_domain = CURVE_DOMAIN.encode()
            sock.curve_server = True
            sock.curve_secretkey = self.keys.server_secret().encode()
        self._bind(f"{self.config.server.tcp} (server.tcp)", lambda: sock.bind(self.config.server.tcp))

    def _bind(self, endpoint: str, bind) -> None:
        try:
            bind()
        except zmq.ZMQError as e:   # the port taken, an address not on this host: a restart won't help
            refusal = InUse if e.errno == errno.EADDRINUSE else StartRefused
            child.refuse_start(self.config, "frontend", refusal(f"cannot bind the client endpoint {endpoint}: "
                                                                f"{e.strerror}"))

    def serve(self) -> int:
        """Answer waiting ZAP requests; returns how many (0 with CURVE off)."""
        return self.authenticator.serve() if self.auth else 0

    def tenant_of(self, frame: zmq.Frame) -> str | None:
        """The tenant of the connection a frame came from, "" if its key is no longer allowed under
        the name it connected as; None with CURVE off."""
        if not self.auth:
            return None
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:   # no User-Id: cannot happen past ZAP, and must not pass if it does
            return ""
        return self.authenticator.tenant(user_id) or ""


def stamp(request: wire.Request, tenant: str | None, peers: frozenset[str]) -> wire.Request:
    """The request with its header's tenant set to the authenticated one (as is with CURVE off).
    A request another node forwarded (header "hop") keeps the tenant its header names, the one that
    node admitted it as, but only from a connection authenticated as one of `peers` (the other
    nodes' key names): anyone else would use the marker to act as any tenant."""
    if tenant is None:
        return request
    claimed = request.header.get("tenant")
    if not tenant:
        raise _unauthorized(request, "this connection's key is not (or no longer) allowed under the name "
                                     "it connected as; connect again with an allowed key")
    if request.header.get("hop") is not None:
        if tenant not in peers:
            raise _unauthorized(request, f'header "hop" marks a request forwarded by another node, and {tenant!r} '
                                         'is not a cluster peer (cluster.peer_tenants)')
        return request
    if claimed is not None and claimed != tenant:
        raise _unauthorized(request, f'header "tenant" is {claimed!r} but this connection authenticated '
                                     f'as {tenant!r}; leave "tenant" out or make them match')
    return msgspec.structs.replace(request, header={**request.header, "tenant": tenant})


def _unauthorized(request: wire.Request, message: str) -> MCPDError:
    error = MCPDError(codes.UNAUTHORIZED, message)
    error.request_id = request.request_id
    return error
