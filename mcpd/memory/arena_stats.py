"""A host cache segment's figures (ShmArena.stats), apart from the arena so that every process
decodes them without loading numpy."""
from __future__ import annotations

import msgspec


class ArenaStats(msgspec.Struct, frozen=True):
    total_bytes: int
    used_bytes: int               # its pages handed out
    held_bytes: int               # what its entries hold of those pages
    stored_bytes: int             # what its entries store
    page_bytes: int
    entries: int
    slots: int
    entries_by_kind: list[int]    # by host_segment's kind (CONTEXT, CONTEXT_DELTA, KV_BLOCK)
    hits: int
    misses: int
    evictions: int
    inserts: int
    refused: int
    moved: int                    # blocks moved to free a page
    hit_rate: float
