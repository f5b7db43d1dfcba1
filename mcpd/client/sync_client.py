"""The blocking client. One DEALER socket; replies are matched to requests by id, so a stream,
a cancel and other requests can be in flight at once from one thread.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque

import zmq

from mcpd import sockets
from mcpd.client import replies
from mcpd.client.curve import CurveKeys
from mcpd.protocol.results import GenerateChunk, GenerateResult
from mcpd.protocol import wire
from mcpd.protocol.codes import MCPDError


class Client:
    def __init__(self, endpoint: str = replies.DEFAULT_ENDPOINT, timeout: float = 60.0,
                 context: zmq.Context | None = None, tenant: str | None = None, curve: CurveKeys | None = None):
        """`tenant` names the owner of this client's contexts on a daemon without authentication;
        with `curve` keys the daemon takes the tenant from the key (leave `tenant` out)."""
        self.endpoint, self.timeout = endpoint, timeout
        self._tenant = {"tenant": tenant} if tenant else {}
        self._socket = sockets.with_ipv6((context or zmq.Context.instance()).socket(zmq.DEALER))
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._socket)
        self._socket.connect(endpoint)
        # Replies are read with the daemon's own drain and wait (mcpd/sockets.py): an EVENTS check
        # where recv_multipart raises zmq.Again after each message, and one poll of the socket's
        # descriptor where zmq_poll polls it twice and asks EVENTS twice: every streamed token's
        # CPU here is CPU the daemon's decode threads want.
        self._waiter = sockets.Waiter(self._socket)
        self._ids = itertools.count(1)
        self._waiting: set = set()
        self._inbox: dict = defaultdict(deque)

    # -- operations -----------------------------------------------------------------------------

    def ping(self, timeout: float | None = None) -> dict:
        return self.call("ping", {}, timeout)

    def status(self, timeout: float | None = None) -> dict:
        return self.call("status", {}, timeout)

    def cancel(self, request_id) -> bool:
        return self.call("cancel", {"target": request_id})["cancelled"]

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_token_ids: list[int] | None = None, stream: bool = False,
                 timeout: float | None = None, priority: str | None = None, timeout_ms: int | None = None,
                 **params) -> GenerateResult | "Stream":
        """Generate from a prompt, chat messages or token ids. Params: the fields of
        protocol/sampling.py's SamplingParams, and generate's others. `priority` names a class
        (the daemon's default otherwise); `timeout_ms` is the daemon-side deadline (`timeout`, in
        seconds, only bounds this client's wait). With stream=True returns a Stream that yields
        Chunks; otherwise the GenerateResult."""
        args = replies.generate_args(prompt, messages, prompt_token_ids, stream, params)
        request_id = self.send("generate", args, **replies.request_header(priority, timeout_ms))
        if stream:
            return Stream(self, request_id, timeout)
        return replies.generate_result(replies.result_of(self.receive(request_id, timeout)))

    def infer(self, model: str | None, inputs: dict, *, version: str | None = None, outputs: list[str] | None = None,
              context: str | None = None, context_inputs: dict[str, str] | None = None,
              context_append: dict[str, dict] | None = None, timeout: float | None = None,
              priority: str | None = None, timeout_ms: int | None = None, **args):
        """Run a handler model (None: the default model) on named numpy arrays; returns an
        InferResult (client/infer.py) whose `outputs` are named arrays. With `context`, inputs
        the daemon reads from its fields: context_inputs {input: field}, and context_append
        {field: {"input": sent input, "window": rows kept}} (docs/PROTOCOL.md §4 infer).
        `args`: infer's others (routing_key, hints, cache)."""
        from mcpd.client import infer

        sent, frames = infer.request(model, inputs, {"version": version, "outputs": outputs, "context": context,
                                                     "context_inputs": context_inputs,
                                                     "context_append": context_append, **args})
        reply, out = self.call_with_payload("infer", sent, frames, timeout, **replies.request_header(priority, timeout_ms))
        return infer.result(reply, out)

    def call(self, op: str, args: dict, timeout: float | None = None, **header_fields) -> dict:
        """One request, one final reply: its result, or MCPDError with the reply's code."""
        return self.call_with_payload(op, args, (), timeout, **header_fields)[0]

    def call_with_payload(self, op: str, args: dict, payload=(), timeout: float | None = None,
                          **header_fields) -> tuple[dict, list[bytes]]:
        """Like call, with payload frames both ways: (result, reply payload frames)."""
        header, frames = self._receive(self.send(op, args, payload, **header_fields), timeout)
        return replies.result_of(header), frames

    def context(self, context_id: str, create: bool = True):
        """A ContextMirror: a local copy of the context that syncs by deltas."""
        from mcpd.client.context_mirror import ContextMirror
        return ContextMirror(self, context_id, create)

    # -- framing --------------------------------------------------------------------------------

    def send(self, op: str, args: dict, payload: list[bytes] = (), **header_fields):
        request_id = next(self._ids)
        self._waiting.add(request_id)
        header = wire.encode_request(op, request_id, args, **self._tenant, **header_fields)
        self._socket.send_multipart([header, *payload])
        return request_id

    def receive(self, request_id, timeout: float | None = None) -> dict:
        """The next reply (chunk or final) for request_id. Raises MCPDError(TIMEOUT) after timeout
        seconds; a timed-out generate is cancelled on the daemon so it stops using a worker."""
        return self._receive(request_id, timeout)[0]

    def _receive(self, request_id, timeout: float | None) -> tuple[dict, list[bytes]]:
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        inbox = self._inbox[request_id]
        while not inbox:
            if sockets.drain(self._socket, self._take):
                continue   # what came may be another request's
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._waiter.wait(remaining * 1000):
                self._abandon(request_id)
                raise replies.timeout_error(request_id, seconds)
        reply, frames = inbox.popleft()
        if reply.get("kind") != "chunk":
            self._forget(request_id)
        return reply, frames

    def _take(self, frames: list[bytes]) -> None:
        reply = wire.decode_reply(frames[0])
        owner = replies.owner_of(reply, self._waiting)
        if owner is not None:
            self._inbox[owner].append((reply, frames[1:]))

    def _abandon(self, request_id) -> None:
        self._forget(request_id)
        cancel_id = next(self._ids)   # fire and forget: its reply is dropped as unknown
        try:   # with no connection (a refused CURVE handshake) a blocking send would wait forever
            self._socket.send_multipart([wire.encode_request("cancel", cancel_id, {"target": request_id})], zmq.NOBLOCK)
        except zmq.Again:
            pass   # no connection to cancel on: the request went nowhere either

    def _forget(self, request_id) -> None:
        self._waiting.discard(request_id)
        self._inbox.pop(request_id, None)

    def close(self) -> None:
        self._socket.close(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """Iterate for Chunks; afterwards `.result` holds the GenerateResult. `.cancel()` stops it."""

    def __init__(self, client: Client, request_id, timeout: float | None):
        self.client, self.request_id, self.timeout = client, request_id, timeout
        self.result: GenerateResult | None = None

    def __iter__(self):
        while self.result is None:
            reply = self.client.receive(self.request_id, self.timeout)
            if reply.get("kind") == "chunk":
                yield replies.chunk_of(reply)
            else:
                self.result = replies.generate_result(replies.result_of(reply))

    def cancel(self) -> bool:
        return self.client.cancel(self.request_id)

    def text(self) -> str:
        """Consume the stream and return the whole text."""
        return "".join(chunk.text for chunk in self)


__all__ = ["Client", "Stream", "GenerateChunk", "GenerateResult", "MCPDError"]
