"""apply: a peer's delta onto a field's value, treating the delta as hostile: its meta came typed
(protocol/change_entry.py) and every value in it is checked here, sizes before anything is
allocated or decompressed, and the old value is never modified. apply_in_place (xor only)
changes the old array itself, and leaves it as it was if the delta is rejected."""
from __future__ import annotations

import numpy as np

from mcpd.protocol import codes, safe_zstd
from mcpd.protocol.change_entry import ArrayMeta, PayloadMeta, ScalarMeta, StrMeta
from mcpd.protocol.delta.field import (ALLOWED_DTYPES, DELETED, DeltaError, DeltaLimits, FieldDelta, bad, byte_view,
                                       size_of, words)
from mcpd.protocol.delta.compress import XOR_WINDOW_BYTES


def apply(old, delta: FieldDelta, limits: DeltaLimits):
    """The field's new value (DELETED for a delete). Never modifies `old`; raises DeltaError."""
    meta = delta.meta
    if delta.kind == "delete":
        _expect_no_payload(delta.data)
        return DELETED
    if isinstance(meta, ScalarMeta) and delta.kind == "set":
        _expect_no_payload(delta.data)
        return meta.value
    if isinstance(meta, ArrayMeta):
        return _apply_array(old, delta, limits)
    if isinstance(meta, PayloadMeta) and delta.kind in ("set", "append"):
        return _apply_text(old, delta, limits)
    raise bad(f"a {delta.kind} delta cannot carry a {type(meta).__name__}")


def _apply_array(old, delta: FieldDelta, limits: DeltaLimits) -> np.ndarray:
    dtype, shape = _array_layout(delta.meta, limits)
    if delta.kind == "set":
        payload = _payload(delta, size_of(dtype, shape), limits.max_field_bytes)
        return _checked_bools(_new_array(dtype, shape, [payload]))
    base = _array_base(old, dtype)
    if delta.kind == "xor":
        if base.shape != shape:
            raise bad(f"xor of shape {list(shape)} onto an array of shape {list(base.shape)}")
        return _checked_bools(_apply_xor(base, delta, limits))
    if not shape or base.shape[1:] != shape[1:]:
        raise bad(f"cannot append rows of shape {list(shape)} to an array of shape {list(base.shape)}")
    payload = _payload(delta, size_of(dtype, shape), limits.max_field_bytes - base.nbytes)
    return _checked_bools(_new_array(dtype, (base.shape[0] + shape[0], *shape[1:]), [byte_view(base), payload]))


def _array_layout(meta: ArrayMeta, limits: DeltaLimits) -> tuple[np.dtype, tuple[int, ...]]:
    dtype_str, shape = meta.dtype, meta.shape
    # Checked against the allow-list before numpy parses it: np.dtype() of a peer's string could
    # build object, structured or gigantic void dtypes.
    if dtype_str not in ALLOWED_DTYPES:
        raise bad(f"dtype {dtype_str!r} is not allowed (plain numeric dtypes only, as numpy's dtype.str)")
    if len(shape) > limits.max_ndim:
        raise DeltaError(codes.TOO_LARGE, f"{len(shape)} dimensions; the limit is {limits.max_ndim}")
    if not all(n >= 0 for n in shape):
        raise bad(f"shape must be non-negative ints, not {list(shape)}")
    dtype = np.dtype(dtype_str)
    if size_of(dtype, shape) > limits.max_field_bytes:
        raise DeltaError(codes.TOO_LARGE, f"shape {list(shape)} of {dtype_str} is {size_of(dtype, shape)} bytes; "
                                          f"the limit is {limits.max_field_bytes}")
    return dtype, shape


def _array_base(old, dtype: np.dtype) -> np.ndarray:
    if not isinstance(old, np.ndarray):
        raise bad(f"the field holds a {type(old).__name__}, not an array")
    if old.dtype.str != dtype.str:
        raise bad(f"delta of dtype {dtype.str} onto an array of dtype {old.dtype.str}")
    return old


