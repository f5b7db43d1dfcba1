"""Field deltas: exact round trips, the choice of encoding, and hostile deltas."""
import io
import math

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpd.protocol import codes, safe_zstd
from mcpd.protocol.change_entry import ArrayMeta, NoMeta
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.delta import (ALLOWED_DTYPES, DELETED, DeltaError, DeltaLimits, FieldDelta, apply,
                                 apply_in_place, delete, diff, from_wire, to_wire)

LIMITS = DeltaLimits()
DTYPES = sorted(ALLOWED_DTYPES)


def over_the_wire(deltas: list[FieldDelta]) -> list[FieldDelta]:
    """What the peer gets: entries through msgpack, payloads as separate (read-only) frames."""
    entries, frames = to_wire(deltas)
    entries = msgpack.unpackb(msgpack.packb(entries), raw=False)
    return from_wire(entries, [memoryview(bytes(f)) for f in frames], LIMITS)


def sync(old, new):
    """`new` as the receiver rebuilds it from `old` and the delta, checking that `old` survives."""
    before = snapshot(old)
    delta = diff("f", old, new)
    if delta is None:
        return old
    (received,) = over_the_wire([delta])
    result = apply(old, received, LIMITS)
    assert snapshot(old) == before, "apply modified the old value"
    return result


def snapshot(value):
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, value.tobytes()
    return type(value), repr(value)


def assert_identical(result, expected):
    assert type(result) is type(expected)
    if isinstance(expected, np.ndarray):
        assert result.dtype.str == expected.dtype.str and result.shape == expected.shape
        assert result.tobytes() == expected.tobytes()    # bit-exact, NaNs included
        assert result.flags.c_contiguous and result.flags.writeable
    elif isinstance(expected, float):
        assert math.copysign(1, result) == math.copysign(1, expected)
        assert result == expected or (math.isnan(result) and math.isnan(expected))
    else:
        assert result == expected


def random_array(rng, dtype: str, shape) -> np.ndarray:
    """Any bit pattern (NaNs, infinities, denormals) except for bool, which numpy keeps 0 or 1."""
    count = math.prod(shape)
    raw = rng.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw &= 1
    return raw.view(dtype).reshape(shape)


# ------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_through_set_xor_and_append(dtype):
    rng = np.random.default_rng(1)
    old = random_array(rng, dtype, (40, 3))
    changed = old.copy()
    changed[5, 1] = random_array(rng, dtype, (1,))[0] if dtype != "|b1" else not changed[5, 1]
    grown = np.concatenate([old, random_array(rng, dtype, (7, 3))]).astype(dtype)   # keeps the byte order
    assert diff("f", old, changed).kind == "xor" and diff("f", old, grown).kind == "append"
    for new in (changed, grown, random_array(rng, dtype, (2, 2, 2))):
        assert_identical(sync(old, new), new)
    assert_identical(sync(None, old), old)


@pytest.mark.parametrize("old,new", [
    (None, b"\x00\xffbytes"), (b"chat so far", b"chat so far, and more"), (b"abc", b"xbc"), (b"abc", b""),
    (None, "héllo ✓"), ("héllo", "héllo wörld ✓"), ("abc", "ab"), ("text", b"text"),
    (None, 0), (1, True), (True, 1), (None, -(1 << 63)), (None, (1 << 64) - 1), (1, 1.0),
    (0.0, -0.0), (None, float("nan")), (None, float("inf")), (3.5, None), (b"x", None),
    (np.zeros(3), 7), (7, np.zeros(3)), (b"x" * 100_000, b"y" * 100_000),
], ids=repr)
def test_every_value_type_round_trips(old, new):
    assert_identical(sync(old, new), new)


@pytest.mark.parametrize("value", [None, 0, 2.5, float("nan"), b"abc", "abc", np.arange(5)], ids=repr)
def test_equal_values_need_no_delta(value):
    assert diff("f", value, value) is None
    copy = value.copy() if isinstance(value, np.ndarray) else value
    assert diff("f", value, copy) is None


