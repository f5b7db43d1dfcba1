"""Fuzzing the decoders a peer's bytes reach first: the request frame decoder (sizes, msgpack,
header, op arguments) and the delta codec (entries, meta, payloads, zstd). Whatever the input,
the only failure allowed is the protocol's own error (MCPDError / DeltaError with a stable code);
anything else (a crash, another exception, an allocation past the limits) is a bug.

Bounded for CI: a fixed number of examples per property, no per-example deadline.
"""
import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcpd.config import LimitsConfig
from mcpd.protocol import codes, ops, safe_zstd, wire
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = LimitsConfig(max_message_bytes=1 << 16, max_header_bytes=1 << 12, max_frames=8)
DELTA_LIMITS = codec.DeltaLimits(max_field_bytes=1 << 16)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                    st.text(max_size=40), st.binary(max_size=40))


def nested(max_size: int, max_leaves: int):
    """Scalars, and lists and maps of them nested, up to max_leaves scalars in all."""
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=max_size),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=max_size)),
                        max_leaves=max_leaves)


values = nested(6, 30)
VALID_HEADERS = [
    {"v": 1, "op": "ping", "id": 1},
    {"v": 1, "op": "generate", "id": "g", "args": {"prompt": "hi", "max_tokens": 4, "stop": ["x"]}},
    {"v": 1, "op": "generate", "id": 2, "args": {"prompt_token_ids": [1, 2, 3], "context": "c", "base": 0}},
    {"v": 1, "op": "context.update", "id": 3, "tenant": "t",
     "args": {"id": "c", "base": 0, "changes": [{"name": "w", "kind": "set", "frame": 0,
                                                 "meta": {"type": "array", "dtype": "<f4", "shape": [2],
                                                          "codec": "raw", "nbytes": 8}}]}},
    {"v": 1, "op": "cancel", "id": 4, "args": {"target": 1}},
]


def mutated(data: bytes, draw) -> bytes:
    """A few byte flips, insertions, deletions and truncations of `data`."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.integers(0, max(len(out) - 1, 0)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and out:
            out[where] ^= draw(st.integers(1, 255))
        elif action == "insert":
            out[where:where] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete" and out:
            del out[where]
        elif action == "truncate":
            del out[where:]
    return bytes(out)


@st.composite
def request_frames(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "mutated", "structured"]))
    if kind == "random":
        header = draw(st.binary(max_size=200))
    elif kind == "mutated":
        header = mutated(msgpack.packb(draw(st.sampled_from(VALID_HEADERS))), draw)
    else:
        base = dict(draw(st.sampled_from(VALID_HEADERS)))
        base[draw(st.sampled_from(["v", "op", "id", "args", "tenant", "timeout_ms"]))] = draw(values)
        header = msgpack.packb(base)
    return [header, *draw(st.lists(st.binary(max_size=64), max_size=10))]


def parse(frames: list[bytes]):
    """What the front-end does with a client message: decode, then validate the op's args."""
    request = wire.parse_request((), frames, LIMITS)
    ops.validate_args(request.op, request.header["args"], LIMITS)
    return request


@FUZZ
@given(request_frames())
def test_frame_decoder_answers_any_input_with_a_protocol_error(frames):
    try:
        request = parse(frames)
    except MCPDError as e:
        assert e.code in codes.ALL and e.message
        return
    assert request.op in ops.OPS and len(frames[0]) <= LIMITS.max_header_bytes   # the header frame


ARG_NAMES = sorted(set().union(*ops.ACCEPTED.values()))


@st.composite
def op_args(draw) -> tuple[str, dict]:
    """An op and its args: names of its own (whose values are read), in half the cases one more
    of another op's or any text (refused before any value is read); values of any shape, smaller
    than `values`: reading stops at the first bad one."""
    op = draw(st.sampled_from(sorted(ops.OPS)))
    own = sorted(ops.ACCEPTED[op]) or ARG_NAMES
    args = draw(st.dictionaries(st.sampled_from(own), nested(4, 8), max_size=min(len(own), 8)))
    if draw(st.booleans()):
        args[draw(st.one_of(st.sampled_from(ARG_NAMES), st.text(max_size=20)))] = draw(nested(4, 8))
    return op, args


@FUZZ
@given(op_args())
def test_argument_validation_answers_any_args_with_a_protocol_error(case):
    op, args = case
    try:
        checked = ops.validate_args(op, args, LIMITS)
    except MCPDError as e:
        assert e.code in (codes.BAD_REQUEST, codes.UNKNOWN_OP)
        return
    assert checked.op == op and set(checked.__struct_fields__) == set(ops.OPS[op]) | ({"sampling"} if op == "generate" else set())


arrays = st.builds(lambda n, dtype, seed: np.random.default_rng(seed).integers(0, 50, n).astype(dtype),
                   st.integers(0, 64), st.sampled_from(["<f4", "<i8", "|u1", ">i2", "<f8"]), st.integers(0, 9))


@st.composite
def wire_deltas(draw):
    """(old value, entries, frames): a real delta's wire form, then damaged in one of several ways."""
    old, new = draw(arrays), draw(arrays)
    if draw(st.booleans()) and old.size:
        new = old.copy()
        new[: max(1, old.size // 10)] += 1
    entries, frames = codec.to_wire([d for d in [codec.diff("f", old, new)] if d is not None])
    damage = draw(st.sampled_from(["none", "meta", "payload", "entry", "random"]))
    if damage == "meta" and entries:
        key = draw(st.sampled_from(["type", "dtype", "shape", "codec", "nbytes", "value"]))
        entries[0]["meta"] = {**entries[0]["meta"], key: draw(values)}
    elif damage == "payload" and frames:
        frames[0] = mutated(bytes(frames[0]), draw)
    elif damage == "entry" and entries:
        entries[0][draw(st.sampled_from(["name", "kind", "frame", "meta"]))] = draw(values)
    elif damage == "random":
        entries = draw(values)
        frames = draw(st.lists(st.binary(max_size=64), max_size=4))
    return old, entries, frames


@FUZZ
@given(wire_deltas())
def test_delta_codec_answers_any_delta_with_a_protocol_error(case):
    old, entries, frames = case
    try:
        for delta in codec.from_wire(entries, frames, DELTA_LIMITS):
            value = codec.apply(old, delta, DELTA_LIMITS)
            if isinstance(value, np.ndarray):
                assert value.nbytes <= DELTA_LIMITS.max_field_bytes
    except codec.DeltaError as e:
        assert e.code in (codes.BAD_REQUEST, codes.TOO_LARGE) and e.message


@st.composite
def zstd_frames(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    return mutated(safe_zstd.compress(draw(st.binary(max_size=3000))), draw)


@FUZZ
@given(zstd_frames())
def test_zstd_decoder_never_exceeds_its_cap(frame):
    try:
        out = safe_zstd.decompress(frame, 1024)
    except safe_zstd.DecompressionRejected:
        return
    assert len(out) <= 1024
