"""Reading a small file an operator named or a stranger may have put in its place (a config, a
key file, a warm-up file): a regular file of bounded size, read without blocking on a FIFO or
flooding the reader from a device such as /dev/zero."""
from __future__ import annotations

import json
import os
import stat

MAX_JSON_BYTES = 64 << 20   # a model directory's JSON files (config.json, tokenizer_config.json) are far smaller


class NotSmallFile(ValueError):
    """Why the file is not one to read; the caller says which file and what it was for."""


def read_bytes(path: str | os.PathLike, max_bytes: int, follow_links: bool = True) -> bytes:
    """The file's bytes; OSError where it cannot be opened, NotSmallFile where it is not a
    regular file or holds more than `max_bytes`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotSmallFile("not a regular file")
        if st.st_size > max_bytes:
            raise NotSmallFile(f"{st.st_size} bytes, more than the {max_bytes} it may hold")
        data = f.read(max_bytes + 1)   # the file may have grown since fstat
    if len(data) > max_bytes:
        raise NotSmallFile(f"more than the {max_bytes} bytes it may hold")
    return data


def read_text(path: str | os.PathLike, max_bytes: int, follow_links: bool = True) -> str:
    """read_bytes' bytes as UTF-8 text; NotSmallFile where they are not."""
    try:
        return read_bytes(path, max_bytes, follow_links).decode()
    except UnicodeDecodeError as e:
        raise NotSmallFile(f"not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in the file; NotSmallFile where read_text refuses it or it is no JSON (a
    number past Python's 4300 digits, or nesting too deep, included)."""
    text = read_text(path, max_bytes)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise NotSmallFile(f"not JSON ({e})") from None
