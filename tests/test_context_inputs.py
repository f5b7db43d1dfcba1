"""Context fields as an infer's inputs, resolved by the scheduler's core in-process: a field read
is what its worker gets, as if the client had sent it; an append commits a sliding window as the
context's next version before it stands for the input; every refusal leaves the context as it was.
The daemon's side (the reply, a restart) is tests/test_handler_context_inputs.py's."""
import tempfile

import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.daemon import messages
from mcpd.daemon.scheduler.core import Scheduler
from mcpd.handlers import tensors
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.args import ContextAppend, ContextOpenArgs, ContextUpdateArgs, GenerateArgs, InferArgs
from fakes import Clock, Ports, decoded, scheduler_of

FEATURES = 4
MAX_FIELD_BYTES = 8192
ROWS = {"datatype": "FP32", "shape": [-1, FEATURES]}
SIGNATURES = {   # what each handler model takes, as its worker's Hello tells the scheduler
    "risk": {"features": ROWS},
    "pair": {"item": ROWS, "profile": ROWS},
    "window": {"events": {"datatype": "FP32", "shape": [-1, -1, FEATURES]}},
}


def make_core(**limits) -> Scheduler:
    handler = {"versions": {"v1": {"handler": "mcpd.handlers.examples.risk_scorer:RiskRules"}}}
    config = from_dict({
        "server": {"runtime_dir": tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")}, "cache": {"enabled": False},
        "persistence": {"enabled": False},
        "limits": {"max_message_bytes": 1 << 16, "max_header_bytes": 8192, **limits},
        "contexts": {"max_field_bytes": MAX_FIELD_BYTES}, "routing": {"default_model": "risk"},
        "models": {"chat": {"versions": {"v1": {}}}, **{model: handler for model in SIGNATURES}}})
    core = scheduler_of(config, Ports(), Clock())
    core.on_worker(b"w0", *decoded(messages.encode(messages.Hello(0, 100, "cpu", "x", "float32", "chat", "v1"))))
    for index, (model, inputs) in enumerate(SIGNATURES.items(), start=1):
        hello = messages.Hello(index, 100 + index, "cpu", "h", "", model, "v1", {"inputs": inputs, "outputs": {}})
        core.on_worker(b"w%d" % index, *decoded(messages.encode(hello)))
    return core


@pytest.fixture
def core():
    return make_core()


def send(core, rid: int, args, frames=(), tenant: str = "alice") -> None:
    core.on_inbox(*decoded(messages.encode(messages.Request(rid, rid, tenant, None, None, args), *frames)))
    core.tick()


def update(core, rid: int, context_id: str, base: int, tenant: str = "alice", **fields) -> None:
    entries, frames = codec.to_wire([codec.diff(name, None, value) for name, value in fields.items()])
    send(core, rid, ContextUpdateArgs(id=context_id, base=base, changes=tuple(entries)), frames, tenant)


def infer(core, rid: int, sent: dict[str, np.ndarray], tenant: str = "alice", **args) -> None:
    headers, frames = zip(*(tensors.encode(name, array) for name, array in sent.items())) if sent else ((), ())
    send(core, rid, InferArgs(inputs=tuple(headers), **args), frames, tenant)


def dispatch_of(core, rid: int) -> tuple[messages.Dispatch, list[bytes]]:
    return next((m, frames) for _, m, frames in core.ports.workers if isinstance(m, messages.Dispatch) and m.rid == rid)


def inputs_of(core, rid: int) -> dict[str, np.ndarray]:
    dispatch, frames = dispatch_of(core, rid)
    return {header.name: tensors.decode(header, frame) for header, frame in zip(dispatch.args.inputs, frames)}


def error_of(core, rid: int) -> dict:
    reply = core.ports.finals()[rid]
    assert reply["kind"] == "error", reply
    return reply


def context(core, context_id: str = "u1", tenant: str = "alice"):
    return core.contexts.store.get(tenant, context_id)


def profile() -> np.ndarray:
    return np.arange(FEATURES, dtype=np.float32) / 8


@pytest.fixture
def user(core):
    send(core, 1, ContextOpenArgs(id="u1"))
    update(core, 2, "u1", 0, profile=profile(), note="text, not a tensor", counts=np.arange(3, dtype=np.uint32))
    assert context(core).version == 1
    return core


def test_a_field_read_as_an_input_reaches_the_worker_as_if_it_were_sent(user):
    infer(user, 10, {}, context="u1", context_inputs={"features": "profile"})
    infer(user, 11, {"features": profile()[np.newaxis]})
    (read, read_frames), (sent, sent_frames) = dispatch_of(user, 10), dispatch_of(user, 11)
    assert read.args == sent.args and read_frames == sent_frames   # one row [1, 4], no context left in the args
    assert (read.context_version, sent.context_version) == (1, None)
    assert context(user).version == 1


def test_a_field_is_one_row_repeated_for_each_row_sent_beside_it(user):
    items = np.ones((3, FEATURES), np.float32)
    infer(user, 10, {"item": items}, model="pair", context="u1", context_inputs={"profile": "profile"})
    got = inputs_of(user, 10)
    assert list(got) == ["item", "profile"]
    np.testing.assert_array_equal(got["item"], items)
    np.testing.assert_array_equal(got["profile"], np.tile(profile(), (3, 1)))


def test_an_append_keeps_the_last_window_rows_one_version_each_and_stands_for_the_input(user):
    events = np.arange(7 * FEATURES, dtype=np.float32).reshape(7, FEATURES)
    for rid, (start, end) in enumerate(((0, 2), (2, 3), (3, 7)), start=10):
        infer(user, rid, {"events": events[start:end]}, model="window", context="u1",
              context_append={"window": ContextAppend("events", 3)})
        kept = events[max(0, end - 3):end]
        dispatch, _ = dispatch_of(user, rid)
        assert dispatch.context_version == context(user).version == rid - 8
        np.testing.assert_array_equal(context(user).fields["window"], kept)
        np.testing.assert_array_equal(inputs_of(user, rid)["events"], kept[np.newaxis])   # one row: [1, w, 4]
    assert dispatch.args.context is None and dispatch.args.context_append is None


@pytest.mark.parametrize("args, sent, code, words", [
    ({"context": "nobody", "context_inputs": {"features": "profile"}}, {}, codes.NOT_FOUND, "no context 'nobody'"),
    ({"context": "u1", "context_inputs": {"features": "absent"}}, {}, codes.BAD_INPUT, "no field 'absent'"),
    ({"context": "u1", "context_inputs": {"features": "note"}}, {}, codes.BAD_INPUT, "holds a str, not a tensor"),
    ({"context": "u1", "context_inputs": {"features": "counts"}}, {}, codes.BAD_INPUT, "uint32"),
    ({"context": "u1", "context_append": {"profile": ContextAppend("features", 4)}},
     {"features": np.ones((1, FEATURES), np.float64)}, codes.BAD_INPUT, "field 'profile' (float32 rows of shape []"),
    ({"context": "u1", "context_append": {"note": ContextAppend("features", 4)}},
     {"features": np.ones((1, FEATURES), np.float32)}, codes.BAD_INPUT, "'note' holds a str"),
    ({"context": "u1", "context_append": {"w": ContextAppend("features", 4)}},
     {"features": np.array([[b"a"]], object)}, codes.BAD_INPUT, "BYTES"),
    ({"context": "u1", "context_append": {"w": ContextAppend("features", 4), "v": ContextAppend("features", 4)}},
     {"features": np.ones((1, FEATURES), np.float32)}, codes.BAD_INPUT, "appended to two context fields"),
    ({"context": "u1", "context_append": {"tokens": ContextAppend("features", 4)}},
     {"features": np.ones((1,), np.int32)}, codes.BAD_REQUEST, "only generate appends"),
    ({"context": "u1", "context_append": {"profile": ContextAppend("features", 4)}},
     {"features": np.ones((1, FEATURES), np.float32)}, codes.BAD_INPUT, "(float32 rows of shape [4])"),
    ({"model": "pair", "context": "u1", "context_append": {"w": ContextAppend("profile", 1 << 20)}},
     {"item": np.ones((8, FEATURES), np.float32), "profile": np.ones((1 << 10, FEATURES), np.float32)},
     codes.TOO_LARGE, "limits.max_message_bytes"),   # 16 KiB of window, for each of 8 rows
    ({"model": "window", "context": "u1", "context_append": {"w": ContextAppend("events", 1 << 20)}},
     {"events": np.ones((MAX_FIELD_BYTES // 16 + 1, FEATURES), np.float32)}, codes.TOO_LARGE,
     "contexts.max_field_bytes"),
    ({"context": "u1", "context_append": {"w": ContextAppend("features", 4)}},   # the window is one row [1, 1, 4]
     {"features": np.ones((1, FEATURES), np.float32)}, codes.BAD_INPUT, "model takes [-1, 4]"),
    ({"context": "u1", "context_inputs": {"unknown": "profile"}, "model": "window"}, {}, codes.BAD_INPUT,
     "no input 'unknown'"),
])
def test_refusals_name_what_is_wrong_and_leave_the_context_as_it_was(user, args, sent, code, words):
    infer(user, 10, sent, **args)
    reply = error_of(user, 10)
    assert reply["code"] == code and words in reply["message"], reply
    assert context(user).version == 1 and set(context(user).fields) == {"tokens", "profile", "note", "counts"}


def test_a_window_grown_past_the_elements_a_request_may_send_is_refused_before_its_commit():
    core = make_core(max_tensor_elements=4 * FEATURES)
    send(core, 1, ContextOpenArgs(id="u1"))
    for rid in (10, 11, 12):   # two rows each, every request within the limit; the window is not
        infer(core, rid, {"events": np.ones((2, FEATURES), np.float32)}, model="window", context="u1",
              context_append={"window": ContextAppend("events", 100)})
    assert [dispatch_of(core, rid)[0].context_version for rid in (10, 11)] == [1, 2]
    reply = error_of(core, 12)
    assert reply["code"] == codes.BAD_INPUT and "limits.max_tensor_elements" in reply["message"], reply
    assert context(core).version == 2 and context(core).fields["window"].shape == (4, FEATURES)


def test_another_tenants_context_is_not_found_and_stays_unchanged(user):
    infer(user, 10, {}, tenant="mallory", context="u1", context_inputs={"features": "profile"})
    infer(user, 11, {"features": np.ones((1, FEATURES), np.float32)}, tenant="mallory", context="u1",
          context_append={"profile": ContextAppend("features", 1)})
    for rid in (10, 11):
        assert error_of(user, rid)["code"] == codes.NOT_FOUND
    assert context(user).version == 1 and user.contexts.store.owned_by("mallory") == []


def test_a_generate_on_the_context_refuses_appends_but_not_reads(user):
    send(user, 10, GenerateArgs(prompt="x", context="u1", model="chat"))
    assert dispatch_of(user, 10)[0].turn
    infer(user, 11, {"events": np.ones((1, FEATURES), np.float32)}, model="window", context="u1",
          context_append={"window": ContextAppend("events", 2)})
    reply = error_of(user, 11)
    assert reply["code"] == codes.CONFLICT and "busy with a generate" in reply["message"]
    infer(user, 12, {}, context="u1", context_inputs={"features": "profile"})
    np.testing.assert_array_equal(inputs_of(user, 12)["features"], profile()[np.newaxis])
    assert context(user).version == 1


def test_a_context_infer_that_broke_two_workers_is_refused_when_sent_again_before_its_append(user):
    rows = {"events": np.ones((1, FEATURES), np.float32)}
    append = {"model": "window", "context": "u1", "context_append": {"window": ContextAppend("events", 4)}}
    window_worker = 1 + list(SIGNATURES).index("window")
    infer(user, 10, rows, **append)
    for pid in (200, 201):   # its worker dies; it runs again alone on the restarted one, which dies too
        user.on_inbox(*decoded(messages.encode(messages.WorkerLost(window_worker, user.workers[b"w%d" % window_worker].pid))))
        hello = messages.Hello(window_worker, pid, "cpu", "h", "", "window", "v1",
                               {"inputs": SIGNATURES["window"], "outputs": {}})
        user.on_worker(b"w%d" % window_worker, *decoded(messages.encode(hello)))
        user.tick()
    assert error_of(user, 10)["code"] == codes.WORKER_LOST and context(user).version == 2
    infer(user, 11, rows, **append)   # the same request again: known, refused, nothing appended
    assert error_of(user, 11)["code"] == codes.INTERNAL and context(user).version == 2


def test_a_big_endian_field_takes_little_endian_rows_and_keeps_its_dtype(user):
    update(user, 3, "u1", 1, window=np.arange(2 * FEATURES, dtype=">f4").reshape(2, FEATURES))
    rows = np.full((1, FEATURES), 9, np.float32)
    infer(user, 10, {"events": rows}, model="window", context="u1", context_append={"window": ContextAppend("events", 2)})
    window = context(user).fields["window"]
    assert window.dtype.str == ">f4"
    np.testing.assert_array_equal(window, [np.arange(FEATURES, 2 * FEATURES), rows[0]])
