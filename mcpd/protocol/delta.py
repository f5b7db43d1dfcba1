"""Field deltas: how one named field of a context changes, encoded small for the wire.

Both sides use this module: a client diffs a field against its last synced copy and sends the
delta; the daemon applies it (and diffs the other way for `get since version`). A field's value
is a numpy array of a numeric dtype, bytes, str, or a scalar (None, bool, int, float).

A delta is (name, kind, meta, data). `data` is the payload and travels as its own ZMQ frame;
`meta` is a small msgpack map describing it:

| kind   | value  | meta                                                        | payload          |
|--------|--------|-------------------------------------------------------------|------------------|
| set    | array  | type "array", dtype, shape, codec, nbytes                   | the array, C order |
| set    | bytes  | type "bytes", codec, nbytes                                 | the bytes        |
| set    | str    | type "str", codec, nbytes                                   | UTF-8            |
| set    | scalar | type "scalar", value (nil, bool, int or float)              | none             |
| append | array  | as set; shape is the added rows' (same trailing dims)       | the added rows   |
| append | bytes, str | as set                                                  | the added suffix |
| xor    | array  | as set; dtype and shape equal the base's                    | base bytes XOR new bytes |
| delete | —      | {}                                                          | none             |

dtype is numpy's `dtype.str` ("<f4", "|u1", "|b1", ...) of bool, int8..int64, uint8..uint64,
float16, float32 or float64, either byte order. codec is "raw" or "zstd" (one zstd frame that
states its content size); nbytes is the payload's size after decoding.

`apply` treats a delta as hostile: every meta field is checked, sizes are checked before
anything is allocated or decompressed, and the old value is never modified. `apply_in_place`
(xor only) changes the old array itself, and leaves it as it was if the delta is rejected.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from mcpd.protocol import codes, safe_zstd
from mcpd.protocol.codes import MCPDError

KINDS = ("set", "append", "xor", "delete")
MAX_NAME_CHARS = 256
ALLOWED_DTYPES = frozenset(
    np.dtype(t).newbyteorder(order).str
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64,
              np.uint8, np.uint16, np.uint32, np.uint64, np.float16, np.float32, np.float64)
    for order in "<>")
# Level 1 beats 3 here: on a 64 MB XOR of a 1%-changed float32 array it packs to 1.67% (level 3:
# 1.81%) in 25 ms (level 3: 40 ms). Worker threads made a one-shot compress slower on this
# 2-core machine, but an XOR streamed to the compressor in windows gains from them: they pack
# while this thread XORs the next window. XOR and pack of a 64 MB float32 array, medians on this
# machine, 0 / 1 / 2 / 4 workers: 0.1% changed 24 / 17 / 16 / 17 ms; 1% 37 / 30 / 28 / 31 ms;
# 10% 173 / 154 / 104 / 89 ms. Worker counts do not change the frame (zstd promises as much).
COMPRESSION_LEVEL = 1
XOR_COMPRESSION_THREADS = 2
# XOR deltas are mostly zero runs, which zstd's fast (negative) levels find as well as level 1:
# a 1%-changed 64 MB float32 XOR packs to 1.66% at both -1 and 1, in 20 ms against 23 ms (two
# workers; at 10% changed 13.9% against 13.6%). Below -1 the frames grow (-3: 1.93%).
XOR_COMPRESSION_LEVEL = -1
# Large XORs are made, packed and (on apply) unpacked window by window: no payload-sized
# intermediate, and each window is still in cache when the next step reads it.
XOR_WINDOW_BYTES = 1 << 20
# zstd only pays when it saves real bytes. Measured on 1 MiB at level 1: fresh float16/32/64 data
# packs 1.04x-1.12x (normal, uniform, small weights); int32 token ids 1.44x, int64 ones 4x; XOR
# deltas 1.33x with 70% of elements changed, 2.7x at 30%, 60x at 1%. Compressing costs about
# 2-3 ms per MB (packing at 250-800 MB/s, unpacking at ~1 GB/s) while a 1 Gb/s link carries a MB
# in 8 ms, so saving less than a fifth (ratio < 1.25) does not repay the time on any link this
# daemon sits on; 1.25 also stays clear of fresh floats' 1.12 when a sample runs a little high.
MIN_SAMPLE_RATIO = 1.25
# The sample is spread over the payload so that a change confined to one end (the first rows
# rewritten, the rest untouched) does not decide for all of it.
SAMPLE_WINDOWS = 8
SAMPLE_WINDOW_BYTES = 8 << 10
SAMPLE_BYTES = SAMPLE_WINDOWS * SAMPLE_WINDOW_BYTES
MSGPACK_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
SCALAR_TYPES = (type(None), bool, int, float)


@dataclass(frozen=True)
class FieldDelta:
    name: str
    kind: str            # one of KINDS
    meta: dict           # see the table in the module docstring
    data: bytes | None   # the payload (any bytes-like object when it came off the wire); None for scalars, delete


@dataclass(frozen=True)
class DeltaLimits:
    max_field_bytes: int = 256 << 20
    max_ndim: int = 8


class _Deleted:
    def __repr__(self) -> str:
        return "DELETED"


DELETED = _Deleted()   # what `apply` returns for a delete: None is a value a field can hold


class DeltaError(MCPDError, ValueError):
    """A delta that cannot be applied; `code` is BAD_REQUEST (malformed) or TOO_LARGE (over limits)."""


# ---------------------------------------------------------------------------------------- diff

def diff(name: str, old, new) -> FieldDelta | None:
    """The smallest delta that turns `old` into `new`, or None when they are bit-identical."""
    if isinstance(new, np.ndarray):
        return _diff_array(name, old, new)
    if not isinstance(new, (bytes, str)) and type(new) not in SCALAR_TYPES:
        raise TypeError(f"field {name!r}: cannot sync a {type(new).__name__}")
    if _same_value(old, new):
        return None
    if isinstance(new, (bytes, str)):
        return _diff_text(name, old, new)
    _check_scalar(new)
    return FieldDelta(name, "set", {"type": "scalar", "value": new}, None)


def delete(name: str) -> FieldDelta:
    return FieldDelta(name, "delete", {}, None)


def _diff_array(name: str, old, new: np.ndarray) -> FieldDelta | None:
    if new.dtype.str not in ALLOWED_DTYPES:
        raise TypeError(f"field {name!r}: dtype {new.dtype} is not a plain numeric dtype")
    new_bytes = _byte_view(new)
    meta = {"type": "array", "dtype": new.dtype.str, "shape": list(new.shape)}
    if _extends(old, new, new_bytes):
        # Only the new rows travel. Their encoding is never meaningfully larger than the whole
        # array's (they are a suffix of it), so set is not worth a compression pass.
        added = {**meta, "shape": [new.shape[0] - old.shape[0], *new.shape[1:]]}
        return _packed(name, "append", added, new_bytes[old.nbytes:])
    if not _same_layout(old, new):
        return _packed(name, "set", meta, new_bytes)
    old_bytes = _byte_view(old)
    if new_bytes.size > SAMPLE_BYTES:
        squeezed = _squeezed_xor(old_bytes, new_bytes)
    else:
        flips = _xor(old_bytes, new_bytes).view(np.uint8)
        squeezed = _squeezed(flips) if flips.any() else _IDENTICAL
    if squeezed is _IDENTICAL:
        return None
    if squeezed is None:
        # XOR bytes that do not compress are as many as the array's: set is no larger and does
        # not depend on the receiver's copy.
        return _packed(name, "set", meta, new_bytes)
    xor = FieldDelta(name, "xor", {**meta, "codec": "zstd", "nbytes": new_bytes.size}, squeezed)
    if not _whole_may_beat(new_bytes, len(squeezed)):
        return xor
    whole = _packed(name, "set", meta, new_bytes)
    # On a tie, set wins, for the same reason.
    return whole if len(whole.data) <= len(squeezed) else xor


def _same_layout(old, new: np.ndarray) -> bool:
    return isinstance(old, np.ndarray) and old.dtype.str == new.dtype.str and old.shape == new.shape


def _extends(old, new: np.ndarray, new_bytes: np.ndarray) -> bool:
    """Whether `new` is `old` with rows added along axis 0."""
    if not (isinstance(old, np.ndarray) and old.dtype.str == new.dtype.str and old.ndim == new.ndim >= 1
            and old.shape[1:] == new.shape[1:] and old.shape[0] < new.shape[0]):
        return False
    return bool(np.array_equal(_words(new_bytes[:old.nbytes]), _words(_byte_view(old))))


def _whole_may_beat(new_bytes: np.ndarray, edit_size: int) -> bool:
    """Whether packing the whole array might come out smaller than the edit. A full zstd pass
    over a large array costs more than the rest of the diff, so a sample decides; it estimates,
    hence the factor of two."""
    return new_bytes.size <= SAMPLE_BYTES or new_bytes.size / _sample_ratio(new_bytes) < 2 * edit_size


def _diff_text(name: str, old, new: bytes | str) -> FieldDelta:
    meta = {"type": "str" if isinstance(new, str) else "bytes"}
    if type(old) is type(new) and len(new) > len(old) and new.startswith(old):
        return _packed(name, "append", meta, _text_bytes(new[len(old):]))
    return _packed(name, "set", meta, _text_bytes(new))


def _text_bytes(text: bytes | str) -> np.ndarray:
    return np.frombuffer(text.encode() if isinstance(text, str) else text, np.uint8)


def _same_value(old, new) -> bool:
    if type(old) is not type(new):
        return False
    if isinstance(new, float):
        # Bit equality: 0.0 == -0.0 and nan != nan, but a sync must reproduce both exactly.
        return struct.pack("<d", old) == struct.pack("<d", new)
    return old == new


def _check_scalar(value) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        low, high = MSGPACK_INT_RANGE
        if not low <= value <= high:
            raise ValueError(f"int {value} does not fit msgpack's 64 bits")


def _packed(name: str, kind: str, meta: dict, payload: np.ndarray) -> FieldDelta:
    meta = {**meta, "nbytes": payload.size}
    squeezed = _squeezed(payload)
    if squeezed is None:
        return FieldDelta(name, kind, {**meta, "codec": "raw"}, payload.tobytes())
    return FieldDelta(name, kind, {**meta, "codec": "zstd"}, squeezed)


def _squeezed(payload: np.ndarray) -> bytes | None:
    """The payload as a zstd frame, or None when that would not be smaller (or not worth it)."""
    if payload.size > SAMPLE_BYTES and _sample_ratio(payload) < MIN_SAMPLE_RATIO:
        return None
    frame = safe_zstd.compress(payload, COMPRESSION_LEVEL)
    return frame if len(frame) < payload.size else None


_IDENTICAL = object()   # what _squeezed_xor returns when the two arrays are bit-identical


def _squeezed_xor(old_bytes: np.ndarray, new_bytes: np.ndarray):
    """`_squeezed` of old XOR new (a payload larger than the sample), or _IDENTICAL, without
    making the XOR in one piece: it is made and packed window by window."""
    windows = _sample_windows(new_bytes.size)
    sample = np.concatenate([np.bitwise_xor(old_bytes[w], new_bytes[w]) for w in windows])
    if _ratio(sample) < MIN_SAMPLE_RATIO:
        # Not worth packing. The arrays differ: a sample of XOR zeros packs far better than this.
        return None
    changed = []
    frame = safe_zstd.compress_chunks(_xor_windows(old_bytes, new_bytes, changed), new_bytes.size,
                                      XOR_COMPRESSION_LEVEL, threads=XOR_COMPRESSION_THREADS)
    if not changed:
        return _IDENTICAL
    return frame if len(frame) < new_bytes.size else None


def _xor_windows(old_bytes: np.ndarray, new_bytes: np.ndarray, changed: list):
    """old XOR new in windows of one reused buffer (each valid until the next is asked for);
    appends True to `changed` once a window holds a set bit."""
    old_words, new_words = _words(old_bytes), _words(new_bytes)
    step = max(XOR_WINDOW_BYTES // old_words.itemsize, 1)
    buffer = np.empty(min(step, old_words.size), old_words.dtype)
    for at in range(0, old_words.size, step):
        window = buffer[:min(step, old_words.size - at)]
        np.bitwise_xor(old_words[at:at + window.size], new_words[at:at + window.size], out=window)
        if not changed and window.any():
            changed.append(True)
        yield window


def _sample_windows(size: int) -> list[slice]:
    step = size // SAMPLE_WINDOWS
    return [slice(i * step, i * step + SAMPLE_WINDOW_BYTES) for i in range(SAMPLE_WINDOWS)]


def _sample_ratio(payload: np.ndarray) -> float:
    return _ratio(np.concatenate([payload[w] for w in _sample_windows(payload.size)]))


def _ratio(sample: np.ndarray) -> float:
    return sample.size / len(safe_zstd.compress(sample, COMPRESSION_LEVEL))


# --------------------------------------------------------------------------------------- apply

def apply(old, delta: FieldDelta, limits: DeltaLimits):
    """The field's new value (DELETED for a delete). Never modifies `old`; raises DeltaError."""
    meta = delta.meta
    if delta.kind == "delete":
        _expect_no_payload(delta.data)
        return DELETED
    if delta.kind not in KINDS:
        raise _bad(f"unknown delta kind {delta.kind!r}")
    if not isinstance(meta, dict):
        raise _bad("meta must be a map")
    value_type = _required(meta, "type", str)
    if value_type == "scalar" and delta.kind == "set":
        _expect_no_payload(delta.data)
        return _scalar(meta)
    if value_type == "array":
        return _apply_array(old, delta, limits)
    if value_type in ("bytes", "str") and delta.kind in ("set", "append"):
        return _apply_text(old, delta, value_type, limits)
    raise _bad(f"a {delta.kind} delta cannot carry a value of type {value_type!r}")


