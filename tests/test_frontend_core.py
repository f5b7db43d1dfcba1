"""The front-end's core in-process: clients' messages, the HTTP listener's requests, the
scheduler's typed messages and a clock in; replies and typed messages out, no sockets. What
crosses processes (real clients, backlogs on real pipes, the scheduler's restart) stays with the
daemon tests (test_daemon.py, test_hostile_input.py, test_overload.py, test_http.py)."""
import logging

import msgpack
import pytest

from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.frontend import shed_header
from mcpd.daemon.frontend.core import FrontEndCore
from mcpd.daemon.frontend.shed_table import HOLD_S
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.args import GenerateArgs, PingArgs
from fakes import Clock, Ports

FIRST_RID = 1000
MAX_MESSAGE_BYTES = 1 << 16
CLIENT, OTHER = b"\x00client", b"\x00other"


@pytest.fixture
def core():
    config = from_dict({"limits": {"max_message_bytes": MAX_MESSAGE_BYTES, "max_header_bytes": MAX_MESSAGE_BYTES}})
    return FrontEndCore(config, logging.getLogger("test"), Ports(), Clock(), first_rid=FIRST_RID)


def send(core, identity: bytes, op: str, request_id, args: dict, *payload: bytes, tenant=None, **header) -> None:
    """A client's message as the process reads it: frames past the routing id, their sizes; alone
    in its slice, so a refusal it gets is sent at once."""
    frames = [wire.encode_request(op, request_id, args, **header), *payload]
    core.on_client(identity, frames, [len(frame) for frame in frames], tenant)
    core.send_refusals()


def generate(core, identity: bytes, request_id, **header) -> None:
    send(core, identity, "generate", request_id, {"prompt": "hi", "max_tokens": 2}, **header)


def admitted(core) -> list[messages.Request]:
    return [m for m, _ in core.ports.scheduler if isinstance(m, messages.Request)]


def cancels(core) -> list[messages.Cancel]:
    return [m for m, _ in core.ports.scheduler if isinstance(m, messages.Cancel)]


def replies(core) -> list[tuple[bytes, dict]]:
    return [(identity, header) for identity, _, header, _ in core.ports.clients]


def final(rid: int, request_id, code: str | None = None) -> tuple[messages.Final, list[bytes]]:
    header = wire.error_reply(request_id, code, "failed") if code else wire.ok_reply(request_id, {"text": "ok"})
    return messages.Final(rid, code), [header]


@pytest.mark.parametrize("op, args, payload, tenant, code, answered_id", [
    ("generate", {"prompt": "hi", "max_tokens": -1}, (), None, codes.BAD_REQUEST, 7),
    ("nosuch", {}, (), None, codes.UNKNOWN_OP, 7),
    ("ping", {}, (b"x" * MAX_MESSAGE_BYTES,), None, codes.TOO_LARGE, None),   # refused before its header is read
    ("ping", {}, (), "", codes.UNAUTHORIZED, 7),   # CURVE on: this connection's key no longer allowed
])
def test_a_request_that_fails_a_check_is_answered_with_its_code_and_never_reaches_the_scheduler(
        core, op, args, payload, tenant, code, answered_id):
    send(core, CLIENT, op, 7, args, *payload, tenant=tenant)
    assert [(identity, header["id"], header["code"]) for identity, header in replies(core)] == \
        [(CLIENT, answered_id, code)]
    assert core.ports.scheduler == [] and core.pending == {} and core.errors == {code: 1}


@pytest.mark.parametrize("op, args", [
    ("ping", {b"x": 1}), ("generate", {"prompt": "hi", b"max_tokens": 2}), ("ping", {b"x": 1, "nosuch": 2})])
def test_an_argument_name_that_is_not_a_string_is_refused_as_such_whatever_else_the_args_hold(core, op, args):
    send(core, CLIENT, op, 7, args)
    [(_, header)] = replies(core)
    assert (header["code"], header["message"]) == (codes.BAD_REQUEST, f"{op}: argument names must be strings")
    assert core.ports.scheduler == []


def test_an_admitted_request_goes_to_the_scheduler_typed_with_a_fresh_rid_and_waits_for_its_reply(core):
    generate(core, CLIENT, 1)
    send(core, CLIENT, "ping", 2, {})
    requests = admitted(core)
    assert [(m.rid, m.request_id, type(m.args)) for m in requests] == \
        [(FIRST_RID, 1, GenerateArgs), (FIRST_RID + 1, 2, PingArgs)]
    assert requests[0].args.sampling.max_tokens == 2
    assert replies(core) == [] and sorted(core.pending) == [FIRST_RID, FIRST_RID + 1]


def test_a_request_id_in_flight_is_refused_conflict_for_its_client_only(core):
    generate(core, CLIENT, 5)
    generate(core, CLIENT, 5)
    generate(core, OTHER, 5)   # another client's ids are its own
    assert [m.request_id for m in admitted(core)] == [5, 5]
    assert [(identity, header["code"]) for identity, header in replies(core)] == [(CLIENT, codes.CONFLICT)]


def test_a_client_over_its_backlog_is_refused_and_one_that_goes_over_has_its_requests_ended(core):
    generate(core, CLIENT, 1)
    generate(core, CLIENT, 2)
    generate(core, OTHER, 1)
    core.ports.going_over.add(CLIENT)
    chunk_header = wire.chunk_reply(1, 0, {"text": "a", "token_ids": [1]})
    core.on_scheduler(messages.Chunk(FIRST_RID), [chunk_header])   # this reply takes it over its limit
    assert sorted((m.rid, m.code) for m in cancels(core)) == \
        [(FIRST_RID, codes.OVERLOADED), (FIRST_RID + 1, codes.OVERLOADED)]
    core.ports.over_backlog.add(CLIENT)
    generate(core, CLIENT, 3)
    generate(core, OTHER, 3)
    refusals = [(identity, header) for identity, header in replies(core) if header["kind"] == "error"]
    assert [(identity, header["id"], header["code"]) for identity, header in refusals] == [(CLIENT, 3, codes.OVERLOADED)]
    assert refusals[0][1]["retry_after_ms"] > 0 and [m.request_id for m in admitted(core)] == [1, 2, 1, 3]


def test_chunks_and_the_final_reach_the_requests_client_with_its_envelope_and_the_final_forgets_it(core):
    frames = [b"", wire.encode_request("generate", 9, {"prompt": "hi", "max_tokens": 2, "stream": True})]
    core.on_client(CLIENT, frames, [len(frame) for frame in frames], None)   # a REQ client: its delimiter
    chunk_header = wire.chunk_reply(9, 0, {"text": "a", "token_ids": [1]})
    core.on_scheduler(messages.Chunk(FIRST_RID), [chunk_header, b"payload"])
    core.on_scheduler(*final(FIRST_RID, 9))
    core.on_scheduler(messages.Chunk(FIRST_RID), [chunk_header])   # late: its request was answered
    assert [(identity, envelope, header["kind"], payload) for identity, envelope, header, payload
            in core.ports.clients] == [(CLIENT, (b"",), "chunk", (b"payload",)), (CLIENT, (b"",), "ok", ())]
    assert core.pending == {} and core.rid_of == {} and core.served == 1
    generate(core, CLIENT, 9)   # its id is free again
    assert [m.request_id for m in admitted(core)] == [9, 9]


def test_a_cancel_reaches_the_scheduler_for_the_callers_own_request_only(core):
    generate(core, CLIENT, 1)
    send(core, OTHER, "cancel", 2, {"target": 1})
    send(core, CLIENT, "cancel", 3, {"target": 1})
    assert [(m.rid, m.code) for m in cancels(core)] == [(FIRST_RID, codes.CANCELLED)]
    assert [(identity, header["result"]) for identity, header in replies(core)] == \
        [(OTHER, {"cancelled": False}), (CLIENT, {"cancelled": True})]


def test_a_gone_clients_requests_are_cancelled_and_the_others_kept(core):
    generate(core, CLIENT, 1)
    generate(core, OTHER, 1)
    core.client_gone(CLIENT)
    assert [(m.rid, m.code) for m in cancels(core)] == [(FIRST_RID, codes.CANCELLED)]


def test_draining_refuses_new_work_answers_ping_and_is_drained_once_nothing_is_in_flight(core):
    generate(core, CLIENT, 1)
    core.on_scheduler(messages.Drain(), [])
    generate(core, CLIENT, 2)
    send(core, CLIENT, "ping", 3, {})
    assert [(header["id"], header["code"]) for _, header in replies(core)] == [(2, codes.UNAVAILABLE)]
    assert [m.request_id for m in admitted(core)] == [1, 3]
    core.on_scheduler(*final(FIRST_RID, 1))
    assert not core.drained   # the ping is still in flight
    core.on_scheduler(*final(FIRST_RID + 1, 3))
    assert core.drained and core.stats()["draining"]
    core.on_scheduler(messages.Resume(), [])
    generate(core, CLIENT, 4)
    assert not core.drained and [m.request_id for m in admitted(core)] == [1, 3, 4]


