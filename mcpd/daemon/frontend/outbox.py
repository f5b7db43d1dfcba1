"""Replies on their way to clients: never dropped, however slowly a client reads.

A plain ROUTER drops a message without a word when the client's pipe is at its high-water mark
(the client stopped reading): a stream's final reply lost that way breaks the one-final promise.
The client socket is therefore ROUTER_MANDATORY, where such a send fails with EAGAIN instead, and the replies
of a client whose pipe is full wait here, in order, until it has room again. ZeroMQ does not say
when one peer's pipe drains, so the front-end calls flush() every few milliseconds (its GUARD_S)
while anything waits.

While they wait, the chunks of one stream merge into its one waiting chunk (text, token ids and
logprobs concatenate: a chunk may carry any number of tokens), and the stream's later chunks are
renumbered so that `seq` still runs 0, 1, 2, ... So a stalled stream holds one chunk and its
final, both bounded by its output. Finals are never merged or dropped.

A client whose waiting replies pass `limit` bytes is over its backlog: send() says so once, and
the front-end then ends that client's requests in flight and refuses new ones (OVERLOADED) until
it reads. What waits for a client that never reads is thus bounded by the limit, the finals of
what it had in flight, and one small error reply per request it keeps sending.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from mcpd.protocol import wire
from mcpd.sockets import NOBLOCK, send_frames


@dataclass
class Waiting:
    rid: int | None
    envelope: tuple[bytes, ...]
    header: bytes
    payload: tuple[bytes, ...]
    chunk: bool

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(frame) for frame in self.payload)

    @property
    def frames(self) -> tuple[tuple[bytes, ...], bytes, tuple[bytes, ...]]:
        """(envelope, header, payload): what Outbox._try sends."""
        return self.envelope, self.header, self.payload


class Backlog:
    """One client's replies that its pipe had no room for, oldest first."""

    def __init__(self):
        self.queue: deque[Waiting] = deque()
        self.nbytes = 0
        self.chunk_of: dict[int, Waiting] = {}   # rid -> its stream's waiting chunk, if any

    def add(self, entry: Waiting) -> bool:
        """Queue the entry, or merge it into its stream's waiting chunk; True if it merged."""
        waiting = self.chunk_of.get(entry.rid) if entry.chunk else None
        if waiting is not None:
            merged = wire.merge_chunks(waiting.header, entry.header)
            self.nbytes += len(merged) - len(waiting.header)
            waiting.header = merged
            return True
        self.queue.append(entry)
        self.nbytes += entry.nbytes
        if entry.chunk:
            self.chunk_of[entry.rid] = entry
        else:
            self.chunk_of.pop(entry.rid, None)   # a final: that stream sends nothing more
        return False

    def pop(self) -> None:
        entry = self.queue.popleft()
        self.nbytes -= entry.nbytes
        if self.chunk_of.get(entry.rid) is entry:
            del self.chunk_of[entry.rid]


class OutboxStats(msgspec.Struct, frozen=True):
    """Replies waiting for clients that do not read: the clients, their replies, those replies' bytes."""
    clients: int
    replies: int
    bytes: int


class Outbox:
    def __init__(self, sock: zmq.Socket, limit: int):
        self.sock, self.limit = sock, limit
        self.backlogs: dict[bytes, Backlog] = {}
        self.merged: dict[int, int] = {}   # rid -> its chunks merged away so far: later seqs move down

    def send(self, identity: bytes, envelope: tuple[bytes, ...], header: bytes, payload=(),
             rid: int | None = None, chunk: bool = False) -> bool:
        """Send a reply now, or queue it behind the client's waiting ones. True when this reply
        takes the client over its backlog limit (said once, until the backlog drains)."""
        shift = self.merged.get(rid, 0) if chunk else self.merged.pop(rid, 0)
        if chunk and shift:
            header = wire.renumber_chunk(header, shift)
        backlog = self.backlogs.get(identity)
        if backlog is None:
            if self._try(identity, envelope, header, payload) is not None:
                return False
            backlog = self.backlogs[identity] = Backlog()
        entry = Waiting(rid, envelope, header, tuple(payload), chunk)
        was_over = backlog.nbytes > self.limit
        if backlog.add(entry):
            self.merged[rid] = shift + 1
        return not was_over and backlog.nbytes > self.limit

    def over_limit(self, identity: bytes) -> bool:
        backlog = self.backlogs.get(identity)
        return backlog is not None and backlog.nbytes > self.limit

    def flush(self) -> None:
        """Send what waits, per client in order, until a client's pipe is full again."""
        for identity in list(self.backlogs):
            backlog = self.backlogs[identity]
            while backlog.queue and (sent := self._try(identity, *backlog.queue[0].frames)) is True:
                backlog.pop()
            if not backlog.queue or sent is False:
                del self.backlogs[identity]

    def forget(self, identity: bytes) -> None:
        """The client's connection closed: nobody will read what waits for it."""
        self.backlogs.pop(identity, None)

    def stats(self) -> OutboxStats:
        return OutboxStats(len(self.backlogs), sum(len(b.queue) for b in self.backlogs.values()),
                           sum(b.nbytes for b in self.backlogs.values()))

    def _try(self, identity: bytes, envelope: tuple[bytes, ...], header: bytes, payload) -> bool | None:
        """True: sent. None: the client's pipe is full. False: the client is gone (dropped)."""
        try:
            send_frames(self.sock, [identity, *envelope, header, *payload], NOBLOCK)
            return True
        except zmq.Again:
            return None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise
