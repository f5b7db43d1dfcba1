"""The HTTP listener (`[http] listen`): aiohttp on the front-end's event loop.

Why inside the front-end rather than a process of its own: a listener process that is a client
of client.ipc adds two ZeroMQ hops to every request, each waking an I/O thread and a process, and
about twice the time the listener here adds (bench/http_listener.py compares them). In the front-end an
HTTP request is admitted in memory by the same code as a ZeroMQ one (frontend_link.py), so
limits, drain, priorities, metrics and cancellation apply to it alike, and only the HTTP work
itself is added. The price: HTTP parsing and JSON share the front-end's loop with ZeroMQ
clients; aiohttp's C parser and one JSON decode per request keep that small.

Why aiohttp: it costs about what uvicorn + httptools does a request (both on uvloop), and brings what a
listener facing strangers needs built in: header line and count limits (uvicorn with httptools
takes a request of 100,000 headers), a
body size cap, keep-alive timeouts, and handler cancellation when a client disconnects (which
cancels the daemon request).

The listening socket and its accepts are ours (acceptor.py), and which connections are served is
the connection table's (connections.py): aiohttp serves what they hand it.

A port it cannot bind, or a non-loopback listen with auth on and no API key, stops the daemon
with the reason (child.refuse_start), as the front-end's tcp port does.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket

from aiohttp import web

from mcpd.config import Config
from mcpd.daemon import child
from mcpd.daemon.child_stats import HttpStats
from mcpd.daemon.frontend.address_cap import AddressCap
from mcpd.http.acceptor import Acceptor
from mcpd.http.connections import ConnectionTable
from mcpd.http.errors import HttpError
from mcpd.http.frontend_link import FrontendLink
from mcpd.http.kserve import error_body
from mcpd.http.kserve_routes import KServeRoutes, is_oip_path
from mcpd.http.routes import Routes
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.refusal import InUse, StartRefused
from mcpd.security.api_keys import ApiKeys


class HttpListener:
    def __init__(self, config: Config, link: FrontendLink, address_cap: AddressCap, log: logging.Logger):
        self.config, self.address_cap, self.log = config, address_cap, log
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)   # a client's bad request is not our error
        self.routes = Routes(config, link)
        self.kserve = KServeRoutes(self.routes)
        self.responses: dict[str, int] = {}   # {status: count}
        self.address = ""
        self.runner: web.AppRunner | None = None
        self.connections: ConnectionTable | None = None
        self.acceptor: Acceptor | None = None

    async def start(self) -> None:
        config = self.config.http
        self._refuse_open_door()
        app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._answer_errors])
        self.routes.add_to(app)
        self.kserve.add_to(app)
        # shutdown_timeout: at stop the front-end has answered every request already.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                                    keepalive_timeout=config.keepalive_timeout_s)
        await self.runner.setup()
        host, _, port = config.listen.rpartition(":")
        sock = self._bind(host.strip("[]"), int(port))
        self.connections = ConnectionTable(self.runner.server, self.address_cap, config.max_connections)
        self.acceptor = Acceptor(sock, self.connections.accepted, self.log)
        self.acceptor.start()
        self.address = f"{host}:{sock.getsockname()[1]}"
        self.log.info("serving HTTP on http://%s (auth %s)", self.address, "on" if self.config.http_auth else "off")

    async def stop(self) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        if self.runner is not None:
            await self.runner.cleanup()

    def stats(self) -> HttpStats:
        connections = self.connections.stats() if self.connections is not None else {}
        return HttpStats(listen=self.address, auth=self.config.http_auth, inflight=self.routes.inflight,
                         responses=dict(self.responses), **connections,
                         accept_pauses=self.acceptor.pauses if self.acceptor is not None else 0)

    def _bind(self, host: str, port: int) -> socket.socket:
        try:
            family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            return socket.create_server((host, port), family=family)   # the Acceptor sets its backlog
        except OSError as e:
            refusal = InUse if e.errno == errno.EADDRINUSE else StartRefused
            child.refuse_start(self.config, "frontend", refusal(f"cannot bind http.listen {self.config.http.listen}: "
                                                                f"{e.strerror}"))

    def _refuse_open_door(self) -> None:
        config = self.config.http
        if self.config.http_auth and not config.loopback and not ApiKeys(self.config.keys_dir).names():
            child.refuse_start(self.config, "frontend", StartRefused(
                f"http.listen = {config.listen!r} is not a loopback address and there is no API key: nobody "
                "could use it. Add keys with `mcpctl keys api-add NAME` (with a loopback listen, or http off) "
                "and start again"))

    @web.middleware
    async def _answer_errors(self, request: web.Request, handler) -> web.StreamResponse:
        oip = is_oip_path(request.path)
        try:
            response = await handler(request)
        except HttpError as e:
            response = _error_response(e, oip)
        except MCPDError as e:
            response = _error_response(HttpError.of(ErrorReply.of(e)), oip)
        except web.HTTPException as e:   # aiohttp's own: unknown path (404), wrong method (405)
            response = _error_response(HttpError(e.status, e.reason, codes.NOT_FOUND if e.status == 404
                                                 else codes.BAD_REQUEST), oip)
        except (asyncio.CancelledError, ConnectionError):
            raise   # the client is gone: nobody to answer
        except Exception as e:   # noqa: BLE001 - whatever goes wrong, the client gets an answer
            self.log.exception("unexpected failure answering %s %s", request.method, request.path)
            response = _error_response(HttpError(500, f"{type(e).__name__}: {e}", codes.INTERNAL), oip)
        key = str(response.status)
        self.responses[key] = self.responses.get(key, 0) + 1
        return response


def _error_response(error: HttpError, oip: bool) -> web.Response:
    """OpenAI's error body, or the Open Inference Protocol's under its paths (kserve_routes.py)."""
    body = error_body(error.message, error.code) if oip else error.json_bytes()
    response = web.Response(status=error.status, body=body, content_type="application/json",
                            headers=error.headers())
    if error.closes:
        response.force_close()
    return response
