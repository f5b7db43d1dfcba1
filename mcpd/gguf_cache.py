"""A GGUF file's metadata (gguf_metadata.py) kept in the daemon's runtime directory, so that the
gguf package reads a file's header once for the whole daemon (the supervisor, at its check of the
config) instead of once in each process: seconds of CPU each on a real model.

A kept copy is used only for the file it was made from, as that file is now: it names the file's
size, modification time and the SHA-256 of its whole header (metadata and tensor table, the bytes
everything kept was read from), and its own body's SHA-256. Anything else (another model's copy,
a file changed in place, a truncated or edited copy, a link, a copy that does not parse or whose
tensors lie outside the file) is read from the file again and kept anew. The runtime directory
is the daemon's own (trusted_path.py): nobody but its user writes there.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mcpd.refusal import UnsafePath
from mcpd.security.trusted_path import open_private_file

if TYPE_CHECKING:   # numpy and the gguf package: imported by a process that opens a GGUF
    from mcpd.gguf_metadata import GGUFMetadata, TensorInfo

FORMAT = 1
MAX_BYTES = 1 << 30   # far above a real header's metadata (Llama 3's 128k tokens and merges: ~10 MB)
log = logging.getLogger("mcpd.gguf")
_directory: Path | None = None


class Unusable(ValueError):
    """A kept copy that is not the file's metadata as the file is now."""


def keep_in(directory: Path | None) -> None:
    """Keep and look for copies in `directory` (the runtime directory); None: nowhere."""
    global _directory
    _directory = directory


def load(path: Path, info: os.stat_result) -> "GGUFMetadata | None":
    """The kept metadata of the file at `path` (stat `info`), or None where none is usable."""
    copy = _copy_path(path)
    if copy is None:
        return None
    try:
        with os.fdopen(open_private_file(copy, os.O_RDONLY), "rb") as f:
            text = f.read(MAX_BYTES + 1)
        return _parsed(text, path, info)
    except FileNotFoundError:
        return None
    except (OSError, UnsafePath, ValueError, TypeError, KeyError, RecursionError) as e:   # ValueError: Unusable, bad JSON
        log.warning("%s: its kept metadata %s is not used (%s); reading the file", path.name, copy, e)
        return None


def store(metadata: "GGUFMetadata", info: os.stat_result) -> None:
    """Keep `metadata`, read from the file of stat `info`, for the other processes."""
    copy = _copy_path(metadata.path)
    if copy is None:
        return
    body = json.dumps(_body(metadata), ensure_ascii=False, separators=(",", ":")).encode()
    scratch = copy.with_name(f".{copy.name}.{os.getpid()}")
    try:
        head = {"format": FORMAT, "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                "header_bytes": metadata.header_bytes,
                "header_sha256": _header_digest(metadata.path, metadata.header_bytes),
                "body_sha256": hashlib.sha256(body).hexdigest()}
        with os.fdopen(open_private_file(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(json.dumps(head).encode() + b"\n" + body)
        os.replace(scratch, copy)   # whole or not at all, for a process reading it now
    except (OSError, UnsafePath, Unusable) as e:   # Unusable: the file shrank since it was read
        scratch.unlink(missing_ok=True)
        log.warning("%s: its metadata cannot be kept in %s (%s)", metadata.path.name, copy, e)


def _copy_path(path: Path) -> Path | None:
    if _directory is None:
        return None
    return _directory / f"gguf-{hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()[:32]}.json"


def _header_digest(path: Path, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while length > 0:
            chunk = f.read(min(length, 1 << 20))
            if not chunk:
                raise Unusable("the file is shorter than its header")
            digest.update(chunk)
            length -= len(chunk)
    return digest.hexdigest()


def _body(metadata: "GGUFMetadata") -> dict:
    return {"values": metadata.values, "unreadable": metadata.unreadable, "swapped": metadata.swapped,
            "tensors": [[t.name, int(t.tensor_type), list(t.shape), t.data_offset] for t in metadata.tensors]}


def _parsed(text: bytes, path: Path, info: os.stat_result) -> "GGUFMetadata":
    if len(text) > MAX_BYTES:
        raise Unusable(f"larger than {MAX_BYTES} bytes")
    head_line, _, body = text.partition(b"\n")
    head = json.loads(head_line)
    if head.get("format") != FORMAT:
        raise Unusable(f"format {head.get('format')!r}, not {FORMAT}")
    if (head.get("size"), head.get("mtime_ns")) != (info.st_size, info.st_mtime_ns):
        raise Unusable("made from another version of the file (size or modification time)")
    header_bytes = head.get("header_bytes")
    if type(header_bytes) is not int or not 0 < header_bytes <= info.st_size:
        raise Unusable(f"header length {header_bytes!r} is not within the file")
    if head.get("header_sha256") != _header_digest(path, header_bytes):
        raise Unusable("made from another file, or from this one before it changed (header digest)")
    if head.get("body_sha256") != hashlib.sha256(body).hexdigest():
        raise Unusable("its body is not the one it was made with (digest)")
    return _metadata(json.loads(body), path, header_bytes, info.st_size)


def _metadata(body: dict, path: Path, header_bytes: int, size: int) -> "GGUFMetadata":
    from mcpd.gguf_metadata import GGUFMetadata

    values, unreadable, swapped = body["values"], body["unreadable"], body["swapped"]
    if not (isinstance(values, dict) and isinstance(unreadable, dict) and type(swapped) is bool):
        raise Unusable("its values are not a map")
    tensors = [_tensor(entry, header_bytes, size) for entry in body["tensors"]]
    return GGUFMetadata(path, header_bytes, values, {str(k): str(v) for k, v in unreadable.items()}, tensors, swapped)


def _tensor(entry: list, header_bytes: int, size: int) -> "TensorInfo":
    """A kept tensor, checked as the reader checks it: a known type, whole dimensions, its data
    within the file after the header."""
    from gguf.constants import GGMLQuantizationType

    from mcpd.gguf_metadata import TensorInfo

    name, type_id, shape, offset = entry
    if not (type(name) is str and type(type_id) is int and type(offset) is int and isinstance(shape, list)
            and all(type(n) is int and n >= 0 for n in shape)):
        raise Unusable(f"tensor entry {str(entry)[:100]} is not (name, type, shape, offset)")
    tensor = TensorInfo(name, GGMLQuantizationType(type_id), tuple(shape), offset)
    if not header_bytes <= offset <= offset + tensor.n_bytes <= size:
        raise Unusable(f"tensor {name!r} lies outside the file's data")
    return tensor