def _scalar(meta: dict):
    if "value" not in meta:
        raise _bad("meta has no 'value'")
    value = meta["value"]
    if type(value) not in SCALAR_TYPES:
        raise _bad(f"a scalar value must be nil, bool, int or float, not {type(value).__name__}")
    return value


def _apply_array(old, delta: FieldDelta, limits: DeltaLimits) -> np.ndarray:
    dtype, shape = _array_layout(delta.meta, limits)
    if delta.kind == "set":
        payload = _payload(delta, _nbytes(dtype, shape), limits.max_field_bytes)
        return _checked_bools(_new_array(dtype, shape, [payload]))
    base = _array_base(old, dtype)
    if delta.kind == "xor":
        if base.shape != shape:
            raise _bad(f"xor of shape {list(shape)} onto an array of shape {list(base.shape)}")
        return _checked_bools(_apply_xor(base, delta, limits))
    if not shape or base.shape[1:] != shape[1:]:
        raise _bad(f"cannot append rows of shape {list(shape)} to an array of shape {list(base.shape)}")
    payload = _payload(delta, _nbytes(dtype, shape), limits.max_field_bytes - base.nbytes)
    return _checked_bools(_new_array(dtype, (base.shape[0] + shape[0], *shape[1:]), [_byte_view(base), payload]))


