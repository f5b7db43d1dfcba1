"""diff: the smallest delta that turns a field's old value into its new one (the sender's side)."""
from __future__ import annotations

import struct
from functools import partial

import numpy as np

from mcpd.protocol.change_entry import ArrayMeta, BytesMeta, NoMeta, ScalarMeta, StrMeta
from mcpd.protocol.delta.field import (ALLOWED_DTYPES, FieldDelta, MSGPACK_INT_RANGE, SCALAR_TYPES,
                                       byte_view, words, xor_words)
from mcpd.protocol.delta.compress import IDENTICAL, SAMPLE_BYTES, pack, sample_ratio, squeeze, squeeze_xor


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
    return FieldDelta(name, "set", ScalarMeta(new), None)


def delete(name: str) -> FieldDelta:
    return FieldDelta(name, "delete", NoMeta(), None)


def _diff_array(name: str, old, new: np.ndarray) -> FieldDelta | None:
    if new.dtype.str not in ALLOWED_DTYPES:
        raise TypeError(f"field {name!r}: dtype {new.dtype} is not a plain numeric dtype")
    new_bytes = byte_view(new)
    meta = partial(ArrayMeta, dtype=new.dtype.str, shape=new.shape)
    if _extends(old, new, new_bytes):
        # Only the new rows travel. Their encoding is never meaningfully larger than the whole
        # array's (they are a suffix of it), so set is not worth a compression pass.
        added = partial(ArrayMeta, dtype=new.dtype.str, shape=(new.shape[0] - old.shape[0], *new.shape[1:]))
        return pack(name, "append", added, new_bytes[old.nbytes:])
    if not _same_layout(old, new):
        return pack(name, "set", meta, new_bytes)
    old_bytes = byte_view(old)
    if new_bytes.size > SAMPLE_BYTES:
        squeezed = squeeze_xor(old_bytes, new_bytes)
    else:
        flips = xor_words(old_bytes, new_bytes).view(np.uint8)
        squeezed = squeeze(flips) if flips.any() else IDENTICAL
    if squeezed is IDENTICAL:
        return None
    if squeezed is None:
        # XOR bytes that do not compress are as many as the array's: set is no larger and does
        # not depend on the receiver's copy.
        return pack(name, "set", meta, new_bytes)
    xor = FieldDelta(name, "xor", meta(codec="zstd", nbytes=new_bytes.size), squeezed)
    if not _whole_may_beat(new_bytes, len(squeezed)):
        return xor
    whole = pack(name, "set", meta, new_bytes)
    # On a tie, set wins, for the same reason.
    return whole if len(whole.data) <= len(squeezed) else xor


def _same_layout(old, new: np.ndarray) -> bool:
    return isinstance(old, np.ndarray) and old.dtype.str == new.dtype.str and old.shape == new.shape


def _extends(old, new: np.ndarray, new_bytes: np.ndarray) -> bool:
    """Whether `new` is `old` with rows added along axis 0."""
    if not (isinstance(old, np.ndarray) and old.dtype.str == new.dtype.str and old.ndim == new.ndim >= 1
            and old.shape[1:] == new.shape[1:] and old.shape[0] < new.shape[0]):
        return False
    return bool(np.array_equal(words(new_bytes[:old.nbytes]), words(byte_view(old))))


def _whole_may_beat(new_bytes: np.ndarray, edit_size: int) -> bool:
    """Whether packing the whole array might come out smaller than the edit. A full zstd pass
    over a large array costs more than the rest of the diff, so a sample decides; it estimates,
    hence the factor of two."""
    return new_bytes.size <= SAMPLE_BYTES or new_bytes.size / sample_ratio(new_bytes) < 2 * edit_size


def _diff_text(name: str, old, new: bytes | str) -> FieldDelta:
    meta = StrMeta if isinstance(new, str) else BytesMeta
    if type(old) is type(new) and len(new) > len(old) and new.startswith(old):
        return pack(name, "append", meta, _text_bytes(new[len(old):]))
    return pack(name, "set", meta, _text_bytes(new))


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
