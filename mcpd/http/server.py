"""The HTTP listener process (`[http] listen`): aiohttp on uvloop, a client of client.ipc.

Why a process of its own rather than a part of the front-end: the front-end's loop is the one
gate every ZeroMQ request passes, and HTTP parsing, JSON and SSE framing cost Python time per
request that would delay it; here they run on another core, a crash or a flood of connections
costs the ZeroMQ clients nothing, and the listener needs nothing from the daemon that a client
does not have (it speaks the documented protocol, so metrics, limits, priorities and
cancellation apply to HTTP requests exactly as to the others). It costs one more ipc hop each
way, which bench/http.py measures against the ZeroMQ path.

Why aiohttp: its per-request cost measured the same as uvicorn + httptools here (about 37 us p50
for a small POST on loopback), and it brings what a listener facing strangers needs built in:
header line and count limits (uvicorn with httptools took 100,000 headers), a body size cap,
keep-alive timeouts, and handler cancellation when a client disconnects (which cancels the
daemon request).

It is ready once bound; a port it cannot bind, or a non-loopback listen with auth on and no API
key, stops the daemon with the reason (child.refuse_start), as the front-end's tcp port does.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal

import uvloop
import zmq
from aiohttp import web

from mcpd.config import Config
from mcpd.daemon import channels, child
from mcpd.http.daemon_link import DaemonLink
from mcpd.http.errors import HttpError
from mcpd.http.routes import Routes
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.refusal import InUse, StartRefused
from mcpd.security.api_keys import ApiKeys

STATS_INTERVAL_S = 0.5


class HttpListener:
    def __init__(self, config: Config):
        self.config = config
        self.log = child.start("http", config)
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)   # a client's bad request is not our error
        self.parent_pid = os.getppid()
        self.responses: dict[str, int] = {}   # {status: count}
        self.address = ""

    async def serve(self) -> None:
        config = self.config.http
        self._refuse_open_door()
        link = DaemonLink(channels.client_endpoint(self.config.runtime_dir))
        link.attach(asyncio.get_running_loop())
        self.routes = Routes(self.config, link)
        app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._answer_errors])
        self.routes.add_to(app)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=config.keepalive_timeout_s)
        await runner.setup()
        host, _, port = config.listen.rpartition(":")
        try:
            await web.TCPSite(runner, host.strip("[]"), int(port), reuse_address=True).start()
        except OSError as e:
            refusal = InUse if e.errno == errno.EADDRINUSE else StartRefused
            child.refuse_start(self.config, "http", refusal(f"cannot bind http.listen {config.listen}: {e.strerror}"))
        bound = runner.addresses[0]
        self.address = f"{host}:{bound[1]}"
        self.events = child.EventReporter(zmq.Context.instance(), self.config, "http")
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        self.events.send("ready")
        self.log.info("serving HTTP on http://%s (auth %s)", self.address, "on" if config.auth_on else "off")
        reporter = asyncio.get_running_loop().create_task(self._report(stopped))
        await stopped.wait()
        reporter.cancel()
        await runner.cleanup()
        link.close()

    def _refuse_open_door(self) -> None:
        config = self.config.http
        if config.auth_on and not config.loopback and not ApiKeys(self.config.keys_dir).names():
            child.refuse_start(self.config, "http", StartRefused(
                f"http.listen = {config.listen!r} is not a loopback address and there is no API key: nobody "
                "could use it. Add keys with `mcpctl keys api-add NAME` (with a loopback listen, or http off) "
                "and start again"))

    @web.middleware
    async def _answer_errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except HttpError as e:
            response = _error_response(e)
        except MCPDError as e:
            response = _error_response(HttpError.of(e))
        except web.HTTPException as e:   # aiohttp's own: unknown path (404), wrong method (405)
            response = _error_response(HttpError(e.status, e.reason, codes.NOT_FOUND if e.status == 404
                                                 else codes.BAD_REQUEST))
        except (asyncio.CancelledError, ConnectionError):
            raise   # the client is gone: nobody to answer
        except Exception as e:   # noqa: BLE001 - whatever goes wrong, the client gets an answer
            self.log.exception("unexpected failure answering %s %s", request.method, request.path)
            response = _error_response(HttpError(500, f"{type(e).__name__}: {e}", codes.INTERNAL))
        key = str(response.status)
        self.responses[key] = self.responses.get(key, 0) + 1
        return response

    async def _report(self, stopped: asyncio.Event) -> None:
        while True:
            if not child.parent_alive(self.parent_pid):
                stopped.set()
            self.events.send("stats", listen=self.address, auth=self.config.http.auth_on,
                             inflight=self.routes.inflight, responses=dict(self.responses))
            await asyncio.sleep(STATS_INTERVAL_S)


def _error_response(error: HttpError) -> web.Response:
    return web.Response(status=error.status, body=error.json_bytes(), content_type="application/json",
                        headers=error.headers())


def run(config: Config) -> None:
    listener = HttpListener(config)
    uvloop.run(listener.serve())
    listener.log.info("stopped")
