"""Which tenants use an engine now: those with a sequence in it, and those that sent one lately.

A tenant whose requests are short (one token, one step) is in the engine only for a step at a
time; between two of them it still counts as active for ACTIVE_S, so the engine keeps its steps
short for the next one rather than for none (Engine.most_decodes).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

ACTIVE_S = 1.0   # a tenant's last request this recent: it is active, and likely to send another


class ActiveTenants:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.live: dict[str, int] = {}   # tenant -> its sequences in the engine
        # tenant -> its last request's time, oldest first: those past ACTIVE_S leave from the front,
        # so a client naming a new tenant for every request cannot grow it beyond a second's worth.
        self.last_arrival: OrderedDict[str, float] = OrderedDict()

    def arrived(self, tenant: str) -> None:
        self.live[tenant] = self.live.get(tenant, 0) + 1
        self.last_arrival[tenant] = self.clock()
        self.last_arrival.move_to_end(tenant)

    def left(self, tenant: str) -> None:
        if (count := self.live.pop(tenant) - 1) > 0:
            self.live[tenant] = count

    def several(self) -> bool:
        """Whether more than one tenant is active."""
        since = self.clock() - ACTIVE_S
        while self.last_arrival and next(iter(self.last_arrival.values())) < since:
            self.last_arrival.popitem(last=False)
        return len(self.live) > 1 or len(self.live.keys() | self.last_arrival.keys()) > 1
