"""A process's inbox in-process: urgent requests go before the lows received ahead of them, never
before a message of another kind received ahead of them."""
from fakes import Clock, Ports, scheduler_of
from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.inbox import Inbox
from mcpd.protocol import codes
from mcpd.protocol.args import InferArgs

URGENT = 3


def dispatch(rid: int, rank: int) -> messages.Dispatch:
    return messages.Dispatch(rid, rid, "t", rank, False, InferArgs(model="risk", inputs=()))


def worker_inbox() -> Inbox:
    return Inbox(messages.Dispatch, lambda dispatch: dispatch.rank >= URGENT)


def handed(inbox: Inbox) -> list:
    out = []
    while inbox:
        message, _ = inbox.pop()
        out.append(message.rid if isinstance(message, messages.Dispatch) else type(message).__name__)
    return out


def fill(inbox: Inbox, *items) -> None:
    for item in items:
        inbox.add(dispatch(*item) if isinstance(item, tuple) else item, [])


def test_an_urgent_dispatch_goes_before_the_lows_received_ahead_of_it_in_order():
    inbox = worker_inbox()
    fill(inbox, (1, 1), (2, 2), (3, URGENT), (4, 1), (5, URGENT + 1))
    assert len(inbox) == 5
    assert handed(inbox) == [3, 5, 1, 2, 4]


def test_no_dispatch_overtakes_a_cancel_or_flush_received_before_it():
    inbox = worker_inbox()
    fill(inbox, (1, 1), messages.Cancel(1, codes.CANCELLED), (2, URGENT), messages.Flush(), (3, URGENT), (4, 1))
    assert handed(inbox) == [1, "Cancel", 2, "Flush", 3, 4]


def test_once_the_barriers_are_handed_on_urgent_dispatches_go_first_again():
    inbox = worker_inbox()
    fill(inbox, (1, 1), messages.Flush())
    assert handed(inbox) == [1, "Flush"]
    fill(inbox, (2, 1), (3, URGENT))
    assert handed(inbox) == [3, 2]


def test_a_slice_handed_on_then_a_new_urgent_arrival_goes_before_the_rest():
    inbox = worker_inbox()
    fill(inbox, *((rid, 1) for rid in range(6)))
    first = [inbox.pop()[0].rid for _ in range(2)]
    fill(inbox, (9, URGENT))
    assert first + handed(inbox) == [0, 1, 9, 2, 3, 4, 5]


def test_the_schedulers_urgent_requests_are_those_of_classes_above_the_default(tmp_path):
    config = from_dict({"server": {"runtime_dir": str(tmp_path)}, "cache": {"enabled": False},
                        "persistence": {"enabled": False}})
    scheduler = scheduler_of(config, Ports(), Clock())
    inbox = Inbox(messages.Request, scheduler.is_urgent)
    for rid, priority in enumerate([None, "low", "high", "normal", "critical", "nonesuch"]):
        inbox.add(messages.Request(rid, rid, "t", priority, None, InferArgs(model="risk", inputs=())), [])
    assert [inbox.pop()[0].rid for _ in range(6)] == [2, 4, 0, 1, 3, 5]
