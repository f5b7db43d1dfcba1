"""The internal messages (daemon/messages.py) and the typed op args (protocol/args.py)."""
import math
import re
from pathlib import Path

import msgspec
import pytest

from mcpd.client import replies
from mcpd.config import LimitsConfig, from_dict
from mcpd.daemon import messages, model_stats
from mcpd.daemon.child_stats import FrontendStats, SchedulerStats, WorkerStats
from mcpd.engine import SamplingParams
from mcpd.histogram import Snapshot
from mcpd.memory.pool_stats import WorkerPoolStats
from mcpd.protocol import codes, ops
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.args import BY_OP, CancelArgs, ContextUpdateArgs, GenerateArgs, PingArgs
from mcpd.protocol.change_entry import ArrayMeta, DeleteEntry, ScalarMeta, SetEntry, StrMeta
from mcpd.protocol.control_args import ContextRef
from mcpd.protocol.control_results import ContextDetail, ContextDropped, ContextField
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.results import ContextTurn, Degraded, GenerateResult, Usage

PROTOCOL = Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md"
LIMITS = LimitsConfig()

SENDER = messages.Sender("worker", 1, 4321)
PRIVATE_POOL = WorkerPoolStats(total_bytes=8, in_use_bytes=5, requested_bytes=5, free_bytes=3, largest_free_block=3,
                               live_allocations=1, internal_waste_frac=0.0, external_fragmentation=0.0, shared=False,
                               kv_reserved_bytes=4)
SAMPLES = [
    messages.Request(1, "a", "t", "high", 5, GenerateArgs(prompt="x", sampling=SamplingParams(stop=("s",)))),
    messages.Request(2, 7, "t", None, None, ContextUpdateArgs(id="c", base=3, changes=(
        SetEntry(name="f", meta=ArrayMeta(dtype="<f4", shape=(2,), codec="raw", nbytes=8), frame=0),
        SetEntry(name="s", meta=StrMeta(codec="zstd", nbytes=9), frame=1),
        SetEntry(name="n", meta=ScalarMeta(None)), DeleteEntry(name="g")))),
    messages.Request(3, 8, "t", None, None, CancelArgs(target="a")),
    messages.Cancel(1, "CANCELLED"),
    messages.WorkerLost(0, 1234),
    messages.Dispatch(1, "a", "t", 2, False, PingArgs()),
    messages.Dispatch(1, "a", "t", 2, True, GenerateArgs(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=4)),
                      degraded=Degraded(4, 20)),
    messages.Hello(0, 1234, "cpu", "embedded", "float32"),
    messages.Hello(1, 1235, "cpu", "h", "", "risk", "v1", model_stats.Signature(
        {"features": model_stats.TensorMetadata("FP32", [-1, 4])}, {"score": model_stats.TensorMetadata("FP32", [-1])})),
    messages.Welcome(), messages.Flush(), messages.Flushed(3),
    messages.Started(1),
    messages.Done([1, 2, 3]),
    messages.Stats(WorkerStats(index=0, pool=PRIVATE_POOL)),
    messages.Failed("RuntimeError: x", [4, 5]),
    messages.Chunk(9),
    messages.Final(9, None),
    messages.Final(9, "OVERLOADED"),
    messages.Members({"a": messages.OwnerNode("tcp://127.0.0.1:7001", 1.0), "b": messages.OwnerNode("tcp://127.0.0.2:7001", 2.5)},
                     {"a": 3, "b": 0}),
    messages.TurnResult(9, GenerateResult("hi", [1], "stop", "m", "v", Usage(1, 1), [-0.5]), [7, 1]),
    messages.Shed(["low"], 100, 1000, 64),
    messages.Drain(), messages.SchedulerLost(), messages.Resume(),
    messages.Admin(3, "contexts.drop", ContextRef(owner="t", id="c")),
    messages.Reload(4, from_dict({"server": {"log_level": "debug"}, "models": {"m": {"default": "a", "versions": {
        "a": {}, "b": {"batching": {"max_batch_size": 4}}}, "split": {"a": 1, "b": 3}}}})),
    messages.Ready(SENDER), messages.Drained(SENDER),
    messages.Report(SENDER, FrontendStats(served=3)), messages.Report(SENDER, SchedulerStats(queue_depth=2)),
    messages.Report(SENDER, WorkerStats(running=1, batch_size=Snapshot([1.0, 2.0], [0, 3, 0], 6.0))),
    messages.Refused(SENDER, "port 80 in use", 69),
    messages.AdminAnswer(SENDER, 3, result=ContextDropped(True)),
    messages.AdminAnswer(SENDER, 3, result=ContextDetail(
        "t", "c", 2, 5, [ContextField("f", "ndarray", "float32", [2], 1)], 8, False, None)),
    messages.AdminAnswer(SENDER, 3, error=ErrorReply("NOT_FOUND", "no", 5)),
    messages.Reloaded(SENDER, 4, ["server.log_level"]),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_decodes_to_what_was_encoded_with_its_payload(message):
    payload = () if not message.__struct_fields__ else (b"header", b"\x00" * 3)
    decoded, frames = messages.decode(messages.encode(message, *payload))
    assert decoded == message and type(decoded) is type(message) and list(frames) == list(payload)


