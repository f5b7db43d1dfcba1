"""The metrics endpoint's HTTP server: prometheus_client's WSGI app on a server of our own,
because prometheus_client's serves each connection on a thread of its own for as long as the
client keeps it open, without a bound. The server runs in the supervisor, so a local client
holding a few thousand idle connections would take that many of the supervisor's threads, up to
the unit's TasksMax, past which it can no longer start a child. Here at most MAX_CONNECTIONS
are served at once (those past it are closed at once), and one that sends nothing for IDLE_S is
closed.
"""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import make_wsgi_app

MAX_CONNECTIONS = 16   # scrapers and an operator's curl: a handful at a time
IDLE_S = 10.0          # longer than a scrape takes to send its request


class _Handler(WSGIRequestHandler):
    timeout = IDLE_S   # on the connection's socket: a read that waits longer ends the connection

    def log_message(self, format, *args) -> None:   # the daemon's log is not an access log
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: int):
        self.address_family = family
        super().__init__(address, _Handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)   # past the bound: closed, no thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def start(host: str, port: int, registry: CollectorRegistry) -> _BoundedServer:
    """Serve the registry's metrics on host:port (IPv4 or IPv6) from a thread; OSError if it cannot bind."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server = _BoundedServer((host, port), family)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
