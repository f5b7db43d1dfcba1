"""A field delta's value types and the checks and byte views every part of the codec shares."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mcpd.protocol import codes
from mcpd.protocol.change_entry import ANY_META, DeltaError

ALLOWED_DTYPES = frozenset(
    np.dtype(t).newbyteorder(order).str
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64,
              np.uint8, np.uint16, np.uint32, np.uint64, np.float16, np.float32, np.float64)
    for order in "<>")
MSGPACK_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
SCALAR_TYPES = (type(None), bool, int, float)


@dataclass(frozen=True)
class FieldDelta:
    name: str
    kind: str            # set, append, xor or delete (protocol/change_entry.py)
    meta: ANY_META       # see the table in the package docstring (__init__.py)
    data: bytes | None   # the payload (any bytes-like object when it came off the wire); None for scalars, delete


@dataclass(frozen=True)
class DeltaLimits:
    max_field_bytes: int = 256 << 20
    max_ndim: int = 8


class _Deleted:
    def __repr__(self) -> str:
        return "DELETED"


DELETED = _Deleted()   # what `apply` returns for a delete: None is a value a field can hold


def bad(message: str) -> DeltaError:
    return DeltaError(codes.BAD_REQUEST, message)


def size_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def byte_view(array: np.ndarray) -> np.ndarray:
    """The array's bytes as flat uint8 (a view when the array is C-contiguous, else a copy)."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array.reshape(-1).view(np.uint8)


def words(byte_view: np.ndarray) -> np.ndarray:
    """The widest unsigned-int view of the bytes: numpy compares and XORs 8 bytes at a time."""
    for word in (np.uint64, np.uint32, np.uint16):
        if byte_view.size % np.dtype(word).itemsize == 0:
            return byte_view.view(word)
    return byte_view


def xor_words(old_bytes: np.ndarray, new_bytes: np.ndarray) -> np.ndarray:
    return np.bitwise_xor(words(old_bytes), words(new_bytes))