def _array_layout(meta: dict, limits: DeltaLimits) -> tuple[np.dtype, tuple[int, ...]]:
    dtype_str = _required(meta, "dtype", str)
    # Checked against the allow-list before numpy parses it: np.dtype() of a peer's string could
    # build object, structured or gigantic void dtypes.
    if dtype_str not in ALLOWED_DTYPES:
        raise _bad(f"dtype {dtype_str!r} is not allowed (plain numeric dtypes only, as numpy's dtype.str)")
    shape = _required(meta, "shape", (list, tuple))
    if len(shape) > limits.max_ndim:
        raise DeltaError(codes.TOO_LARGE, f"{len(shape)} dimensions; the limit is {limits.max_ndim}")
    if not all(type(n) is int and n >= 0 for n in shape):
        raise _bad(f"shape must be non-negative ints, not {shape!r}")
    dtype, shape = np.dtype(dtype_str), tuple(shape)
    if _nbytes(dtype, shape) > limits.max_field_bytes:
        raise DeltaError(codes.TOO_LARGE, f"shape {list(shape)} of {dtype_str} is {_nbytes(dtype, shape)} bytes; "
                                          f"the limit is {limits.max_field_bytes}")
    return dtype, shape


def _array_base(old, dtype: np.dtype) -> np.ndarray:
    if not isinstance(old, np.ndarray):
        raise _bad(f"the field holds a {type(old).__name__}, not an array")
    if old.dtype.str != dtype.str:
        raise _bad(f"delta of dtype {dtype.str} onto an array of dtype {old.dtype.str}")
    return old


