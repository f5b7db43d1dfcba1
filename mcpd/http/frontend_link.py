"""How the HTTP listener, running inside the front-end process, hands requests to the front-end
and gets their replies: in memory, on the same event loop, with no socket in between.

Each request is encoded as a client would send it (docs/PROTOCOL.md sections 2-3) and goes
through the front-end's own checks and admission (`FrontEndCore.admit_local`) as LOCAL_CALLER: an
object, not bytes, so it equals no routing id (a client may set any id it likes, even one that
begins with a zero byte). Replies the front-end would send to it come here instead (`deliver`),
decoded once, into the queue of the request they answer.

A request the HTTP side gives up on (the client disconnected, the handler was cancelled) is
cancelled in the front-end like a client's `cancel`, and forgotten here: its late replies find
no queue and are dropped.
"""
from __future__ import annotations

import asyncio
import itertools

from mcpd.client import replies
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply

LOCAL_CALLER = object()   # where a client's routing id would be; never equal to one


class Call:
    """One daemon request: its replies one at a time, cancelled if left before its final reply.
    `payload` holds the frames that came with the last reply (an infer's outputs)."""

    def __init__(self, link: "FrontendLink", request_id: int, queue: asyncio.Queue):
        self.link, self.request_id, self.queue, self.finished = link, request_id, queue, False
        self.payload: tuple[bytes, ...] = ()

    async def next_reply(self) -> dict:
        reply, self.payload = await self.queue.get()
        if reply.get("kind") != "chunk":
            self.finished = True
            self.link.queues.pop(self.request_id, None)
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
            self.link.cancel(self.request_id)


class FrontendLink:
    def __init__(self, admit):
        """`admit(frames)`: the front-end's admission of one request's frames (raises MCPDError)."""
        self.admit = admit
        self.ids = itertools.count(1)
        self.queues: dict[int, asyncio.Queue] = {}

    async def start(self, op: str, args: dict, header: dict, payload: list[bytes] = ()) -> Call:
        request_id = next(self.ids)
        try:
            frame = wire.encode_request(op, request_id, args, **header)
        except (UnicodeEncodeError, OverflowError) as e:   # JSON allows lone surrogates and huge ints
            raise MCPDError(codes.BAD_REQUEST, f"a value cannot be sent to the daemon: {e}") from None
        queue = self.queues[request_id] = asyncio.Queue()
        self._submit([frame, *payload], request_id)
        return Call(self, request_id, queue)

    async def call(self, op: str, args: dict, header: dict) -> dict:
        call = await self.start(op, args, header)
        try:
            return await call.result()
        finally:
            call.abandon()

    def cancel(self, request_id: int) -> None:
        self.queues.pop(request_id, None)
        self._submit([wire.encode_request("cancel", next(self.ids), {"target": request_id})], None)

    def deliver(self, header: bytes, payload: tuple[bytes, ...] = ()) -> None:
        """A reply the front-end sends to LOCAL_CALLER, with its payload frames."""
        reply = wire.decode_reply(header)
        queue = self.queues.get(reply.get("id"))
        if queue is not None:
            queue.put_nowait((reply, payload))

    def _submit(self, frames: list[bytes], request_id: int | None) -> None:
        try:
            self.admit(frames)
        except MCPDError as e:   # refused at the door (draining, a bad header field): answered at once
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait((wire.decode_reply(wire.error_reply(request_id, ErrorReply.of(e))), ()))

