"""The listener's side of client.ipc: one DEALER (the bundled AsyncClient) shared by every HTTP
request, each request stamped with its tenant, priority and deadline.

A request the HTTP side gives up on (the client disconnected, the handler was cancelled) is
cancelled on the daemon and its remaining replies are drained in the background, so neither
the daemon's work nor this process's reply queue outlives the HTTP request.
"""
from __future__ import annotations

import asyncio

from mcpd.client import replies
from mcpd.client.async_client import AsyncClient
from mcpd.protocol.codes import MCPDError

REPLY_TIMEOUT_S = 3600.0    # the daemon answers every request; this only bounds a lost one
DRAIN_TIMEOUT_S = 30.0


class Call:
    """One daemon request: its replies one at a time, cancelled if left before its final reply."""

    def __init__(self, link: "DaemonLink", request_id: int):
        self.link, self.request_id, self.finished = link, request_id, False

    async def next_reply(self) -> dict:
        reply = await self.link.client.receive(self.request_id, REPLY_TIMEOUT_S)
        self.finished = reply.get("kind") != "chunk"
        return reply

    async def result(self) -> dict:
        """The final result (chunks skipped); MCPDError for an error reply."""
        while True:
            reply = await self.next_reply()
            if self.finished:
                return replies.result_of(reply)

    def abandon(self) -> None:
        if not self.finished:
            self.finished = True
            self.link.background(self.link.cancel(self.request_id))


class DaemonLink:
    def __init__(self, endpoint: str):
        self.client = AsyncClient(endpoint, timeout=REPLY_TIMEOUT_S)
        self.tasks: set[asyncio.Task] = set()

    async def start(self, op: str, args: dict, header: dict) -> Call:
        return Call(self, await self.client.send(op, args, **header))

    async def call(self, op: str, args: dict, header: dict) -> dict:
        call = await self.start(op, args, header)
        try:
            return await call.result()
        finally:
            call.abandon()

    async def cancel(self, request_id: int) -> None:
        """Cancel on the daemon, then read the request's last replies so its queue is freed."""
        try:
            await self.client.cancel(request_id)
            while (await self.client.receive(request_id, DRAIN_TIMEOUT_S)).get("kind") == "chunk":
                pass
        except (MCPDError, KeyError):
            pass   # it ended meanwhile, or the daemon is gone: nothing is left to free

    def background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        await self.client.close()