def test_a_lost_scheduler_answers_every_request_in_flight_unavailable(core):
    generate(core, CLIENT, 1)
    generate(core, OTHER, 2)
    core.admit_local([wire.encode_request("ping", 3, {})])
    core.on_scheduler(messages.SchedulerLost(), [])
    assert sorted((identity, header["id"], header["code"]) for identity, header in replies(core)) == \
        [(CLIENT, 1, codes.UNAVAILABLE), (OTHER, 2, codes.UNAVAILABLE)]
    assert [(header["id"], header["code"]) for header, _ in core.ports.local] == [(3, codes.UNAVAILABLE)]
    assert core.pending == {} and core.rid_of == {} and core.errors == {codes.UNAVAILABLE: 3}


def test_the_http_listeners_requests_share_no_routing_id_with_any_client(core):
    """The listener's caller is an object: no client's routing id equals it, whatever bytes it
    picks, so neither can take the other's request ids, cancel, or replies."""
    for identity in (CLIENT, b"", b"local", b"\x00\x00\x00\x00\x01"):
        generate(core, identity, 1)
    core.admit_local([wire.encode_request("generate", 1, {"prompt": "hi", "max_tokens": 2})])
    assert [m.request_id for m in admitted(core)] == [1] * 5 and replies(core) == []
    send(core, CLIENT, "cancel", 2, {"target": 1})
    local_rid = admitted(core)[-1].rid
    assert local_rid not in [m.rid for m in cancels(core)]
    core.on_scheduler(*final(local_rid, 1))
    assert [header["kind"] for header, _ in core.ports.local] == ["ok"]
    assert [header["id"] for _, header in replies(core)] == [2]   # only CLIENT's cancel answer


def test_a_local_request_refused_at_the_door_raises_its_code_and_is_counted(core):
    core.on_scheduler(messages.Drain(), [])
    with pytest.raises(MCPDError) as refused:
        core.admit_local([wire.encode_request("generate", 1, {"prompt": "hi", "max_tokens": 2})])
    assert refused.value.code == codes.UNAVAILABLE and core.errors == {codes.UNAVAILABLE: 1}
    assert admitted(core) == [] and core.ports.local == []


def test_the_status_report_lists_the_oldest_requests_in_flight_by_the_clock(core):
    generate(core, CLIENT, 1)
    core.clock.now += 2.0
    send(core, CLIENT, "ping", 2, {})
    core.clock.now += 0.5
    slowest = core.stats()["slowest"]
    assert [(row.op, row.age_ms) for row in slowest] == [("generate", 2500.0), ("ping", 500.0)]


def test_a_flushed_note_is_passed_on_to_the_scheduler(core):
    core.on_scheduler(messages.Flushed(2), [])
    assert [m for m, _ in core.ports.scheduler] == [messages.Flushed(2)]


def test_a_request_of_a_class_above_the_default_goes_to_the_scheduler_at_once(core):
    """Admitted requests wait for the end of the front-end's turn to go on together, but one of a
    class above the default is sent as soon as it is admitted, with what was held before it."""
    generate(core, CLIENT, 1, priority="low")
    generate(core, CLIENT, 2)   # the default class, normal
    generate(core, CLIENT, 3, priority="high")
    generate(core, CLIENT, 4, priority="low")
    generate(core, CLIENT, 5, priority="critical")
    assert [m.request_id for m in admitted(core)] == [1, 2, 3, 4, 5]
    assert core.ports.scheduler_flushed_at == [3, 5]


def test_a_shed_class_is_refused_at_the_door_unforwarded_for_its_lease_and_other_work_passes(core):
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])   # none of it kept in flight
    generate(core, CLIENT, 1, priority="low")
    generate(core, CLIENT, 2, priority="high")
    generate(core, CLIENT, 3)   # the default class, normal
    send(core, CLIENT, "ping", 4, {}, priority="low")   # only generate and infer are shed
    assert [(header["id"], header["code"], header["retry_after_ms"]) for _, header in replies(core)] == \
        [(1, codes.OVERLOADED, 250)]
    assert [m.request_id for m in admitted(core)] == [2, 3, 4]
    assert all(m.received == core.clock.now for m in admitted(core))   # the scheduler's measure of the wait
    core.clock.now += 1.0   # the lease ran out, not renewed
    generate(core, CLIENT, 5, priority="low")
    assert [m.request_id for m in admitted(core)] == [2, 3, 4, 5]
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])
    core.on_scheduler(messages.SchedulerLost(), [])   # a restarted scheduler starts with nothing shed
    generate(core, CLIENT, 6, priority="low")
    assert [m.request_id for m in admitted(core)][-1] == 6


