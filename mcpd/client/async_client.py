"""The asyncio client: one DEALER socket, one reader task that hands each reply to the queue of
the request it answers, so any number of coroutines can share a client.
"""
from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from mcpd import sockets
from mcpd.client import replies
from mcpd.client.curve import CurveKeys
from mcpd.protocol.results import GenerateChunk, GenerateResult
from mcpd.protocol import wire


class AsyncClient:
    def __init__(self, endpoint: str = replies.DEFAULT_ENDPOINT, timeout: float = 60.0, tenant: str | None = None,
                 curve: CurveKeys | None = None):
        """Generation, infer and the other ops but contexts' data frames (those need `Client`).
        `tenant` and `curve` as for `Client`."""
        self.endpoint, self.timeout = endpoint, timeout
        self._tenant = {"tenant": tenant} if tenant else {}
        self._context = zmq.asyncio.Context()
        self._socket = sockets.with_ipv6(self._context.socket(zmq.DEALER))
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._socket)
        self._socket.connect(endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def ping(self, timeout: float | None = None) -> dict:
        return await self.call("ping", {}, timeout)

    async def status(self, timeout: float | None = None) -> dict:
        return await self.call("status", {}, timeout)

    async def cancel(self, request_id) -> bool:
        return (await self.call("cancel", {"target": request_id}))["cancelled"]

    async def generate(self, prompt: str | None = None, *, messages=None, prompt_token_ids=None,
                       timeout: float | None = None, priority: str | None = None, timeout_ms: int | None = None,
                       **params) -> GenerateResult:
        """As Client.generate, without stream (use `stream()`)."""
        args = replies.generate_args(prompt, messages, prompt_token_ids, False, params)
        request_id = await self.send("generate", args, **replies.request_header(priority, timeout_ms))
        return replies.generate_result(replies.result_of(await self.receive(request_id, timeout)))

    async def stream(self, prompt: str | None = None, *, messages=None, prompt_token_ids=None,
                     timeout: float | None = None, priority: str | None = None, timeout_ms: int | None = None,
                     **params):
        """Async iterator of Chunks; the final GenerateResult is not yielded (chunks carry it all)."""
        args = replies.generate_args(prompt, messages, prompt_token_ids, True, params)
        request_id = await self.send("generate", args, **replies.request_header(priority, timeout_ms))
        while True:
            reply = await self.receive(request_id, timeout)
            if reply.get("kind") != "chunk":
                replies.result_of(reply)   # raises on error
                return
            yield replies.chunk_of(reply)

    async def infer(self, model: str | None, inputs: dict, *, version: str | None = None,
                    outputs: list[str] | None = None, timeout: float | None = None, priority: str | None = None,
                    timeout_ms: int | None = None, **args):
        """As Client.infer."""
        from mcpd.client import infer

        sent, frames = infer.request(model, inputs, {"version": version, "outputs": outputs, **args})
        request_id = await self.send("infer", sent, frames, **replies.request_header(priority, timeout_ms))
        reply, out = await self._receive(request_id, timeout)
        return infer.result(replies.result_of(reply), out)

    async def call(self, op: str, args: dict, timeout: float | None = None) -> dict:
        return replies.result_of(await self.receive(await self.send(op, args), timeout))

    async def send(self, op: str, args: dict, payload=(), **header_fields) -> int:
        self._ensure_reader()
        request_id = next(self._ids)
        self._queues[request_id] = asyncio.Queue()
        await self._socket.send_multipart([wire.encode_request(op, request_id, args, **self._tenant, **header_fields),
                                           *payload])
        return request_id

    async def receive(self, request_id: int, timeout: float | None = None) -> dict:
        return (await self._receive(request_id, timeout))[0]

    async def _receive(self, request_id: int, timeout: float | None) -> tuple[dict, list[bytes]]:
        """The next reply for request_id and its payload frames."""
        seconds = self.timeout if timeout is None else timeout
        try:
            reply = await asyncio.wait_for(self._queues[request_id].get(), seconds)
        except asyncio.TimeoutError:
            self._queues.pop(request_id, None)
            try:   # with no connection (a refused CURVE handshake) the send would wait forever
                await self._socket.send_multipart([wire.encode_request("cancel", next(self._ids), {"target": request_id})],
                                                  zmq.NOBLOCK)
            except zmq.Again:
                pass   # no connection to cancel on: the request went nowhere either
            raise replies.timeout_error(request_id, seconds) from None
        if reply[0].get("kind") != "chunk":
            self._queues.pop(request_id, None)
        return reply

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            reply = wire.decode_reply(frames[0])
            queue = self._queues.get(replies.owner_of(reply, self._queues))
            if queue is not None:
                queue.put_nowait((reply, frames[1:]))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(0)
        self._context.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "GenerateChunk", "GenerateResult"]
