"""How one wake-up of the front-end reads its clients: in slices of SLICE messages. After each
slice what it admitted goes on to the scheduler and the scheduler's replies waiting are taken:
under a flood of requests refused at the door (tens of µs each) a turn of BATCH is milliseconds
of work, which a high request admitted early in it, or the reply of one admitted before, would
otherwise wait out whole. A slice costs a send and a look at the replies' socket, a fraction of
a µs a message. The scheduler's pipe full stops the reading (its pressure goes back to clients)."""
from __future__ import annotations

from typing import Callable

BATCH = 256   # messages one turn takes from a socket before the loop's other readers get theirs (fairness)
SLICE = 16    # client messages taken before what they admitted goes on and the replies are taken


class ClientDrain:
    def __init__(self, take_clients: Callable[[int], int], send_on: Callable[[], bool],
                 take_replies: Callable[[], None]):
        self.take_clients = take_clients   # handles up to that many client messages; how many it did
        self.send_on = send_on             # sends what was admitted; False while the scheduler's pipe is full
        self.take_replies = take_replies   # relays the scheduler's replies waiting now
        self.emptied = False   # the last turn found the clients' socket empty

    def turn(self) -> bool:
        """One turn of reading; True when clients may have more waiting (the caller lets the
        loop's other readers go first, then calls again)."""
        taken, self.emptied = 0, False
        while taken < BATCH and self.send_on():
            count = self.take_clients(SLICE)
            self.emptied = count < SLICE
            if not count:   # none admitted: nothing more to send on (the look after each reply)
                return False
            taken += count
            if not self.send_on() or self.emptied:
                return False
            self.take_replies()
        return taken >= BATCH
