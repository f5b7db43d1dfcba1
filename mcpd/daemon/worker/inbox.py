"""A handler worker's messages from the scheduler, received but not yet handled, handed on with
the urgent requests first.

The scheduler sends a worker up to two batches' worth of requests at once (handler_lanes.py).
Accepting one (decoding its inputs, preprocess) costs the loop tens of microseconds, so a high
request sent just after a hundred lows would otherwise wait out their acceptance in the socket.
The loop therefore receives everything waiting into the inbox (a decode each), hands on one
message at a time, and receives again every SLICE messages: a Dispatch of `urgent_rank` or above
goes before the lows received ahead of it.

Only past Dispatches: a request may not overtake a Cancel, a Flush (its Flushed promises every
earlier reply was sent) or any other message received before it, so an urgent Dispatch that
arrives behind one of those waits its turn in order. Socket-free.
"""
from __future__ import annotations

from collections import deque

from mcpd.daemon import messages

SLICE = 16   # messages handed on between two receives: a high read within about a millisecond of lows


class Inbox:
    def __init__(self, urgent_rank: int):
        self.urgent_rank = urgent_rank
        self.urgent: deque[tuple[messages.Message, list[bytes]]] = deque()   # they go first, in order
        self.rest: deque[tuple[messages.Message, list[bytes]]] = deque()     # in the order received
        self.barriers = 0   # messages in `rest` that are not Dispatches: no urgent one overtakes them

    def __len__(self) -> int:
        return len(self.urgent) + len(self.rest)

    def add(self, message: messages.Message, payload: list[bytes]) -> None:
        dispatch = isinstance(message, messages.Dispatch)
        if dispatch and message.rank >= self.urgent_rank and not self.barriers:
            self.urgent.append((message, payload))
            return
        self.rest.append((message, payload))
        self.barriers += not dispatch

    def pop(self) -> tuple[messages.Message, list[bytes]]:
        """The next message to handle: an urgent Dispatch first, else the oldest received."""
        if self.urgent:
            return self.urgent.popleft()
        message, payload = self.rest.popleft()
        if not isinstance(message, messages.Dispatch):
            self.barriers -= 1
        return message, payload
