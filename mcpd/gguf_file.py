"""A GGUF file (llama.cpp's model format) opened for reading with the gguf package's reader, and
its metadata values read with their types checked. Free of torch: the scheduler builds its
tokenizer from the file and the pool keeper sizes its pool from it. The daemon reads a file's
header once: the other processes take it from the copy kept in the runtime directory (gguf_cache.py).

A GGUF is a file an operator was handed: every way it can lie (a truncated file, tensor data past
its end, an array longer than the file, a type id the package does not know, a device or a
directory in its place) ends in one BadGGUF saying how. The reader maps the file and reads
arrays as views of the map, so a length that lies fails on the bounds, not on an allocation.
"""
from __future__ import annotations

import logging
import os
import stat
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mcpd.bad_gguf import BadGGUF

if TYPE_CHECKING:
    from mcpd.gguf_metadata import GGUFMetadata

SUFFIX = ".gguf"
HEADER_BYTES = 24   # magic, version, tensor count, metadata count
# Architecture.hf's key: matrix parameter name -> its form ("int8", "q4_0", ... "q6_k"), or for a
# fused matrix whose pieces mix forms, ((form, rows), ...) of its parts in row order (part_name).
KEPT_QUANTIZED = "kept_quantized"
SLOW_READ_S = 1.0   # a read of the metadata that took longer says how long
log = logging.getLogger("mcpd.gguf")
_opened: dict[tuple, "GGUFMetadata"] = {}   # one file's: a worker reads it for the skeleton, weights and tokenizer


def is_gguf(path: str) -> bool:
    return path.endswith(SUFFIX)


def open_gguf(path: Path) -> "GGUFMetadata":
    """The file's metadata and tensor table (gguf_metadata.py): kept from the last call while the
    file is unchanged, else from the copy another process kept (gguf_cache.py), else read with the
    gguf package's reader (and kept for the others)."""
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
        from mcpd import gguf_cache

        _opened.clear()
        _opened[key] = gguf_cache.load(Path(path), info) or _read(Path(path), info)
    return _opened[key]


def part_name(name: str, index: int) -> str:
    """Parameter `name` ("x.weight", or a piece beside it: "x.weight_q4d") of part `index` of a
    matrix kept in parts (models/split_linear.py): "x.parts.<index>.weight"."""
    module, _, parameter = name.rpartition(".")
    return f"{module}.parts.{index}.{parameter}"


def forget() -> None:
    """Drop the kept metadata, and with it the map of the file: a worker that has copied the
    weights out would otherwise keep every page it read resident."""
    _opened.clear()


def _read(path: Path, info: os.stat_result) -> "GGUFMetadata":
    from gguf import GGUFReader   # numpy and the package: only for a GGUF model

    from mcpd import gguf_cache, gguf_metadata

    log.info("%s: reading its metadata", path.name)
    started = time.monotonic()
    try:
        metadata = gguf_metadata.from_reader(GGUFReader(path), path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, OSError) as e:
        # ValueError: bad magic, an unknown type id ("99 is not a valid GGMLQuantizationType"),
        # data past the end (a view that does not fit); KeyError/ValueError: a duplicate name.
        raise BadGGUF(f"not a readable GGUF file ({e})") from None
    if time.monotonic() - started > SLOW_READ_S:
        log.info("%s: metadata read in %.1f s", path.name, time.monotonic() - started)
    gguf_cache.store(metadata, info)
    return metadata


def value(metadata, key: str, kind: type, default=None):
    """Metadata `key` as `kind` (int, float, str, bool or list); default where absent, BadGGUF
    where it has another type."""
    got = metadata.value(key)
    if got is None:
        return default
    if kind is float and type(got) is int:
        got = float(got)
    if type(got) is not kind:
        raise BadGGUF(f"metadata {key} is {type(got).__name__}, expected {kind.__name__}")
    return got


def strings(metadata, key: str) -> list[str] | None:
    """The string array `key`, or None where absent; BadGGUF where it holds anything else."""
    got = value(metadata, key, list)
    if got is not None and not all(type(s) is str for s in got):
        raise BadGGUF(f"metadata {key}: expected an array of strings")
    return got