def _apply_text(old, delta: FieldDelta, value_type: str, limits: DeltaLimits) -> bytes | str:
    text_class = str if value_type == "str" else bytes
    room = limits.max_field_bytes
    if delta.kind == "append":
        if type(old) is not text_class:
            raise _bad(f"cannot append {value_type} to a {type(old).__name__}")
        room -= len(old.encode()) if text_class is str else len(old)
    payload = _payload(delta, _required(delta.meta, "nbytes", int), room)
    if text_class is str:
        try:
            added = str(payload, "utf-8")
        except UnicodeDecodeError as e:
            raise _bad(f"str payload is not UTF-8: {e}") from None
    else:
        added = bytes(payload)
    return old + added if delta.kind == "append" else added


def _apply_xor(base: np.ndarray, delta: FieldDelta, limits: DeltaLimits) -> np.ndarray:
    """base XOR the payload, as a fresh array."""
    out = np.empty(base.shape, base.dtype)
    _xor_payload_into(base, delta, limits, out)
    return out


def apply_in_place(old, delta: FieldDelta, limits: DeltaLimits) -> bool:
    """Apply an xor delta by changing `old` itself, when `old` is a writable C-contiguous array
    of the delta's dtype and shape; says whether it did (False: use `apply`). Raises DeltaError
    with `old` exactly as it was. XOR is its own inverse: applying the same delta again undoes it,
    which is how a caller rolls back an update whose later fields fail.

    Why: the daemon's copy of a big field is rewritten by every sync, and a fresh 64 MB result
    costs as much in page faults and memory traffic as the XOR itself."""
    if delta.kind != "xor" or not (isinstance(old, np.ndarray) and old.flags.c_contiguous and old.flags.writeable):
        return False
    if not isinstance(delta.meta, dict) or delta.meta.get("type") != "array":
        return False   # `apply` names what is wrong with it
    dtype, shape = _array_layout(delta.meta, limits)
    if _array_base(old, dtype).shape != shape:
        raise _bad(f"xor of shape {list(shape)} onto an array of shape {list(old.shape)}")
    _xor_payload_into(old, delta, limits, old)
    try:
        _checked_bools(old)
    except DeltaError:
        _xor_payload_into(old, delta, limits, old)
        raise
    return True