def test_a_shed_class_keeps_its_in_flight_share_served_and_each_refusal_holds_the_lease(core):
    """Under a lease the door admits a shed class up to `in_flight` unanswered, so lows are still
    served at what the workers finish; a refusal means demand still outruns that, and holds the lease."""
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 2), [])
    for request_id in (1, 2, 3):
        generate(core, CLIENT, request_id, priority="low")
    core.on_scheduler(*final(FIRST_RID, 1))   # one of the two kept answered: room for one more
    generate(core, CLIENT, 4, priority="low")
    generate(core, CLIENT, 5, priority="low")
    assert [m.request_id for m in admitted(core)] == [1, 2, 4]
    assert [(header["id"], header.get("code")) for _, header in replies(core)] == \
        [(3, codes.OVERLOADED), (1, None), (5, codes.OVERLOADED)]
    core.clock.now += 0.9
    generate(core, CLIENT, 6, priority="low")   # refused near the lease's end: held for as long again
    core.clock.now += 0.9
    generate(core, CLIENT, 7, priority="low")
    assert [header["id"] for _, header in replies(core)][-2:] == [6, 7]
    core.clock.now += 1.0   # no refusal for a lease: it ends, and the door admits them all again
    generate(core, CLIENT, 8, priority="low")
    assert [m.request_id for m in admitted(core)] == [1, 2, 4, 8]


def test_refusals_hold_a_lease_only_so_long_past_the_schedulers_word(core):
    """A stream of more of a shed class than it keeps in flight, which the workers might take,
    is capped at most HOLD_S after the scheduler last found a backlog."""
    told = core.clock.now
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 1), [])
    generate(core, CLIENT, 0, priority="low")   # kept: from here on the door refuses
    refusals = int(HOLD_S / 0.9)   # each 0.9 s after the last, within the lease it holds
    for request_id in range(1, refusals + 1):
        core.clock.now += 0.9
        generate(core, CLIENT, request_id, priority="low")
    assert [m.request_id for m in admitted(core)] == [0] and len(replies(core)) == refusals
    core.clock.now = told + HOLD_S   # the last refusal's lease would last longer: held no further
    generate(core, CLIENT, refusals + 1, priority="low")
    assert [m.request_id for m in admitted(core)] == [0, refusals + 1]


def test_under_a_lease_a_shed_request_is_refused_on_its_op_id_and_priority_alone(core):
    """A flood's refusal must cost far less than an admission: the rest of the header goes
    unchecked. Everything else is checked in full, and a revoked key is still told so."""
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])
    bad_timeout = {"timeout_ms": -1}   # the full check refuses it BAD_REQUEST
    generate(core, CLIENT, 1, priority="low", **bad_timeout)
    generate(core, CLIENT, 2, priority="high", **bad_timeout)
    send(core, CLIENT, "generate", 3, {"prompt": "hi"}, tenant="", priority="low")   # CURVE on, key revoked
    assert [(header["id"], header["code"]) for _, header in replies(core)] == \
        [(1, codes.OVERLOADED), (2, codes.BAD_REQUEST), (3, codes.UNAUTHORIZED)]
    assert admitted(core) == [] and core.errors == {codes.OVERLOADED: 1, codes.BAD_REQUEST: 1, codes.UNAUTHORIZED: 1}


def test_refusals_at_the_door_wait_for_the_slices_end_or_another_reply_and_keep_their_order(core):
    """The door's refusals go out together once the process has read its slice of the flood
    (send_refusals); any other reply to a client sends them first."""
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])
    for request_id in (1, 2):
        frames = [wire.encode_request("generate", request_id, {"prompt": "hi", "max_tokens": 2}, priority="low")]
        core.on_client(CLIENT, frames, [len(frames[0])], None)
    assert replies(core) == []
    core.send_refusals()
    core.send_refusals()   # nothing held: nothing sent again
    assert [(identity, header["id"], header["code"]) for identity, header in replies(core)] == \
        [(CLIENT, 1, codes.OVERLOADED), (CLIENT, 2, codes.OVERLOADED)]
    frames = [wire.encode_request("generate", 3, {"prompt": "hi", "max_tokens": 2}, priority="low")]
    core.on_client(OTHER, frames, [len(frames[0])], None)
    frames = [wire.encode_request("generate", 4, {"prompt": "hi", "max_tokens": -1}, priority="high")]
    core.on_client(CLIENT, frames, [len(frames[0])], None)   # not shed: its own refusal, BAD_REQUEST, at once
    assert [(identity, header["id"], header["code"]) for identity, header in replies(core)][2:] == \
        [(OTHER, 3, codes.OVERLOADED), (CLIENT, 4, codes.BAD_REQUEST)]