def test_bit_differences_that_compare_equal_are_still_sent():
    assert diff("f", 0.0, -0.0) is not None
    assert diff("f", np.zeros(4), -np.zeros(4)) is not None
    assert diff("f", np.float32([0]), np.float64([0])) is not None


def test_non_contiguous_and_zero_dimensional_arrays_round_trip():
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    assert_identical(sync(None, base[:, ::3]), np.ascontiguousarray(base[:, ::3]))
    assert_identical(sync(None, np.asfortranarray(base)), base)
    assert_identical(sync(np.array(1.5), np.array(2.5)), np.array(2.5))
    assert_identical(sync(np.zeros((0, 4)), np.ones((3, 4))), np.ones((3, 4)))


def test_delete():
    (received,) = over_the_wire([delete("gone")])
    assert received.kind == "delete" and received.data is None
    assert apply(np.arange(3), received, LIMITS) is DELETED


def test_several_fields_travel_together():
    old = {"tokens": np.arange(10), "note": "a", "temp": 0.5}
    new = {"tokens": np.arange(12), "note": "ab", "temp": 0.7}
    deltas = [diff(name, old[name], new[name]) for name in old]
    entries, frames = to_wire(deltas)
    assert [e["frame"] for e in entries] == [0, 1, None]
    for received in from_wire(entries, frames, LIMITS):
        assert_identical(apply(old[received.name], received, LIMITS), new[received.name])


def test_set_does_not_alias_the_frame():
    frame = bytearray(np.arange(4, dtype=np.int64).tobytes())
    delta = FieldDelta("f", "set", ArrayMeta(dtype="<i8", shape=(4,), codec="raw", nbytes=32), frame)
    result = apply(None, delta, LIMITS)
    frame[:] = bytes(32)
    assert result.tolist() == [0, 1, 2, 3]
    assert result.flags.writeable


def test_unsupported_values_are_refused_by_diff():
    with pytest.raises(TypeError):
        diff("f", None, np.array(["text"]))
    with pytest.raises(TypeError):
        diff("f", [1, 2], [1, 2])
    with pytest.raises(TypeError):
        diff("f", None, np.float32(1))
    with pytest.raises(ValueError):
        diff("f", None, 1 << 64)


# ------------------------------------------------------------------------------- property

def shapes():
    """0 to 3 dims; the first up to 3000 so that some arrays pass the 64 KiB compression sample."""
    return st.one_of(st.just(()), st.tuples(st.integers(0, 3000)).flatmap(
        lambda first: st.lists(st.integers(0, 5), max_size=2).map(lambda rest: (*first, *rest))))


