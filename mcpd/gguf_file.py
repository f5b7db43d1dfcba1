"""A GGUF file (llama.cpp's model format) opened for reading with the gguf package's reader, and
its metadata values read with their types checked. Free of torch: the scheduler builds its
tokenizer from the file and the pool keeper sizes its pool from it.

A GGUF is a file an operator was handed: every way it can lie (a truncated file, tensor data past
its end, an array longer than the file, a type id the package does not know, a device or a
directory in its place) ends in one BadGGUF saying how. The reader maps the file and reads
arrays as views of the map, so a length that lies fails on the bounds, not on an allocation.
"""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

SUFFIX = ".gguf"
HEADER_BYTES = 24   # magic, version, tensor count, metadata count
# Architecture.hf's key: matrix parameter name -> its form ("int8", "q4_0", ... "q6_k"), or for a
# fused matrix whose pieces mix forms, ((form, rows), ...) of its parts in row order (part_name).
KEPT_QUANTIZED = "kept_quantized"
_opened: dict[tuple, object] = {}   # one reader per file: a worker reads it for the skeleton, weights and tokenizer


class BadGGUF(ValueError):
    """A GGUF file that cannot be read as one, or whose metadata lies; its reader prefixes the path."""


def is_gguf(path: str) -> bool:
    return path.endswith(SUFFIX)


def open_gguf(path: Path):
    """The gguf package's GGUFReader over path (kept for the next call while the file is unchanged)."""
    try:
        info = os.stat(path)   # follows a symlink: a link to /dev/zero is a character device
    except OSError as e:
        raise BadGGUF(f"cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadGGUF("not a regular file")
    if info.st_size < HEADER_BYTES:
        raise BadGGUF(f"truncated ({info.st_size} bytes, shorter than a GGUF header)")
    key = (os.path.realpath(path), info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _opened:
        _opened.clear()
        _opened[key] = _read(path)
    return _opened[key]


def part_name(name: str, index: int) -> str:
    """Parameter `name` ("x.weight", or a piece beside it: "x.weight_q4d") of part `index` of a
    matrix kept in parts (models/split_linear.py): "x.parts.<index>.weight"."""
    module, _, parameter = name.rpartition(".")
    return f"{module}.parts.{index}.{parameter}"


def forget() -> None:
    """Drop the kept reader, and with it the map of the file: a worker that has copied the
    weights out would otherwise keep every page it read resident."""
    _opened.clear()


def _read(path: Path):
    from gguf import GGUFReader   # numpy and the package: only for a GGUF model

    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, OSError) as e:
        # ValueError: bad magic, an unknown type id ("99 is not a valid GGMLQuantizationType"),
        # data past the end (a view that does not fit); KeyError/ValueError: a duplicate name.
        raise BadGGUF(f"not a readable GGUF file ({e})") from None


def value(reader, key: str, kind: type, default=None):
    """Metadata `key` as `kind` (int, float, str, bool or list); default where absent, BadGGUF
    where it has another type."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        got = field.contents()
    except (ValueError, IndexError) as e:   # a string that is not UTF-8
        raise BadGGUF(f"{key}: unreadable ({e})") from None
    if kind is float and type(got) is int:
        got = float(got)
    if type(got) is not kind:
        raise BadGGUF(f"metadata {key} is {type(got).__name__}, expected {kind.__name__}")
    return got


def strings(reader, key: str) -> list[str] | None:
    """The string array `key`, or None where absent; BadGGUF where it holds anything else."""
    got = value(reader, key, list)
    if got is not None and not all(type(s) is str for s in got):
        raise BadGGUF(f"metadata {key}: expected an array of strings")
    return got
