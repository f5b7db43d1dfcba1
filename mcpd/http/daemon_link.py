"""The listener's side of client.ipc: one DEALER shared by every HTTP request, each request
stamped with its tenant, priority and deadline (docs/PROTOCOL.md sections 2-3).

Not the bundled AsyncClient: zmq.asyncio's futures and reader task cost about 0.3 ms a round
trip here (a ping: 0.6 ms against 0.29 ms for a plain socket), most of what HTTP may add to a
1-token request. The socket is a plain one whose descriptor the event loop watches, drained
until empty on every wake-up (ZeroMQ's descriptor is edge-triggered: after every send too), and
each reply goes straight to its request's queue.

A request the HTTP side gives up on (the client disconnected, the handler was cancelled) is
cancelled on the daemon and forgotten here: its late replies find no queue and are dropped.
"""
from __future__ import annotations

import asyncio
import itertools

import zmq

from mcpd.client import replies
from mcpd.protocol import codes, wire

REPLY_TIMEOUT_S = 3600.0    # the daemon answers every request; this only bounds a lost one
SEND_RETRY_S = 0.001        # the pipe to the front-end is full (it is not reading): try again
LOST = {"kind": "error", "code": codes.TIMEOUT, "message": "no reply from the daemon"}


class Call:
    """One daemon request: its replies one at a time, cancelled if left before its final reply."""

    def __init__(self, link: "DaemonLink", request_id: int, queue: asyncio.Queue):
        self.link, self.request_id, self.queue, self.finished = link, request_id, queue, False

    async def next_reply(self) -> dict:
        reply = await self.queue.get()
        if reply.get("kind") != "chunk":
            self.finished = True
            self.link.forget(self.request_id)
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


class DaemonLink:
    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ids = itertools.count(1)
        self.queues: dict[int, asyncio.Queue] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.socket.getsockopt(zmq.FD), self._drain)

    async def start(self, op: str, args: dict, header: dict) -> Call:
        request_id = next(self.ids)
        queue = self.queues[request_id] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.timers[request_id] = loop.call_later(REPLY_TIMEOUT_S, queue.put_nowait, LOST)
        await self._send(wire.encode_request(op, request_id, args, **header))
        return Call(self, request_id, queue)

    async def call(self, op: str, args: dict, header: dict) -> dict:
        call = await self.start(op, args, header)
        try:
            return await call.result()
        finally:
            call.abandon()

    def cancel(self, request_id: int) -> None:
        """Stop the request on the daemon (best effort: the front-end also cancels a request
        whose connection closes) and drop what else arrives for it."""
        self.forget(request_id)
        try:
            self.socket.send(wire.encode_request("cancel", next(self.ids), {"target": request_id}), zmq.NOBLOCK)
        except zmq.Again:
            pass   # the front-end is not reading; nothing better to do than leave it to the deadline
        self._drain()

    def forget(self, request_id: int) -> None:
        self.queues.pop(request_id, None)
        timer = self.timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    async def _send(self, frame: bytes) -> None:
        while True:
            try:
                self.socket.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                await asyncio.sleep(SEND_RETRY_S)
        self._drain()

    def _drain(self) -> None:
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
            try:
                reply = wire.decode_reply(frames[0])
            except Exception:   # noqa: BLE001 - cannot happen from our front-end; never let it stop the loop
                continue
            queue = self.queues.get(reply.get("id"))
            if queue is not None:
                queue.put_nowait(reply)

    def close(self) -> None:
        self.context.destroy(linger=0)