@st.composite
def array_pairs(draw):
    """(old, new): random dtype and shape, then a sparse edit, a dense rewrite, growth, or another
    shape or dtype altogether."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes())
    old = random_array(rng, dtype, shape)
    change = draw(st.sampled_from(["same", "sparse", "dense", "grow", "reshape", "retype"]))
    if change == "same":
        return old, old.copy()
    if change in ("sparse", "dense"):
        fresh = random_array(rng, dtype, shape)
        mask = rng.random(shape) < (0.02 if change == "sparse" else 0.9)
        return old, np.where(mask, fresh, old).astype(dtype)   # numpy would make the byte order native
    if change == "grow" and shape:
        rows = draw(st.integers(1, 50))
        return old, np.concatenate([old, random_array(rng, dtype, (rows, *shape[1:]))]).astype(dtype)
    return old, random_array(rng, draw(st.sampled_from(DTYPES)) if change == "retype" else dtype, draw(shapes()))


@settings(max_examples=500, deadline=None)
@given(array_pairs())
def test_any_array_change_round_trips_bit_exactly(pair):
    old, new = pair
    assert_identical(sync(old, new), new)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=100)), st.one_of(st.binary(max_size=300),
                                                                             st.text(max_size=100)))
def test_any_text_change_round_trips(old, suffix_or_other):
    assert_identical(sync(old, suffix_or_other), suffix_or_other)
    if type(old) is type(suffix_or_other):
        assert_identical(sync(old, old + suffix_or_other), old + suffix_or_other)


# ------------------------------------------------------------------------------- the choice

def test_sparse_change_of_a_large_float_array_is_a_small_xor():
    rng = np.random.default_rng(2)
    old = rng.standard_normal(4 << 20, dtype=np.float32)
    new = old.copy()
    where = rng.choice(old.size, old.size // 100, replace=False)
    new[where] = rng.standard_normal(where.size, dtype=np.float32)
    delta = diff("weights", old, new)
    assert delta.kind == "xor" and delta.meta.codec == "zstd"
    assert len(delta.data) <= 0.03 * old.nbytes
    assert_identical(sync(old, new), new)


def test_growing_tokens_send_only_the_suffix():
    rng = np.random.default_rng(3)
    history = rng.integers(0, 50_000, 100_000, dtype=np.int64)
    turn = rng.integers(0, 50_000, 300, dtype=np.int64)
    delta = diff("tokens", history, np.concatenate([history, turn]))
    assert delta.kind == "append" and delta.meta.shape == (300,)
    assert len(delta.data) <= turn.nbytes


def test_fresh_random_floats_are_sent_whole_without_zstd():
    rng = np.random.default_rng(4)
    old = rng.standard_normal(1 << 20, dtype=np.float32)
    delta = diff("weights", old, rng.standard_normal(1 << 20, dtype=np.float32))
    assert delta.kind == "set" and delta.meta.codec == "raw" and len(delta.data) == old.nbytes


def test_set_wins_when_the_new_value_compresses_better_than_the_xor():
    old = np.random.default_rng(5).standard_normal(1 << 20, dtype=np.float32)
    delta = diff("weights", old, np.zeros_like(old))
    assert delta.kind == "set" and delta.meta.codec == "zstd" and len(delta.data) < 0.01 * old.nbytes


def test_a_change_confined_to_the_start_is_still_compressed():
    old = np.random.default_rng(6).standard_normal(1 << 20, dtype=np.float32)
    new = old.copy()
    new[:20_000] += 1
    delta = diff("weights", old, new)
    assert delta.kind == "xor" and len(delta.data) < 0.1 * old.nbytes


def test_small_text_is_compressed_only_when_it_shrinks():
    assert diff("f", None, b"ab").meta.codec == "raw"
    assert diff("f", None, b"a" * 1000).meta.codec == "zstd"


# ------------------------------------------------------------------------------- hostile

BASE = np.arange(24, dtype=np.float32).reshape(6, 4)


def array_meta(**changes):
    return {"type": "array", "dtype": "<f4", "shape": [6, 4], "codec": "raw", "nbytes": 96, **changes}


def from_peer(kind: str, meta, data: bytes | None, limits: DeltaLimits) -> FieldDelta:
    """The delta as the receiver decodes it from a peer's entry (meta as the peer sent it) and frame."""
    entry = {"name": "f", "kind": kind, "meta": meta, "frame": None if data is None else 0}
    (delta,) = from_wire([entry], [] if data is None else [data], limits)
    return delta


