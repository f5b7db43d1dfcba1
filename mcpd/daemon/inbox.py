"""A process's messages received but not yet handled, handed on with the urgent requests first:
the scheduler's from the front-end (Requests) and a handler worker's from the scheduler
(Dispatches).

Under a flood, a process's socket holds hundreds of low requests, and handling one costs tens of
microseconds (the scheduler's admission, a handler worker's decoding and preprocess), so a high
request sent just after them would wait out all of them there. The loop therefore receives
everything waiting into the inbox (a decode each), hands on SLICE messages, and receives again:
a request the owner calls urgent goes before the requests received ahead of it.

Only past requests: a request may not overtake a Cancel, a Flush (its Flushed promises every
earlier reply was sent) or any other message received before it, so an urgent request that
arrives behind one of those waits its turn in order. Socket-free.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from mcpd.daemon import messages

SLICE = 16   # messages handed on between two receives: a high read within about a millisecond of lows


class Inbox:
    def __init__(self, request: type[messages.Message], is_urgent: Callable[[messages.Message], bool]):
        self.request, self.is_urgent = request, is_urgent   # the kind that may overtake, and which of them do
        self.urgent: deque[tuple[messages.Message, list[bytes]]] = deque()   # they go first, in order
        self.rest: deque[tuple[messages.Message, list[bytes]]] = deque()     # in the order received
        self.barriers = 0   # messages in `rest` that are not requests: no urgent one overtakes them

    def __len__(self) -> int:
        return len(self.urgent) + len(self.rest)

    def add(self, message: messages.Message, payload: list[bytes]) -> None:
        request = isinstance(message, self.request)
        if request and not self.barriers and self.is_urgent(message):
            self.urgent.append((message, payload))
            return
        self.rest.append((message, payload))
        self.barriers += not request

    def pop(self) -> tuple[messages.Message, list[bytes]]:
        """The next message to handle: an urgent request first, else the oldest received."""
        if self.urgent:
            return self.urgent.popleft()
        message, payload = self.rest.popleft()
        if not isinstance(message, self.request):
            self.barriers -= 1
        return message, payload
