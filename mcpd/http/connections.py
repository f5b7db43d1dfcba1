"""Which HTTP connections may open, and which close to make room.

Each address is held to limits.max_connections_per_address, one count with its ZeroMQ
connections (daemon/frontend/address_cap.py); all addresses together to http.max_connections and
never more than half the front-end's descriptor limit, read at each accept so a limit lowered
while running counts: the rest stays for ZeroMQ clients and the front-end's own sockets. At the total
cap a new connection closes the oldest idle one (no request in flight) rather than be refused, so
idle keep-alive connections give way before anyone is turned away; with none idle it is refused.
A refused connection gets a 429 in OpenAI's error shape and is closed.
"""
from __future__ import annotations

import asyncio
import resource
import socket
from typing import Callable

from aiohttp.web_protocol import RequestHandler

from mcpd.daemon.frontend.address_cap import AddressCap
from mcpd.http.connection import Connection
from mcpd.http.errors import HttpError
from mcpd.protocol import codes


def _refusal(code: str, message: str) -> bytes:
    error = HttpError(429, message, code, retry_after_ms=1000)
    body = error.json_bytes()
    head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {error.headers()['Retry-After']}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


OVER_ADDRESS_CAP = _refusal(codes.RATE_LIMITED, "too many connections from your address "
                                                "(limits.max_connections_per_address)")
FULL = _refusal(codes.OVERLOADED, "too many HTTP connections, none idle (http.max_connections)")


class ConnectionTable:
    def __init__(self, handler_factory: Callable[[], RequestHandler], address_cap: AddressCap, max_connections: int):
        self.handler_factory, self.address_cap, self.max_connections = handler_factory, address_cap, max_connections
        self.loop = asyncio.get_running_loop()
        self.open: dict[Connection, None] = {}   # oldest first: the order idle ones are shed in
        self.counted: set[Connection] = set()    # holding a place of its address: until its end
        self.serving: set[asyncio.Task] = set()   # connections being handed to the loop
        self.idle_shed = self.refused = 0

    def cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return self.max_connections if soft == resource.RLIM_INFINITY else min(self.max_connections, soft // 2)

    def accepted(self, sock: socket.socket, address: str) -> None:
        if not self.address_cap.admits(address):
            self._refuse(sock, OVER_ADDRESS_CAP)
            return
        if len(self.open) >= self.cap() and not self._shed_idle():
            self.address_cap.released(address)
            self._refuse(sock, FULL)
            return
        connection = Connection(self.handler_factory(), address, self.ended)
        self.open[connection] = None
        self.counted.add(connection)
        task = self.loop.create_task(self._serve(connection, sock))
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)

    def ended(self, connection: Connection) -> None:
        self.open.pop(connection, None)
        if connection in self.counted:
            self.counted.discard(connection)
            self.address_cap.released(connection.address)

    def stats(self) -> dict:
        return {"connections": len(self.counted), "max_connections": self.cap(), "idle_shed": self.idle_shed,
                "refused": self.refused}

    async def _serve(self, connection: Connection, sock: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: connection, sock)
        except OSError:   # it ended before it could be served
            sock.close()
            self.ended(connection)

    def _shed_idle(self) -> bool:
        for connection in self.open:
            if connection.idle:
                del self.open[connection]   # no longer sheddable; its address's place is freed at its end
                connection.close()
                self.idle_shed += 1
                return True
        return False

    def _refuse(self, sock: socket.socket, answer: bytes) -> None:
        self.refused += 1
        try:
            sock.send(answer, socket.MSG_DONTWAIT)   # a fresh connection's send buffer is empty
        except OSError:
            pass   # it is gone already
        sock.close()