def bomb(size: int) -> bytes:
    """A streamed zstd frame (no size in its header) that inflates to `size` bytes."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as writer:
        writer.write(bytes(size))
    return out.getvalue()


HOSTILE = {
    # zstd payloads
    "bomb over nbytes": ("set", array_meta(codec="zstd"), bomb(64 << 20), codes.BAD_REQUEST),
    "frame declares more than nbytes": ("set", array_meta(codec="zstd"), safe_zstd.compress(bytes(97)),
                                        codes.BAD_REQUEST),
    "frame holds less than nbytes": ("set", array_meta(codec="zstd"), safe_zstd.compress(bytes(95)),
                                     codes.BAD_REQUEST),
    "truncated frame": ("set", array_meta(codec="zstd"), safe_zstd.compress(bytes(range(96)))[:-3],
                        codes.BAD_REQUEST),
    "trailing garbage": ("set", array_meta(codec="zstd"), safe_zstd.compress(bytes(96)) + b"xx", codes.BAD_REQUEST),
    "not zstd": ("set", array_meta(codec="zstd"), bytes(96), codes.BAD_REQUEST),
    "unknown codec": ("set", array_meta(codec="lz4"), bytes(96), codes.BAD_REQUEST),
    # sizes
    "raw shorter than nbytes": ("set", array_meta(), bytes(95), codes.BAD_REQUEST),
    "raw longer than nbytes": ("set", array_meta(), bytes(97), codes.BAD_REQUEST),
    "nbytes disagrees with shape": ("set", array_meta(nbytes=100), bytes(100), codes.BAD_REQUEST),
    "negative nbytes": ("set", {"type": "bytes", "codec": "raw", "nbytes": -1}, b"", codes.BAD_REQUEST),
    "nbytes over the limit": ("set", {"type": "bytes", "codec": "raw", "nbytes": 1 << 40}, b"", codes.TOO_LARGE),
    "huge shape": ("set", array_meta(shape=[1 << 40, 1 << 40], nbytes=0), b"", codes.TOO_LARGE),
    "too many dims": ("set", array_meta(shape=[1] * 9, nbytes=4), bytes(4), codes.TOO_LARGE),
    "negative shape": ("set", array_meta(shape=[-6, -4]), bytes(96), codes.BAD_REQUEST),
    "float in shape": ("set", array_meta(shape=[6.0, 4]), bytes(96), codes.BAD_REQUEST),
    "bool in shape": ("set", array_meta(shape=[True, 96], nbytes=384), bytes(384), codes.BAD_REQUEST),
    "shape not a list": ("set", array_meta(shape=24), bytes(96), codes.BAD_REQUEST),
    "bool nbytes": ("set", {"type": "bytes", "codec": "raw", "nbytes": True}, b"x", codes.BAD_REQUEST),
    # dtypes
    **{f"dtype {d!r}": ("set", array_meta(dtype=d), bytes(96), codes.BAD_REQUEST)
       for d in ["object", "|O", "V8", "|V8", "<U4", "<c8", "float32", "f4", "=f4", "<f4,<f4", "", 4, None]},
    "bool bytes other than 0 and 1": ("set", array_meta(dtype="|b1", shape=[3], nbytes=3), b"\x00\x01\x02",
                                      codes.BAD_REQUEST),
    # xor and append against the base
    "xor of another shape": ("xor", array_meta(shape=[4, 6]), bytes(96), codes.BAD_REQUEST),
    "xor of another dtype": ("xor", array_meta(dtype="<i4"), bytes(96), codes.BAD_REQUEST),
    "xor of same size, other byte order": ("xor", array_meta(dtype=">f4"), bytes(96), codes.BAD_REQUEST),
    "append of other trailing dims": ("append", array_meta(shape=[2, 3], nbytes=24), bytes(24), codes.BAD_REQUEST),
    "append of other ndim": ("append", array_meta(shape=[8], nbytes=32), bytes(32), codes.BAD_REQUEST),
    "append of another dtype": ("append", array_meta(dtype="<f8", shape=[1, 4], nbytes=32), bytes(32),
                                codes.BAD_REQUEST),
    "append over the limit": ("append", array_meta(shape=[1 << 30, 4], nbytes=1 << 34), b"", codes.TOO_LARGE),
    "append past the limit with the base": ("append", array_meta(shape=[1 << 16, 4], nbytes=1 << 20), b"",
                                            codes.TOO_LARGE),
    "append bytes to an array": ("append", {"type": "bytes", "codec": "raw", "nbytes": 1}, b"x", codes.BAD_REQUEST),
    "xor bytes": ("xor", {"type": "bytes", "codec": "raw", "nbytes": 1}, b"x", codes.BAD_REQUEST),
    # meta and payload presence
    "unknown kind": ("replace", array_meta(), bytes(96), codes.BAD_REQUEST),
    "meta not a map": ("set", [1, 2], bytes(96), codes.BAD_REQUEST),
    "unknown type": ("set", {"type": "tensor"}, None, codes.BAD_REQUEST),
    "missing dtype": ("set", {k: v for k, v in array_meta().items() if k != "dtype"}, bytes(96),
                      codes.BAD_REQUEST),
    "missing payload": ("set", array_meta(), None, codes.BAD_REQUEST),
    "scalar with a payload": ("set", {"type": "scalar", "value": 1}, b"x", codes.BAD_REQUEST),
    "scalar without value": ("set", {"type": "scalar"}, None, codes.BAD_REQUEST),
    "scalar of a list": ("set", {"type": "scalar", "value": [1]}, None, codes.BAD_REQUEST),
    "scalar of a str": ("set", {"type": "scalar", "value": "x"}, None, codes.BAD_REQUEST),
    "delete with a payload": ("delete", {}, b"x", codes.BAD_REQUEST),
    "str not UTF-8": ("set", {"type": "str", "codec": "raw", "nbytes": 2}, b"\xff\xfe", codes.BAD_REQUEST),
}


@pytest.mark.parametrize("kind,meta,data,code", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_delta_is_refused_and_the_base_survives(kind, meta, data, code):
    base, limits = BASE.copy(), DeltaLimits(max_field_bytes=1 << 20)
    with pytest.raises(DeltaError) as caught:
        apply(base, from_peer(kind, meta, data, limits), limits)
    assert caught.value.code == code
    assert base.tobytes() == BASE.tobytes()


@pytest.mark.parametrize("old,kind,meta,data,code", [
    (b"abc", "append", {"type": "str", "codec": "raw", "nbytes": 1}, b"d", codes.BAD_REQUEST),
    ("abc", "append", {"type": "bytes", "codec": "raw", "nbytes": 1}, b"d", codes.BAD_REQUEST),
    (None, "append", {"type": "bytes", "codec": "raw", "nbytes": 1}, b"d", codes.BAD_REQUEST),
    (None, "xor", array_meta(), bytes(96), codes.BAD_REQUEST),
    (np.array(1, dtype=np.float32), "append", array_meta(shape=[], nbytes=4), bytes(4), codes.BAD_REQUEST),
    (b"x" * 1000, "append", {"type": "bytes", "codec": "raw", "nbytes": 100}, bytes(100), codes.TOO_LARGE),
    ("é" * 500, "append", {"type": "str", "codec": "raw", "nbytes": 100}, bytes(100), codes.TOO_LARGE),
], ids=["str onto bytes", "bytes onto str", "onto nothing", "xor onto nothing", "onto a 0-d array",
        "bytes over the limit", "str over the limit in UTF-8"])
def test_append_and_xor_need_a_matching_base(old, kind, meta, data, code):
    before = snapshot(old)
    limits = DeltaLimits(max_field_bytes=1024)
    with pytest.raises(DeltaError) as caught:
        apply(old, from_peer(kind, meta, data, limits), limits)
    assert caught.value.code == code
    assert snapshot(old) == before


def test_the_error_is_an_mcpd_error_with_a_stable_code():
    error = DeltaError(codes.TOO_LARGE, "too big")
    assert isinstance(error, MCPDError) and isinstance(error, ValueError)
    assert error.code == codes.TOO_LARGE and error.message == "too big"


def entry(**changes):
    return {"name": "f", "kind": "set", "meta": {"type": "bytes", "codec": "raw", "nbytes": 1}, "frame": 0,
            **changes}


@pytest.mark.parametrize("entries,frame_count,code", [
    ({"name": "f"}, 1, codes.BAD_REQUEST),
    ([["f", "set"]], 1, codes.BAD_REQUEST),
    ([entry(name=None)], 1, codes.BAD_REQUEST),
    ([entry(name="")], 1, codes.BAD_REQUEST),
    ([entry(name=b"f")], 1, codes.BAD_REQUEST),
    ([entry(name="x" * 257)], 1, codes.BAD_REQUEST),
    ([entry(kind="patch")], 1, codes.BAD_REQUEST),
    ([entry(kind=["set"])], 1, codes.BAD_REQUEST),
    ([entry(meta=None)], 1, codes.BAD_REQUEST),
    ([entry(meta={1: "x"})], 1, codes.BAD_REQUEST),
    ([entry(frame=1)], 1, codes.BAD_REQUEST),
    ([entry(frame=-1)], 1, codes.BAD_REQUEST),
    ([entry(frame=True)], 1, codes.BAD_REQUEST),
    ([entry(frame=0.0)], 1, codes.BAD_REQUEST),
    ([entry(frame="0")], 1, codes.BAD_REQUEST),
    ([entry(), entry(name="g")], 1, codes.BAD_REQUEST),
    ([entry(), entry(frame=None, kind="delete")], 1, codes.BAD_REQUEST),
], ids=["not a list", "entry not a map", "no name", "empty name", "bin name", "long name", "unknown kind",
        "unhashable kind", "meta nil", "meta int key", "frame out of range", "negative frame", "bool frame",
        "float frame", "str frame", "frame reused", "duplicate name"])
def test_hostile_entries_are_refused(entries, frame_count, code):
    with pytest.raises(DeltaError) as caught:
        from_wire(entries, [b"x"] * frame_count, LIMITS)
    assert caught.value.code == code


def test_a_frame_larger_than_any_field_is_refused():
    with pytest.raises(DeltaError) as caught:
        from_wire([entry()], [bytes(2048)], DeltaLimits(max_field_bytes=1024))
    assert caught.value.code == codes.TOO_LARGE


def test_from_wire_accepts_what_a_minimal_peer_sends():
    (received,) = from_wire([{"name": "gone", "kind": "delete"}], [], LIMITS)
    assert received == FieldDelta("gone", "delete", NoMeta(), None)
    (received,) = from_wire([{**entry(), "added_in_v2": 1, "meta": {**entry()["meta"], "added_in_v2": 2}}], [b"x"],
                            LIMITS)
    assert apply(None, received, LIMITS) == b"x"


# ------------------------------------------------------------------------------- large xor, in windows

XOR_BASE = np.random.default_rng(7).standard_normal(300_001, dtype=np.float32)   # several windows, odd size


def xor_payload(new: np.ndarray) -> bytes:
    return safe_zstd.compress((XOR_BASE.view(np.uint8) ^ new.view(np.uint8)).tobytes())


def xor_meta() -> ArrayMeta:
    return ArrayMeta(dtype="<f4", shape=(XOR_BASE.size,), codec="zstd", nbytes=XOR_BASE.nbytes)


def test_large_identical_arrays_need_no_delta():
    assert diff("w", XOR_BASE, XOR_BASE.copy()) is None


@pytest.mark.parametrize("where", [0, 150_000, -1], ids=["first", "middle", "last"])
def test_a_single_flip_anywhere_in_a_large_array_round_trips(where):
    new = XOR_BASE.copy()
    new.view(np.uint32)[where] ^= 1
    delta = diff("w", XOR_BASE, new)
    assert delta.kind == "xor" and delta.meta.nbytes == XOR_BASE.nbytes
    assert zstandard.frame_content_size(delta.data) == XOR_BASE.nbytes
    assert len(delta.data) < 0.01 * XOR_BASE.nbytes
    assert_identical(sync(XOR_BASE, new), new)


@pytest.mark.parametrize("dtype", ["|u1", "<f2", ">f8", "<i8"])
def test_large_xor_round_trips_for_odd_sizes_and_byte_orders(dtype):
    rng = np.random.default_rng(8)
    old = random_array(rng, dtype, (3, 70_001))
    new = old.copy()
    new.reshape(-1)[rng.choice(new.size, new.size // 200, replace=False)] = 7
    delta = diff("w", old, new)
    assert delta.kind == "xor"
    assert_identical(sync(old, new), new)
    assert_identical(sync(old[:, ::2], new[:, ::2]), np.ascontiguousarray(new[:, ::2]))   # not contiguous


def test_xor_frame_of_unstated_size_is_applied():
    new = XOR_BASE.copy()
    new[5] = 1
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as writer:
        writer.write((XOR_BASE.view(np.uint8) ^ new.view(np.uint8)).tobytes())
    streamed = out.getvalue()
    assert zstandard.frame_content_size(streamed) == -1
    assert_identical(apply(XOR_BASE, FieldDelta("w", "xor", xor_meta(), streamed), LIMITS), new)


LARGE_XOR_HOSTILE = {
    "bomb": bomb(64 << 20),
    "declares more": safe_zstd.compress(bytes(XOR_BASE.nbytes + 1)),
    "declares less": safe_zstd.compress(bytes(XOR_BASE.nbytes - 1)),
    "truncated": xor_payload(XOR_BASE + 1)[:-3],
    "cut in half": xor_payload(XOR_BASE + 1)[:len(xor_payload(XOR_BASE + 1)) // 2],
    "trailing garbage": xor_payload(XOR_BASE + 1) + b"xx",
    "second frame": xor_payload(XOR_BASE + 1) + xor_payload(XOR_BASE + 1),
    # zstd keeps no checksum of the content here, so only corruption that breaks the format shows.
    "reserved block type": (lambda f, h: f[:h] + bytes([f[h] | 0b110]) + f[h + 1:])(
        xor_payload(XOR_BASE + 1), zstandard.frame_header_size(xor_payload(XOR_BASE + 1))),
    "garbage block body": (lambda f, h: f[:h + 3] + b"\xff" * 64 + f[h + 3 + 64:])(
        xor_payload(XOR_BASE + 1), zstandard.frame_header_size(xor_payload(XOR_BASE + 1))),
    "not zstd": bytes(64),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["apply", "apply_in_place"])
@pytest.mark.parametrize("payload", LARGE_XOR_HOSTILE.values(), ids=LARGE_XOR_HOSTILE.keys())
def test_hostile_large_xor_is_refused_and_the_base_survives(payload, in_place):
    base = XOR_BASE.copy()
    with pytest.raises(DeltaError) as caught:
        (apply_in_place if in_place else apply)(base, FieldDelta("w", "xor", xor_meta(), payload), LIMITS)
    assert caught.value.code == codes.BAD_REQUEST
    assert base.tobytes() == XOR_BASE.tobytes()


@pytest.mark.parametrize("size", [XOR_BASE.size, 1001], ids=["zstd windows", "small raw"])
def test_xor_in_place_changes_the_base_and_a_second_apply_undoes_it(size):
    base = XOR_BASE[:size].copy()
    new = base.copy()
    new[::97] += 1
    (received,) = over_the_wire([diff("w", base, new)])
    assert received.kind == "xor" and apply_in_place(base, received, LIMITS)
    assert base.tobytes() == new.tobytes()
    assert apply_in_place(base, received, LIMITS)
    assert base.tobytes() == XOR_BASE[:size].tobytes()


def test_in_place_declines_what_only_apply_can_do():
    base = XOR_BASE.copy()
    new = base + 1
    xor = diff("w", base, base * np.float32(1.0001))
    assert not apply_in_place(base, diff("w", base, new[:10]), LIMITS)        # set: a fresh value
    assert not apply_in_place(base[::2], xor, LIMITS)                          # not contiguous
    assert not apply_in_place(b"bytes", xor, LIMITS)                           # not an array
    frozen = base.copy()
    frozen.flags.writeable = False
    assert not apply_in_place(frozen, xor, LIMITS)


def test_in_place_refuses_a_bool_result_that_is_not_0_or_1():
    base = np.zeros(1000, np.bool_)
    payload = np.zeros(1000, np.uint8)
    payload[7] = 2
    meta = ArrayMeta(dtype="|b1", shape=(1000,), codec="raw", nbytes=1000)
    with pytest.raises(DeltaError):
        apply_in_place(base, FieldDelta("w", "xor", meta, payload.tobytes()), LIMITS)
    assert not base.any()
