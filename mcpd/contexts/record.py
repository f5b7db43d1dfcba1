"""What persistence keeps of a context, in one encoding for every place that keeps it: a small
msgpack-able map and the payload frames it refers to, in order.

Two kinds: a commit (commit.py: the deltas one version made) and a snapshot (snapshot.py: the
whole context at one version). The journal writes a record as one msgpack body with the frames
inside it (journal_file.py); the host cache as the map followed by the frames as they are, never
copied into one buffer first (cache_entry.py). Both read back the same (meta, frames) pair and
hand it to the same decoder.
"""
from __future__ import annotations

from typing import NamedTuple


class Record(NamedTuple):
    meta: dict
    frames: list   # bytes-like: bytes, or views of the context's own arrays (written, never kept)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(frame).nbytes for frame in self.frames)