def test_every_message_type_has_a_sample_and_its_own_tag():
    declared = {kind for kind, _ in messages._DECODERS.values()}
    assert declared == {type(m) for m in SAMPLES}
    assert {type(m.stats) for m in SAMPLES if isinstance(m, messages.Report)} == {FrontendStats, SchedulerStats, WorkerStats}
    assert len({kind.TAG for kind in declared}) == len(declared)


def test_validated_args_are_typed_and_filled_with_the_declared_defaults():
    args = ops.validate_args("generate", {"prompt": "x", "temperature": 0, "stop": ["a"], "seed": None}, LIMITS)
    assert args == GenerateArgs(prompt="x", sampling=SamplingParams(temperature=0.0, stop=("a",)))
    assert type(args.sampling.temperature) is float and args.op == "generate"
    assert set(BY_OP) == set(ops.OPS)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1e-9), ("temperature", 100.5),
    ("temperature", "1"), ("top_p", float("nan")), ("top_p", 0), ("top_k", -1), ("top_k", 2.0), ("top_k", True),
    ("top_k", 1 << 63), ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", LIMITS.max_new_tokens + 1),
    ("seed", 1 << 63), ("seed", -(1 << 63) - 1), ("seed", 1.0), ("stop", [""]), ("stop", [b"x"]),
    ("stop", ["x"] * 17), ("stop_token_ids", ["1"]), ("stop_token_ids", [1 << 31]), ("ignore_eos", 1),
])
def test_sampling_values_the_engine_cannot_run_are_refused_at_the_front_end_naming_the_field(field, value):
    with pytest.raises(MCPDError) as refused:
        ops.validate_args("generate", {"prompt": "x", field: value}, LIMITS)
    assert refused.value.code == codes.BAD_REQUEST and field in refused.value.message


ARRAY_META = {"type": "array", "dtype": "<f4", "shape": [2], "codec": "raw", "nbytes": 8}


@pytest.mark.parametrize("change, where", [
    ({"name": 5, "kind": "delete"}, "$[0].name"),
    ({"name": "", "kind": "delete"}, "$[0].name"),
    ({"name": "w", "kind": "replace", "meta": ARRAY_META}, "$[0].kind"),
    ({"name": "w", "meta": ARRAY_META}, "kind"),
    ({"name": "w", "kind": "set", "frame": 0}, "meta"),
    ({"name": "w", "kind": "set", "meta": {**ARRAY_META, "shape": [2.0]}}, "$[0].meta.shape[0]"),
    ({"name": "w", "kind": "set", "meta": {**ARRAY_META, "nbytes": True}}, "$[0].meta.nbytes"),
    ({"name": "w", "kind": "set", "meta": {"type": "scalar"}}, "value"),
    ({"name": "w", "kind": "set", "meta": {"type": "scalar", "value": [1]}}, "$[0].meta.value"),
    ({"name": "w", "kind": "xor", "meta": {"type": "str", "codec": "raw", "nbytes": 1}, "frame": 0}, "$[0].meta"),
    ({"name": "w", "kind": "append", "meta": {"type": "scalar", "value": 1}}, "$[0].meta"),
    ({"name": "w", "kind": "set", "meta": ARRAY_META, "frame": -1}, "$[0].frame"),
    (["w", "set"], "$[0]"),
])
def test_a_change_of_the_wrong_shape_is_refused_at_the_front_end_saying_where(change, where):
    with pytest.raises(MCPDError) as refused:
        ops.validate_args("context.update", {"id": "c", "base": 0, "changes": [change]}, LIMITS)
    assert refused.value.code == codes.BAD_REQUEST and where in refused.value.message