def _xor_payload_into(base: np.ndarray, delta: FieldDelta, limits: DeltaLimits, out: np.ndarray) -> None:
    """out = base XOR the payload (`out` may be `base`). A zstd payload is unpacked window by
    window straight into `out`: the decoded payload never exists in one piece. If it is rejected
    part way, the windows already XORed into `base` itself are XORed again, undoing them."""
    codec, data = _encoded_payload(delta, base.nbytes, limits.max_field_bytes)
    base_bytes, out_bytes = _byte_view(base), _byte_view(out)
    if codec == "raw":
        np.bitwise_xor(_words(base_bytes), _words(np.frombuffer(data, np.uint8)), out=_words(out_bytes))
        return
    done = 0
    try:
        for window in safe_zstd.decompress_chunks(data, base.nbytes, XOR_WINDOW_BYTES):
            done = _xor_window(base_bytes, window, out_bytes, done)
    except safe_zstd.DecompressionRejected as e:
        if out is base:
            _undo_xor_windows(out_bytes, data, done)
        raise _bad(f"zstd payload rejected: {e}") from None


def _xor_window(base_bytes: np.ndarray, window, out_bytes: np.ndarray, at: int) -> int:
    end = at + len(window)
    np.bitwise_xor(_words(base_bytes[at:end]), _words(np.frombuffer(window, np.uint8)), out=_words(out_bytes[at:end]))
    return end