def _map(*pairs) -> bytes:
    """A msgpack map of `pairs` as given, a repeated key or a key of any type kept."""
    return bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(key) + msgpack.packb(value) for key, value in pairs)


SHED_FIELDS = (("op", "infer"), ("id", 7), ("priority", "low"))


@pytest.mark.parametrize("raw", [
    msgpack.packb(["infer", 7, "low"]),                      # not a map
    _map(*SHED_FIELDS, (1, 2)),                              # a key that is not a string
    _map(("op", 5), ("id", 7), ("priority", "low")),
    _map(("op", "infer"), ("id", 7.0), ("priority", "low")),
    _map(("op", "infer"), ("id", True), ("priority", "low")),
    _map(("op", "infer"), ("id", 7), ("priority", 1)),
    _map(("op", "infer"), ("priority", "low")),               # no id
    _map(*SHED_FIELDS) + b"\x00",                            # bytes left over
    _map(*SHED_FIELDS)[:-2],                                 # cut short
    bytes([0x84]) + b"".join(msgpack.packb(x) for pair in SHED_FIELDS for x in pair)
    + msgpack.packb("args") + b"\x91" * 100_000 + b"\xc0",   # nested past any decoder's depth
    b"\x83\xa2op\xa2\xff\xfe\xa2id\x07\xa8priority\xa3low",   # op not UTF-8
], ids=["array", "int-key", "int-op", "float-id", "bool-id", "int-priority", "no-id", "trailing", "truncated",
        "deep", "bad-utf8"])
def test_a_shed_header_that_does_not_decode_to_op_id_and_priority_is_left_to_the_full_parse(raw):
    assert shed_header.peek(raw) is None


@pytest.mark.parametrize("first, last", [("high", "low"), ("low", "high")])
def test_a_repeated_priority_reads_the_same_at_the_door_as_in_the_full_parse(core, first, last):
    """A client cannot show the door one class and the scheduler another."""
    raw = _map(("v", 1), ("op", "generate"), ("id", 7), ("args", {"prompt": "hi", "max_tokens": 2}),
               ("priority", first), ("priority", last))
    assert shed_header.peek(raw).priority == wire.decode_header(raw)["priority"] == last
    core.on_scheduler(messages.Shed(["low"], 250, 1000, 0), [])
    core.on_client(CLIENT, [raw], [len(raw)], None)
    core.send_refusals()
    assert [m.request_id for m in admitted(core)] == ([7] if last == "high" else [])
    assert [header.get("code") for _, header in replies(core)] == ([] if last == "high" else [codes.OVERLOADED])


def test_a_backlog_in_the_client_socket_starts_the_lease_at_the_door_on_the_classes_marked_shed(core):
    """socket_backlog.py found requests waiting before the front-end's read: the lease the
    scheduler would start, at once, from the front-end's own copy of the live [scheduler] section."""
    generate(core, CLIENT, 1, priority="high")
    core.socket_backlog()   # a flood without a shed class in flight: no lease
    assert not core.shed.classes
    generate(core, CLIENT, 2, priority="low")
    core.socket_backlog()
    for request_id in range(3, 7):
        generate(core, CLIENT, request_id, priority="low")
    generate(core, CLIENT, 7, priority="high")
    kept = core.config.scheduler.shed_in_flight
    assert [m.request_id for m in admitted(core)] == [1, *range(2, kept + 2), 7]
    assert [(header["id"], header["code"], header["retry_after_ms"]) for _, header in replies(core)] == \
        [(request_id, codes.OVERLOADED, core.config.scheduler.overloaded_retry_ms) for request_id in range(kept + 2, 7)]
    core.clock.now += 6.0   # the lease is over (refusals hold it HOLD_S at most)
    unshed = core.config.to_dict()
    unshed["scheduler"]["classes"]["low"]["shed"] = False
    core.on_scheduler(messages.Reload(1, from_dict(unshed)), [])
    core.socket_backlog()   # no class is marked shed now: nothing is refused
    generate(core, CLIENT, 8, priority="low")
    assert [m.request_id for m in admitted(core)][-1] == 8