def test_the_front_end_hands_on_the_changes_typed():
    args = ops.validate_args("context.update", {"id": "c", "base": 0, "changes": [
        {"name": "w", "kind": "set", "meta": ARRAY_META, "frame": 0}, {"name": "g", "kind": "delete"}]}, LIMITS)
    assert args.changes == (SetEntry(name="w", meta=ArrayMeta(dtype="<f4", shape=(2,), codec="raw", nbytes=8), frame=0),
                            DeleteEntry(name="g"))


def test_protocol_doc_states_the_generate_defaults_the_code_has():
    table = PROTOCOL.read_text().split("Generate text from a prompt.", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", table, re.M)
    # context and base: documented in §8; sampling: its fields are the args
    assert len(rows) == len(GenerateArgs.__struct_fields__) - 3 + len(SamplingParams.__struct_fields__)
    for name, documented in rows:
        default = getattr(SamplingParams(), name) if name in SamplingParams.__struct_fields__ else \
            getattr(GenerateArgs(), name)
        assert documented.strip() in doc_spellings(default), name


def doc_spellings(default) -> tuple[str, ...]:
    if default is None:
        return "—", "nil"
    if isinstance(default, bool):
        return (f"`{str(default).lower()}`",)
    return ("`[]`",) if default == () else (f"`{default}`",)


@pytest.mark.parametrize("context, documented", [
    (ContextTurn("c", 2, [7, 8]), {"id": "c", "version": 2, "appended_token_ids": [7, 8]}),
    (ContextTurn("c", 3, [9], kept_tokens=5), {"id": "c", "version": 3, "appended_token_ids": [9], "kept_tokens": 5}),
])
def test_a_context_turn_travels_as_the_map_the_protocol_documents_and_the_client_reads_it_typed(context, documented):
    result = GenerateResult("hi", [7, 8], "stop", "m", "v", Usage(1, 2), context=context)
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(result))
    assert sent["context"] == documented
    assert replies.generate_result(sent).context == context


def test_the_engine_gets_the_sampling_struct_the_front_end_decoded():
    args = ops.validate_args("generate", {"prompt": "x", "max_tokens": 4, "temperature": 1, "top_p": 1, "stop": ["a"],
                                          "stop_token_ids": [3], "seed": -1, "logprobs": True}, LIMITS)
    assert args.sampling == SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, stop=("a",), stop_token_ids=(3,),
                                           seed=-1, logprobs=True)
    assert math.isclose(args.sampling.temperature, 1.0) and isinstance(args.sampling.stop, tuple)
    dispatch, _ = messages.decode(messages.encode(messages.Dispatch(1, "a", "t", 0, False, args)))
    assert type(dispatch.args.sampling) is SamplingParams and dispatch.args.sampling == args.sampling


# Payload: user data the daemon carries to user code or back to the client unread, not protocol.
# Each is bounded where it enters (docs/PROTOCOL.md, section 6 and the [models] table).
PAYLOAD_FIELDS = {
    "GenerateArgs.messages": "a chat's messages: keys besides role and content are the chat template's",
    "VersionConfig.settings": "a handler's own settings, passed to its setup unread",
}


