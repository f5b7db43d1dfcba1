"""The context journal's figures as the scheduler reports them (Journal.stats), apart from the
journal itself so that every process can decode them without loading it."""
from __future__ import annotations

import msgspec

from mcpd.histogram import Snapshot


class JournalStats(msgspec.Struct, frozen=True):
    enabled: bool
    fsync: str              # contexts.fsync: always, interval or never
    restored: int           # contexts restored from disk at start
    journal_bytes: int      # since its snapshot
    generation: int
    damaged_bytes: int
    state: str              # ok, unusable, or refusing changes until a snapshot is written
    fsync_seconds: Snapshot
