"""The front-end's reading of its clients in-process (client_drain.py), wired to the real core
and the real batch to the scheduler as process.py wires them; the sockets are lists. Under a
flood of requests the door refuses, what the core admitted goes on, and the replies waiting are
relayed, after a slice of the flood, not after the whole turn."""
import logging

import pytest
import zmq

from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.batch import Batch
from mcpd.daemon.frontend.client_drain import BATCH, SLICE, ClientDrain
from mcpd.daemon.frontend.core import FrontEndCore
from mcpd.protocol import wire
from fakes import Clock, Ports

FIRST_RID = 1000
CLIENT = b"\x00client"


class Loop:
    """One front-end's sockets as lists: the clients' messages waiting, the scheduler's pipe
    (`room` sends before it is full; None: never) and its replies waiting; `handled` counts the
    client messages the core has had, and each send and relay notes it."""

    def __init__(self):
        self.core = FrontEndCore(from_dict({}), logging.getLogger("test"), Ports(), Clock(), first_rid=FIRST_RID)
        self.batch = Batch(self._send)
        self.core.ports.to_scheduler = lambda message, *payload: self.batch.add(messages.encode(message, *payload))
        self.waiting: list[list[bytes]] = []
        self.replies: list[tuple[messages.Message, list[bytes]]] = []
        self.handled = 0
        self.sent_at: dict[int, int] = {}   # request id -> client messages handled when it went to the scheduler
        self.relayed_at: dict[int, int] = {}   # request id -> the same when its reply reached its client
        self.room: int | None = None
        self.drain = ClientDrain(self.take_clients, self.batch.flush, self.take_replies)
        self.refused_at: list[int] = []   # client messages handled when each refusal reached its client
        to_client = self.core.ports.to_client
        self.core.ports.to_client = lambda *reply, **named: self.refused_at.append(self.handled) or to_client(*reply, **named)

    def client_sends(self, request_id: int, priority: str) -> None:
        self.waiting.append([wire.encode_request("generate", request_id, {"prompt": "hi", "max_tokens": 2},
                                                 priority=priority)])

    def take_clients(self, limit: int) -> int:
        taken, self.waiting = self.waiting[:limit], self.waiting[limit:]
        for frames in taken:
            self.core.on_client(CLIENT, frames, [len(frame) for frame in frames], None)
            self.handled += 1
        self.core.send_refusals()   # as process.py's _take_clients
        return len(taken)

    def take_replies(self) -> None:
        for reply in self.replies:
            self.core.on_scheduler(*reply)
        self.replies = []
        for _, _, header, _ in self.core.ports.clients:
            if header.get("kind") == "ok":
                self.relayed_at.setdefault(header["id"], self.handled)

    def _send(self, frames: list[bytes]) -> None:
        if self.room is not None:
            if not self.room:
                raise zmq.Again()
            self.room -= 1
        for message in messages.unpack(frames):
            request = messages.decode(message)[0]
            self.sent_at[request.request_id] = self.handled


@pytest.fixture
def loop():
    loop = Loop()
    loop.core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])   # the door refuses every low
    return loop


def flood(loop: Loop, lows: int, first_id: int = 100) -> None:
    for request_id in range(first_id, first_id + lows):
        loop.client_sends(request_id, "low")


def test_a_request_admitted_early_in_a_flood_goes_to_the_scheduler_after_its_slice_not_the_turn(loop):
    loop.client_sends(1, "high")
    flood(loop, BATCH - 1)
    assert loop.drain.turn()   # a whole turn taken: more may wait
    assert loop.sent_at == {1: SLICE} and SLICE < BATCH
    assert loop.handled == BATCH


def test_a_reply_waiting_reaches_its_client_after_the_slice_in_hand_not_the_turn(loop):
    loop.client_sends(1, "high")
    loop.drain.turn()
    final = wire.ok_reply(1, {"text": "ok"})
    loop.replies.append((messages.Final(FIRST_RID, None), [final]))   # the scheduler answered meanwhile
    flood(loop, BATCH)
    loop.drain.turn()
    assert loop.relayed_at == {1: 1 + SLICE} and SLICE < BATCH


def test_a_flood_shorter_than_a_slice_ends_the_turn_with_its_admitted_sent(loop):
    flood(loop, SLICE - 2)
    loop.client_sends(1, "high")
    assert not loop.drain.turn()
    assert loop.sent_at == {1: SLICE - 1} and loop.waiting == []


def test_clients_are_not_read_while_the_schedulers_pipe_is_full_and_reading_stops_when_it_fills(loop):
    loop.room = 0
    loop.client_sends(1, "high")
    flood(loop, 2 * SLICE)
    assert not loop.drain.turn()
    assert loop.handled == SLICE and loop.sent_at == {}   # the slice whose send failed, then nothing more
    assert not loop.drain.turn()
    assert loop.handled == SLICE   # still full: nobody read
    loop.room = None
    assert not loop.drain.turn()
    assert loop.sent_at == {1: SLICE} and loop.handled == 2 * SLICE + 1


def test_a_slices_refusals_reach_their_client_together_once_the_slice_is_read(loop):
    flood(loop, SLICE + 2)
    assert not loop.drain.turn()
    assert loop.refused_at == [SLICE] * SLICE + [SLICE + 2] * 2
    assert [header["id"] for _, _, header, _ in loop.core.ports.clients] == list(range(100, 100 + SLICE + 2))