def _apply_text(old, delta: FieldDelta, limits: DeltaLimits) -> bytes | str:
    text_class = str if isinstance(delta.meta, StrMeta) else bytes
    room = limits.max_field_bytes
    if delta.kind == "append":
        if type(old) is not text_class:
            raise bad(f"cannot append {text_class.__name__} to a {type(old).__name__}")
        room -= len(old.encode()) if text_class is str else len(old)
    payload = _payload(delta, delta.meta.nbytes, room)
    if text_class is str:
        try:
            added = str(payload, "utf-8")
        except UnicodeDecodeError as e:
            raise bad(f"str payload is not UTF-8: {e}") from None
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
    if not isinstance(delta.meta, ArrayMeta):
        return False   # `apply` names what is wrong with it
    dtype, shape = _array_layout(delta.meta, limits)
    if _array_base(old, dtype).shape != shape:
        raise bad(f"xor of shape {list(shape)} onto an array of shape {list(old.shape)}")
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
    base_bytes, out_bytes = byte_view(base), byte_view(out)
    if codec == "raw":
        np.bitwise_xor(words(base_bytes), words(np.frombuffer(data, np.uint8)), out=words(out_bytes))
        return
    done = 0
    try:
        for window in safe_zstd.decompress_chunks(data, base.nbytes, XOR_WINDOW_BYTES):
            done = _xor_window(base_bytes, window, out_bytes, done)
    except safe_zstd.DecompressionRejected as e:
        if out is base:
            _undo_xor_windows(out_bytes, data, done)
        raise bad(f"zstd payload rejected: {e}") from None


def _xor_window(base_bytes: np.ndarray, window, out_bytes: np.ndarray, at: int) -> int:
    end = at + len(window)
    np.bitwise_xor(words(base_bytes[at:end]), words(np.frombuffer(window, np.uint8)), out=words(out_bytes[at:end]))
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
    nbytes = delta.meta.nbytes
    if codec == "raw":
        decoded = data
    else:
        try:
            decoded = safe_zstd.decompress(data, max_output=nbytes)
        except safe_zstd.DecompressionRejected as e:
            raise bad(f"zstd payload rejected: {e}") from None
    if len(decoded) != nbytes:
        raise bad(f"payload decodes to {len(decoded)} bytes; meta says {nbytes}")
    return decoded


def _encoded_payload(delta: FieldDelta, expected: int, room: int) -> tuple[str, memoryview]:
    """The payload's codec ("raw" or "zstd") and its bytes as they came, once the meta is checked:
    `expected` bytes decoded, fitting in `room`. A raw payload is checked to be `expected` bytes."""
    nbytes, codec = delta.meta.nbytes, delta.meta.codec
    if nbytes < 0:
        raise bad(f"meta nbytes must not be negative, not {nbytes}")
    if expected > room:
        raise DeltaError(codes.TOO_LARGE, f"a payload of {expected} bytes does not fit in the {max(room, 0)} "
                                          "bytes the field limit leaves")
    if nbytes != expected:
        raise bad(f"meta says nbytes={nbytes}; dtype and shape make it {expected}")
    if delta.data is None:
        raise bad("the delta needs a payload frame")
    data = memoryview(delta.data).cast("B")
    if codec not in ("raw", "zstd"):
        raise bad(f"unknown codec {codec!r}")
    if codec == "raw" and len(data) != nbytes:
        raise bad(f"payload decodes to {len(data)} bytes; meta says {nbytes}")
    return codec, data


def _new_array(dtype: np.dtype, shape: tuple[int, ...], parts: list) -> np.ndarray:
    """A fresh C-contiguous array filled from byte buffers: nothing aliases the ZMQ frames (the
    daemon frees them) or the old value."""
    out = np.empty(shape, dtype)
    flat, at = byte_view(out), 0
    for part in parts:
        part = np.frombuffer(part, np.uint8)
        flat[at:at + part.size] = part
        at += part.size
    return out


def _checked_bools(array: np.ndarray) -> np.ndarray:
    """numpy bools must be bytes 0 or 1; any other byte is a value numpy's own code never makes."""
    if array.dtype == np.bool_ and byte_view(array).max(initial=0) > 1:
        raise bad("bool array holds bytes other than 0 and 1")
    return array


def _expect_no_payload(data) -> None:
    if data is not None:
        raise bad("this delta carries no payload frame")
