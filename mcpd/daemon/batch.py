"""A batch: the messages one turn of a process's loop has for one socket, sent together.

Sending a ZeroMQ message between processes costs more than everything Python does with a
`ping`: the send wakes the sender's I/O thread, whose write wakes the receiver's I/O thread,
which wakes the receiving loop.
Held for the rest of the turn and sent as one (messages.pack), N messages cost those wake-ups
once. A turn is short (one drain of a socket, or one engine step), and a loop flushes before it
blocks, so nothing waits across an idle moment; a lone message goes as itself, so a request that
has the daemon to itself pays nothing for this.

A batch stays under MAX_MESSAGES and MAX_BYTES (a longer hold goes as several), so the socket's
high-water mark still bounds what waits in its pipe: at most what it bounds without batches (each
message may be up to limits.max_message_bytes). A `send` that raises zmq.Again (a full pipe,
with NOBLOCK) keeps what it could not send, in order, for the next flush.
"""
from __future__ import annotations

from typing import Callable

import zmq

from mcpd.daemon import messages

MAX_MESSAGES = 256
MAX_BYTES = 1 << 20


class Batch:
    def __init__(self, send: Callable[[list[bytes]], None]):
        self.send = send
        self.held: list[list[bytes]] = []

    def add(self, frames: list[bytes]) -> None:
        self.held.append(frames)

    def flush(self) -> bool:
        """Send everything held; False if the pipe filled first (the rest stays held)."""
        while self.held:
            count = self._next_count()
            try:
                self.send(self.held[0] if count == 1 else messages.pack(self.held[:count]))
            except zmq.Again:
                return False
            del self.held[:count]
        return True

    def _next_count(self) -> int:
        """How many of the held messages, from the first, go in the next batch (at least one)."""
        if len(self.held) == 1:   # a request alone (a ping's every hop): no sizes to add up
            return 1
        total = 0
        for count, frames in enumerate(self.held[:MAX_MESSAGES]):
            total += sum(len(frame) for frame in frames)
            if total > MAX_BYTES and count:
                return count
        return min(len(self.held), MAX_MESSAGES)


def each_message(handle: Callable[[messages.Message, list[bytes]], None]) -> Callable[[list[bytes]], None]:
    """A drain handler that hands `handle` every message a receive brought (one, or a batch's),
    decoded: the typed message and its payload frames. The processes decode; their cores take types."""
    def take(frames: list[bytes]) -> None:
        for message in messages.unpack(frames):
            handle(*messages.decode(message))
    return take


def each_routed_message(handle: Callable[[bytes, messages.Message, list[bytes]], None]) -> Callable[[list[bytes]], None]:
    """each_message for a ROUTER's receive: the routing id first, then a message or a batch; each
    message goes to `handle` decoded, behind the routing id."""
    def take(frames: list[bytes]) -> None:
        identity = frames[0]
        for message in messages.unpack(frames[1:]):
            handle(identity, *messages.decode(message))
    return take