def _loose_fields(kind: msgspec.inspect.Type, where: str, seen: set) -> list[str]:
    """The fields under `kind` typed Any, object, or an untyped dict or list; each struct and
    dataclass looked at once (a type may hold itself)."""
    if isinstance(kind, msgspec.inspect.AnyType) or \
            isinstance(kind, msgspec.inspect.CustomType) and kind.cls is object:
        return [where]
    if isinstance(kind, msgspec.inspect.UnionType):
        return [name for member in kind.types for name in _loose_fields(member, where, seen)]
    if isinstance(kind, msgspec.inspect.DictType):
        return _loose_fields(kind.key_type, where, seen) + _loose_fields(kind.value_type, where, seen)
    if isinstance(kind, (msgspec.inspect.ListType, msgspec.inspect.SetType, msgspec.inspect.FrozenSetType,
                         msgspec.inspect.VarTupleType)):
        return _loose_fields(kind.item_type, where, seen)
    if isinstance(kind, msgspec.inspect.TupleType):
        return [name for item in kind.item_types for name in _loose_fields(item, where, seen)]
    if isinstance(kind, (msgspec.inspect.StructType, msgspec.inspect.DataclassType)) and kind.cls not in seen:
        seen.add(kind.cls)
        return [name for field in kind.fields
                for name in _loose_fields(field.type, f"{kind.cls.__qualname__}.{field.name}", seen)]
    return []


def test_no_message_carries_a_plain_map_at_any_depth():
    """Everything a message holds, down to the stats' figures, crosses processes as its declared type."""
    seen = set()
    loose = sorted({name for kind, _ in messages._DECODERS.values()
                    for name in _loose_fields(msgspec.inspect.type_info(kind), kind.__name__, seen)})
    assert loose == sorted(PAYLOAD_FIELDS)


class _Inner(msgspec.Struct):
    figures: list[dict]


class _Outer(msgspec.Struct):
    typed: dict[str, int]
    inner: tuple[_Inner, ...] | None
    anything: object = None


def test_the_walk_finds_a_plain_map_or_any_value_however_deep():
    found = _loose_fields(msgspec.inspect.type_info(_Outer), "_Outer", set())
    assert set(found) == {"_Inner.figures", "_Outer.anything"}


@pytest.mark.parametrize("message", [
    messages.Hello(1, 1235, "cpu", "h", "", "risk", "v1", {"inputs": {"x": {"datatype": "FP32"}}, "outputs": {}}),
    messages.Hello(1, 1235, "cpu", "h", "", "risk", "v1", {"inputs": {"x": ["FP32", [-1]]}, "outputs": {}}),
    messages.Reload(4, {"server": {"log_level": 5}}),
    messages.Reload(4, {"scheduler": {"classes": {"low": {"rank": "1"}}}}),
    messages.Request(2, 7, "t", None, None, ContextUpdateArgs(id="c", base=3, changes=({"name": "f", "frame": 0},))),
    messages.Request(2, 7, "t", None, None, ContextUpdateArgs(id="c", base=3, changes=(
        {"name": "f", "kind": "xor", "meta": {"type": "str", "codec": "raw", "nbytes": 1}},))),
    messages.AdminAnswer(SENDER, 3, result={"dropped": True}),   # untagged: which op's result is it?
    messages.AdminAnswer(SENDER, 3, result={"result_of": "ContextDropped", "dropped": "yes"}),
    messages.AdminAnswer(SENDER, 3, result={"result_of": "TrafficPolicy", "model": "m", "primary": "a"}),
], ids=lambda m: type(m).__name__)
def test_a_field_of_the_wrong_shape_does_not_decode(message):
    with pytest.raises(msgspec.ValidationError):
        messages.decode(messages.encode(message))


def test_an_admin_op_with_a_bare_args_map_does_not_decode():
    """The scheduler reads the struct the supervisor decoded, tagged with its type; a map is not one."""
    frames = [messages.Admin.TAG, msgspec.msgpack.encode([3, "contexts.drop", {"owner": "t", "id": "c"}])]
    with pytest.raises(msgspec.ValidationError):
        messages.decode(frames)
