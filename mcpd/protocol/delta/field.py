"""A field delta's value types and the checks and byte views every part of the codec shares."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


KINDS = ("set", "append", "xor", "delete")
MAX_NAME_CHARS = 256
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
    kind: str            # one of KINDS
    meta: dict           # see the table in the package docstring (__init__.py)
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


def required(meta: dict, key: str, kind: type | tuple[type, ...]):
    value = meta.get(key)
    # bool is an int in Python but never a size or a count on the wire.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad(f"meta {key!r} must be {_type_names(kind)}, not {type(value).__name__}")
    return value


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


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