def _undo_xor_windows(target: np.ndarray, data, done: int) -> None:
    """XOR the first `done` bytes of the payload into `target` again. They decode as they did the
    first time: the rejection comes again, and no sooner than after them."""
    at = 0
    try:
        for window in safe_zstd.decompress_chunks(data, target.size, XOR_WINDOW_BYTES):
            if at >= done:
                return
            at = _xor_window(target, window, target, at)
    except safe_zstd.DecompressionRejected:
        pass


def _payload(delta: FieldDelta, expected: int, room: int) -> bytes | memoryview:
    """The decoded payload, checked to be exactly `expected` bytes and to fit in `room`."""
    codec, data = _encoded_payload(delta, expected, room)
    nbytes = delta.meta["nbytes"]
    if codec == "raw":
        decoded = data
    else:
        try:
            decoded = safe_zstd.decompress(data, max_output=nbytes)
        except safe_zstd.DecompressionRejected as e:
            raise _bad(f"zstd payload rejected: {e}") from None
    if len(decoded) != nbytes:
        raise _bad(f"payload decodes to {len(decoded)} bytes; meta says {nbytes}")
    return decoded


def _encoded_payload(delta: FieldDelta, expected: int, room: int) -> tuple[str, memoryview]:
    """The payload's codec ("raw" or "zstd") and its bytes as they came, once the meta is checked:
    `expected` bytes decoded, fitting in `room`. A raw payload is checked to be `expected` bytes."""
    meta = delta.meta
    nbytes, codec = _required(meta, "nbytes", int), _required(meta, "codec", str)
    if nbytes < 0:
        raise _bad(f"meta nbytes must not be negative, not {nbytes}")
    if expected > room:
        raise DeltaError(codes.TOO_LARGE, f"a payload of {expected} bytes does not fit in the {max(room, 0)} "
                                          "bytes the field limit leaves")
    if nbytes != expected:
        raise _bad(f"meta says nbytes={nbytes}; dtype and shape make it {expected}")
    if delta.data is None:
        raise _bad("the delta needs a payload frame")
    data = memoryview(delta.data).cast("B")
    if codec not in ("raw", "zstd"):
        raise _bad(f"unknown codec {codec!r}")
    if codec == "raw" and len(data) != nbytes:
        raise _bad(f"payload decodes to {len(data)} bytes; meta says {nbytes}")
    return codec, data


def _new_array(dtype: np.dtype, shape: tuple[int, ...], parts: list) -> np.ndarray:
    """A fresh C-contiguous array filled from byte buffers: nothing aliases the ZMQ frames (the
    daemon frees them) or the old value."""
    out = np.empty(shape, dtype)
    flat, at = _byte_view(out), 0
    for part in parts:
        part = np.frombuffer(part, np.uint8)
        flat[at:at + part.size] = part
        at += part.size
    return out


def _checked_bools(array: np.ndarray) -> np.ndarray:
    """numpy bools must be bytes 0 or 1; any other byte is a value numpy's own code never makes."""
    if array.dtype == np.bool_ and _byte_view(array).max(initial=0) > 1:
        raise _bad("bool array holds bytes other than 0 and 1")
    return array


def _expect_no_payload(data) -> None:
    if data is not None:
        raise _bad("this delta carries no payload frame")


