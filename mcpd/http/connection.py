"""One HTTP connection: aiohttp's handler for it, seen through a thin protocol that tells the
connection table (connections.py) when it ends and whether a request is in flight."""
from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp.web_protocol import RequestHandler


class Connection(asyncio.Protocol):
    __slots__ = ("handler", "address", "on_end")

    def __init__(self, handler: RequestHandler, address: str, on_end: Callable[["Connection"], None]):
        self.handler, self.address, self.on_end = handler, address, on_end

    @property
    def idle(self) -> bool:
        """Being served, and no request in flight: none being answered, none parsed and waiting. Read
        from aiohttp's handler rather than tracked again on the per-request path."""
        handler = self.handler
        return handler.transport is not None and not handler._request_in_progress and not handler._messages

    def close(self) -> None:
        self.handler.force_close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.handler.connection_lost(exc)
        self.on_end(self)