def _nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _required(meta: dict, key: str, kind: type | tuple[type, ...]):
    value = meta.get(key)
    # bool is an int in Python but never a size or a count on the wire.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _bad(f"meta {key!r} must be {_type_names(kind)}, not {type(value).__name__}")
    return value


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def _bad(message: str) -> DeltaError:
    return DeltaError(codes.BAD_REQUEST, message)


# ---------------------------------------------------------------------------------- bytes views

def _byte_view(array: np.ndarray) -> np.ndarray:
    """The array's bytes as flat uint8 (a view when the array is C-contiguous, else a copy)."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array.reshape(-1).view(np.uint8)


def _words(byte_view: np.ndarray) -> np.ndarray:
    """The widest unsigned-int view of the bytes: numpy compares and XORs 8 bytes at a time."""
    for word in (np.uint64, np.uint32, np.uint16):
        if byte_view.size % np.dtype(word).itemsize == 0:
            return byte_view.view(word)
    return byte_view


def _xor(old_bytes: np.ndarray, new_bytes: np.ndarray) -> np.ndarray:
    return np.bitwise_xor(_words(old_bytes), _words(new_bytes))


# ---------------------------------------------------------------------------------------- wire

def to_wire(deltas: list[FieldDelta]) -> tuple[list[dict], list[bytes]]:
    """msgpack-able entries {"name", "kind", "meta", "frame"} and the payload frames they index."""
    entries, frames = [], []
    for delta in deltas:
        index = None
        if delta.data is not None:
            index = len(frames)
            frames.append(delta.data)
        entries.append({"name": delta.name, "kind": delta.kind, "meta": delta.meta, "frame": index})
    return entries, frames


def from_wire(entries, frames: list, limits: DeltaLimits) -> list[FieldDelta]:
    """Deltas from a peer's entries (as msgpack decoded them) and frames; raises DeltaError.

    Checks the envelope: types, names, frame indexes. `apply` checks each delta's meta.
    `meta` may be left out (as {}), and so may `frame` (as nil); unknown entry keys are ignored,
    like unknown header keys, so a newer peer can add some.
    """
    if not isinstance(entries, (list, tuple)):
        raise _bad(f"deltas must be an array, not {type(entries).__name__}")
    names, used_frames, deltas = set(), set(), []
    for entry in entries:
        delta = _entry(entry, frames, used_frames, limits)
        if delta.name in names:
            raise _bad(f"field {delta.name!r} appears twice")
        names.add(delta.name)
        deltas.append(delta)
    return deltas


def _entry(entry, frames: list, used_frames: set, limits: DeltaLimits) -> FieldDelta:
    if not isinstance(entry, dict):
        raise _bad(f"a delta must be a map, not {type(entry).__name__}")
    name, kind, meta, index = entry.get("name"), entry.get("kind"), entry.get("meta", {}), entry.get("frame")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise _bad(f"a field name must be a str of 1..{MAX_NAME_CHARS} characters")
    if kind not in KINDS:
        raise _bad(f"field {name!r}: kind must be one of {', '.join(KINDS)}")
    if not isinstance(meta, dict) or not all(isinstance(key, str) for key in meta):
        raise _bad(f"field {name!r}: meta must be a map with str keys")
    return FieldDelta(name, kind, meta, _frame(name, index, frames, used_frames, limits))


def _frame(name: str, index, frames: list, used_frames: set, limits: DeltaLimits):
    if index is None:
        return None
    if type(index) is not int or not 0 <= index < len(frames):
        raise _bad(f"field {name!r}: frame must be nil or an index below {len(frames)}, not {index!r}")
    if index in used_frames:
        raise _bad(f"field {name!r}: frame {index} is already used by another field")
    used_frames.add(index)
    frame = frames[index]
    # A payload frame is never larger than its field (zstd is only used when it shrinks data).
    if memoryview(frame).nbytes > limits.max_field_bytes:
        raise DeltaError(codes.TOO_LARGE,
                         f"field {name!r}: payload frame of {memoryview(frame).nbytes} bytes; "
                         f"the limit is {limits.max_field_bytes}")
    return frame
